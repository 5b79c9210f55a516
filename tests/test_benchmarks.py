"""Fast checks of the benchmark harness's prompt sets, methods and command line (no vLLM
engine)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks import datasets, methods
from benchmarks.server import cli_flags
from benchmarks.sse import data_events

# -- datasets -------------------------------------------------------------------------

def test_round_robin_takes_one_of_each_group_in_turn():
    rows = [{"c": c, "i": i} for c in "aab" for i in range(1)] + [{"c": "b", "i": 1}]
    assert [r["c"] for r in datasets.round_robin(rows, "c")] == ["a", "b", "a", "b"]


def test_mt_bench_selection_covers_categories_with_both_turns():
    samples = datasets.load("mt_bench", 8)
    assert [s.category for s in samples] == list(datasets.MT_BENCH_CATEGORIES)
    assert all(len(s.turns) == 2 for s in samples)


def test_spec_bench_takes_n_per_category_with_mt_bench_merged():
    samples = datasets.load("spec_bench", 3)
    categories = [s.category for s in samples]
    assert {c: categories.count(c) for c in categories} == dict.fromkeys(
        datasets.SPEC_BENCH_CATEGORIES, 3)
    mt = [s for s in samples if s.category == "mt_bench"]
    assert [s.id for s in mt] == ["spec_bench/81", "spec_bench/91", "spec_bench/101"]


def test_humaneval_is_instruct_style_and_deterministic():
    first, second = datasets.load("humaneval", 2), datasets.load("humaneval", 2)
    assert first == second and first[0].id == "HumanEval/0"
    assert first[0].turns[0].startswith("Complete the following Python function.")
    assert "def has_close_elements" in first[0].turns[0]


def test_code_edit_hands_over_a_whole_function_to_change():
    samples = datasets.load("code_edit", 5)
    assert samples[0].id == "code_edit/HumanEval/163"  # from the last task backwards
    assert [s.category for s in samples] == ["rename", "type_hints", "comments", "logging",
                                             "rename"]
    assert "def generate_integers(a, b):" in samples[0].turns[0]
    assert "return [i for i in range(lower, upper+1)" in samples[0].turns[0]  # the body too


def test_unknown_dataset_is_an_error():
    with pytest.raises(ValueError, match="unknown dataset"):
        datasets.load("gsm8k", 1)


# -- methods --------------------------------------------------------------------------

def test_override_merges_over_the_default():
    registry = methods.with_overrides(
        methods.DEFAULT_METHODS, ['lookahead={"num_speculative_tokens": 8, "ngram_size": 5}'])
    assert registry["lookahead"].config == {"method": "lookahead", "num_speculative_tokens": 8,
                                            "ngram_size": 5}
    assert methods.DEFAULT_METHODS["lookahead"].config == {"method": "lookahead"}


def test_variant_inherits_its_methods_default():
    registry = methods.with_overrides(
        methods.DEFAULT_METHODS, ['ngram-k3={"method": "ngram", "num_speculative_tokens": 3}'])
    assert registry["ngram-k3"].config == {**methods.DEFAULT_METHODS["ngram"].config,
                                           "num_speculative_tokens": 3}
    assert registry["ngram"] == methods.DEFAULT_METHODS["ngram"]


@pytest.mark.parametrize("text, message", [
    ("lookahead", "NAME=JSON"),
    ("lookahead={oops}", "invalid JSON"),
    ("lookahead=[1]", "JSON object"),
    ('new-thing={"num_speculative_tokens": 2}', "must name its"),
    ('none={"num_speculative_tokens": 2}', "without speculation"),
    ('none-k2={"method": "none", "num_speculative_tokens": 2}', "without speculation"),
])
def test_bad_overrides_are_explained(text, message):
    with pytest.raises(ValueError, match=message):
        methods.with_overrides(methods.DEFAULT_METHODS, [text])


def test_a_variant_of_no_speculation_differs_only_by_its_engine():
    from benchmarks.run import _method_engine_args, _selected_methods, build_parser

    args = build_parser().parse_args([
        "--methods", "none,lookahead", "--method-config", 'none-sync={"method": "none"}',
        "--method-engine-args", 'none-sync={"async_scheduling": false}'])
    selected = _selected_methods(args)
    assert list(selected) == ["none", "lookahead", "none-sync"]
    assert selected["none-sync"].config is None
    assert methods.speculative_config(selected["none-sync"]) is None
    assert _method_engine_args(args.method_engine_args, selected) == {
        "none-sync": {"async_scheduling": False}}


def test_draft_model_needs_its_target_unless_a_draft_is_given():
    draft = methods.DEFAULT_METHODS["draft_model"]
    assert "qwen2.5-coder-1.5b" in methods.unavailable_reason(draft, "smollm2-135m")
    assert methods.unavailable_reason(draft, "qwen2.5-coder-1.5b") is None
    custom = methods.with_overrides(methods.DEFAULT_METHODS,
                                    ['draft_model={"model": "/models/draft"}'])["draft_model"]
    assert methods.unavailable_reason(custom, "smollm2-135m") is None
    assert methods.speculative_config(custom)["model"] == "/models/draft"


def test_cli_adds_new_variants_to_the_run():
    from benchmarks.run import _selected_methods, build_parser

    args = build_parser().parse_args([
        "--methods", "none,lookahead", "--method-config", 'lookahead={"ngram_size": 5}',
        "--method-config", 'lookahead-k8={"method": "lookahead", "num_speculative_tokens": 8}'])
    selected = _selected_methods(args)
    assert list(selected) == ["none", "lookahead", "lookahead-k8"]
    assert selected["lookahead"].config["ngram_size"] == 5
    assert "ngram_size" not in selected["lookahead-k8"].config
    with pytest.raises(ValueError, match="unknown method"):
        _selected_methods(build_parser().parse_args(["--methods", "none,medusa"]))


def test_methods_take_turns_on_each_dataset():
    """A machine whose speed drifts over minutes must slow every method alike: all
    methods run on one dataset (seed, concurrency) before the next dataset starts."""
    from benchmarks.run import measurement_plan

    plan = list(measurement_plan(["latency", "server"], {"none": 0, "lookahead": 0},
                                 {"humaneval": 0, "mt_bench": 0}, [0], [1, 16]))
    assert plan[:4] == [("latency", "humaneval", 0, None, "none"),
                        ("latency", "humaneval", 0, None, "lookahead"),
                        ("latency", "mt_bench", 0, None, "none"),
                        ("latency", "mt_bench", 0, None, "lookahead")]
    assert plan[4:8] == [("server", "humaneval", 0, 1, "none"),
                         ("server", "humaneval", 0, 1, "lookahead"),
                         ("server", "humaneval", 0, 16, "none"),
                         ("server", "humaneval", 0, 16, "lookahead")]
    assert len(plan) == 4 + 8


@pytest.mark.parametrize("text, expected", [
    ("20", {"*": 20}), ("20,spec_bench=10", {"*": 20, "spec_bench": 10}),
    ("humaneval=3", {"humaneval": 3})])
def test_prompt_counts(text, expected):
    from benchmarks.arguments import prompt_counts

    assert prompt_counts(text) == expected


@pytest.mark.parametrize("text", ["0", "x", "gsm8k=3", "spec_bench=-1"])
def test_bad_prompt_counts(text):
    import argparse

    from benchmarks.arguments import prompt_counts

    with pytest.raises(argparse.ArgumentTypeError):
        prompt_counts(text)


@pytest.mark.parametrize("text", ["0", "x", "4,-1", ",", "1,,2"])
def test_bad_counts_name_what_was_expected(text):
    """--concurrency, the replay's --batch-size, step_cost's lists: one parser."""
    import argparse

    from benchmarks.arguments import positive_ints

    assert positive_ints("1, 16") == [1, 16]
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers|integers like"):
        positive_ints(text)


@pytest.mark.parametrize("text", ["", "-1", "1,1", "1,,2", "x"])
def test_bad_seeds_name_what_was_expected(text):
    import argparse

    from benchmarks.arguments import seed_list

    assert seed_list("0, 3") == [0, 3]
    with pytest.raises(argparse.ArgumentTypeError, match="integers"):
        seed_list(text)


def test_missing_package_is_reported_with_the_install_command():
    method = methods.Method("x", {"method": "x"}, needs_module="no_such_module_here",
                            install_hint="pip install no-such")
    assert "pip install no-such" in methods.unavailable_reason(method, "smollm2-135m")
    assert methods.speculative_config(methods.DEFAULT_METHODS["none"]) is None


# -- server flags -------------------------------------------------------------------

def test_engine_args_become_server_flags():
    assert cli_flags({"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                      "max_model_len": 4096, "compilation_config": {"mode": 0}}) == [
        "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching",
        "--max-model-len", "4096", "--compilation-config", '{"mode": 0}']


#: A harness holding a stand-in server (an HTTP server whose /health answers 200).
HARNESS_HOLDING_A_SERVER = """
import pathlib, sys, time
from benchmarks.server import HOST, ApiServer
health = pathlib.Path(sys.argv[1])
(health / "health").write_text("ok")
server = ApiServer("unused", None, {}, startup_timeout=60)
server.command = [sys.executable, "-m", "http.server", "--bind", HOST, "--directory",
                  str(health), str(server.port)]
with server:
    print(server.pid, flush=True)
    time.sleep(600)
"""


def test_a_harness_sent_sigterm_stops_its_server(tmp_path):
    """In its own session, the server outlived a harness stopped by SIGTERM."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS_HOLDING_A_SERVER, str(tmp_path)],
                               stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    line = harness.stdout.readline()
    assert line, "the harness did not start its stand-in server"
    server_pid = int(line)
    try:
        harness.send_signal(signal.SIGTERM)
        harness.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server_pid), "the server outlived its harness"
    finally:
        if _running(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # gone since
        return False


# -- run folders ----------------------------------------------------------------------

def test_run_folder_is_dated_named_and_numbered_only_when_taken(tmp_path):
    import datetime

    from benchmarks.run_folder import make_run_folder

    today = datetime.date.today().isoformat()
    parent = tmp_path / "results"  # created on the way
    first = make_run_folder(parent, "cpu-2c-m-latency", "python -m benchmarks.run --a 'b c'")
    second = make_run_folder(parent, "cpu-2c-m-latency", "python -m benchmarks.run")
    third = make_run_folder(parent, "cpu-2c-m-latency", "python -m benchmarks.run")
    other = make_run_folder(parent, "cpu-2c-m-server", "python -m benchmarks.run")
    assert [f.name for f in (first, second, third, other)] == [
        f"{today}-cpu-2c-m-latency", f"{today}-cpu-2c-m-latency-2",
        f"{today}-cpu-2c-m-latency-3", f"{today}-cpu-2c-m-server"]
    assert (first / "command.txt").read_text() == "python -m benchmarks.run --a 'b c'\n"
    assert [p.name for p in first.iterdir()] == ["command.txt"]


def test_command_line_quotes_what_the_shell_would_need():
    import shlex

    from benchmarks.run_folder import command_line

    argv = ["--method-config", 'x={"method": "lookahead"}', "--mode", "latency"]
    command = command_line("benchmarks.run", argv)
    assert shlex.split(command) == [sys.executable, "-m", "benchmarks.run", *argv]


def test_run_cli_names_its_folder_by_machine_model_and_modes():
    from benchmarks.run import build_parser, run_name

    args = build_parser().parse_args(["--machine", "h100", "--mode", "latency,server"])
    assert args.output_dir.name == "results" and args.output_dir.parent.name == "benchmarks"
    assert run_name(args, "smollm2-135m") == "h100-smollm2-135m-latency-server"
    args = build_parser().parse_args(["--name", "smollm2-135m-latency-trees"])
    assert run_name(args, "smollm2-135m") == "smollm2-135m-latency-trees"


@pytest.mark.parametrize("name", ["a/b", "..", ""])
def test_run_folder_name_must_not_be_a_path(name, capsys):
    from benchmarks.run import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--name", name])
    assert "expected a folder name" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0.7", "--top-p", "0"], "--top-p in (0, 1]"),
    (["--seeds", "1,1", "--temperature", "0.7"], "distinct non-negative integers"),
    (["--interleave", "--mode", "throughput", "--round-size", "0"],
     "--round-size must be positive"),
])
def test_sampling_arguments_are_checked_before_anything_runs(argv, message, capsys):
    from benchmarks.run import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


# -- MTAD's pass@1 ----------------------------------------------------------------------

@pytest.mark.once
def test_mtad_pass_at_1_checker_runs_the_tasks_tests():
    import gzip

    from benchmarks.mtad import PASS_TIMEOUT_S, code_of, passes_tests

    with gzip.open(datasets.DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        task = json.loads(f.readline())
    body = task["canonical_solution"]
    answer = f"Here it is:\n```python\n{task['prompt']}{body}```\nDone."
    assert code_of(answer).startswith(task["prompt"])
    assert passes_tests(task, answer)
    assert not passes_tests(task, answer.replace(body, "    return False\n"))
    assert not passes_tests(task, "```python\nwhile True: pass\n```") and PASS_TIMEOUT_S <= 10


class _StreamedText:
    """An httpx streaming response's ``aiter_text``, in the given pieces."""

    def __init__(self, *pieces: str):
        self._pieces = pieces

    async def aiter_text(self):
        for piece in self._pieces:
            yield piece


def test_stream_events_split_only_at_sse_line_ends():
    """vLLM writes U+2028, U+2029 and U+0085 unescaped in its JSON (a sampled token may
    hold them); a line split there broke a T 1.0 server run. Events split across pieces
    and CRLF line ends still parse, and [DONE] is left out."""
    text = ["a\u2028b", "c\u2029d\x85e"]
    events = [json.dumps({"choices": [{"text": t}]}, ensure_ascii=False) for t in text]
    stream = f"data: {events[0]}\r\n\r\ndata: {events[1]}\n\ndata: [DONE]\n\n"

    async def parsed():
        return [event async for event in data_events(
            _StreamedText(stream[:9], stream[9:40], stream[40:]))]

    assert [event["choices"][0]["text"] for event in asyncio.run(parsed())] == text
