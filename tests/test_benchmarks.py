"""Fast checks of the benchmark harness's selection, parsing and metrics (no vLLM engine)."""

from __future__ import annotations

import enum
import json
import math
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest

from benchmarks import datasets, methods, metrics, report
from benchmarks.records import (
    RequestRecord,
    SpecDecodeCounters,
    proposer_counters,
    proposer_delta,
)
from benchmarks.server import cli_flags

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
    from benchmarks.run import prompt_counts

    assert prompt_counts(text) == expected


@pytest.mark.parametrize("text", ["0", "x", "gsm8k=3", "spec_bench=-1"])
def test_bad_prompt_counts(text):
    import argparse

    from benchmarks.run import prompt_counts

    with pytest.raises(argparse.ArgumentTypeError):
        prompt_counts(text)


@pytest.mark.parametrize("text", ["0", "x", "4,-1", ",", "1,,2"])
def test_bad_counts_name_what_was_expected(text):
    """--concurrency, the replay's --batch-size, step_cost's lists: one parser."""
    import argparse

    from benchmarks.run import positive_ints

    assert positive_ints("1, 16") == [1, 16]
    with pytest.raises(argparse.ArgumentTypeError, match="positive integers|integers like"):
        positive_ints(text)


@pytest.mark.parametrize("bad", ["0", "a", "1,,2"])
def test_the_replay_names_its_bad_batch_size(bad, monkeypatch, capsys):
    from benchmarks.replay import cli

    monkeypatch.setattr("sys.argv", ["replay", "run", "trace.json", "--batch-size", bad])
    with pytest.raises(SystemExit):
        cli.main()
    assert "--batch-size" in capsys.readouterr().err


def test_missing_package_is_reported_with_the_install_command():
    method = methods.Method("x", {"method": "x"}, needs_module="no_such_module_here",
                            install_hint="pip install no-such")
    assert "pip install no-such" in methods.unavailable_reason(method, "smollm2-135m")
    assert methods.speculative_config(methods.DEFAULT_METHODS["none"]) is None


# -- records --------------------------------------------------------------------------

def test_request_record_counts_token_carrying_passes():
    record = RequestRecord(conversation=0, turn=0, prompt_tokens=5, started=10.0)
    record.add_tokens(10.5, [1])
    record.add_tokens(10.6, [])  # a step without tokens for this request
    record.add_tokens(11.0, [2, 3, 4])
    record.finished = 11.1
    data = record.to_json("x/1", "cat")
    assert data["forward_passes"] == 2 and data["output_tokens"] == [1, 2, 3, 4]
    assert data["ttft"] == pytest.approx(0.5) and data["decode_seconds"] == pytest.approx(0.5)
    assert data["seconds"] == pytest.approx(1.1) and data["turn"] == 1


PROMETHEUS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:lookahead_step_fixed_seconds{engine="0",model_name="m"} NaN
vllm:lookahead_free_tokens{engine="0",model_name="m"} +Inf
vllm:lookahead_accepted_draft_tokens_total{engine="0",model_name="m",source="context"} 20.0
vllm:lookahead_accepted_draft_tokens_total{engine="0",model_name="m",source="pool"} 5.0
vllm:speculative_proposer_steps_total{engine="0",method="lookahead",model_name="m"} 40.0
vllm:speculative_proposer_seconds_total{engine="0",method="lookahead",model_name="m"} 0.5
vllm:lookahead_kept_draft_tokens_expected_total{engine="0",model_name="m"} 30.5
vllm:lookahead_kept_draft_tokens_matched_total{engine="0",model_name="m"} 25.0
vllm:lookahead_cut_draft_tokens_matched_total{engine="0",model_name="m"} 7.0
vllm:lookahead_step_token_seconds{engine="0",model_name="m"} 0.002
"""


def test_prometheus_counters_are_parsed():
    counters = SpecDecodeCounters.from_prometheus(PROMETHEUS)
    assert counters == SpecDecodeCounters(10, 60, 25, [9, 7])
    assert SpecDecodeCounters.from_prometheus("") == SpecDecodeCounters()
    assert proposer_counters("") == {}
    before = proposer_counters(PROMETHEUS)
    assert before["steps"] == 40 and before["kept_tokens_expected"] == 30.5
    assert before["cut_tokens_confirmed"] == 7
    assert math.isnan(before["step_fixed_seconds"])
    after = proposer_counters(PROMETHEUS.replace(" 40.0", " 50.0").replace(" 20.0", " 26.0"))
    delta = proposer_delta(before, after)
    assert delta["steps"] == 10 and delta["kept_tokens_matched"] == 0
    assert delta["step_token_seconds"] == 0.002  # a gauge: its value at the end
    assert delta["accepted_by_source"]["context"] == 6
    assert delta["accepted_by_source"]["corpus"] == 0  # not exported yet: none
    assert proposer_delta({}, {}) is None  # methods that export none


def test_vllm_metric_objects_are_summed_and_subtracted():
    @dataclass
    class Metric:
        name: str
        value: int = 0
        values: tuple = ()

    snapshot = [Metric("vllm:spec_decode_num_drafts", 4), Metric("vllm:spec_decode_num_drafts", 1),
                Metric("vllm:spec_decode_num_draft_tokens", 20),
                Metric("vllm:spec_decode_num_accepted_tokens", 6),
                Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=(3, 2, 1)),
                Metric("vllm:num_requests_running", 1)]
    after = SpecDecodeCounters.from_vllm_metrics(snapshot)
    assert after == SpecDecodeCounters(5, 20, 6, [3, 2, 1])
    assert after - SpecDecodeCounters(1, 5, 1, [1]) == SpecDecodeCounters(4, 15, 5, [2, 2, 1])


# -- engine loop (fake engine) --------------------------------------------------------

class FakeEngine:
    """Answers every request with `tokens_per_step` tokens per step until `length`."""

    def __init__(self, length: int, tokens_per_step: int):
        self.length, self.tokens_per_step = length, tokens_per_step
        self.active: dict[str, int] = {}
        self.added: list[tuple[str, list[int]]] = []
        self.max_active = 0

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, prompt["prompt_token_ids"]))
        self.active[request_id] = 0
        self.max_active = max(self.max_active, len(self.active))

    def step(self):
        outputs = []
        for request_id, done in list(self.active.items()):
            count = min(self.tokens_per_step, self.length - done)
            self.active[request_id] = done + count
            finished = done + count == self.length
            if finished:
                del self.active[request_id]
            outputs.append(types.SimpleNamespace(
                request_id=request_id, finished=finished,
                outputs=[types.SimpleNamespace(token_ids=list(range(done, done + count)))]))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm.sampling_params` without importing vLLM (slow to import)."""
    module = types.ModuleType("vllm.sampling_params")
    module.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", module)


class Params:
    output_kind = None

    def clone(self):
        return Params()


@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_drive_counts_passes_and_chains_turns(fake_vllm, max_in_flight):
    from benchmarks.engine_loop import drive

    engine = FakeEngine(length=7, tokens_per_step=3)

    def next_prompt(conversation, answers):  # conversation 0 has two turns, 1 and 2 one
        turns = 2 if conversation == 0 else 1
        return None if len(answers) >= turns else [conversation, *(t for answer in answers for t in answer)]

    loop = drive(engine, next_prompt, 3, Params(), max_in_flight=max_in_flight)
    assert len(loop.records) == 4
    assert all(r.output == list(range(7)) and r.forward_passes == 3 for r in loop.records)
    assert ("c0-t1", [0, *range(7)]) in engine.added  # turn 2 carries turn 1's answer
    assert engine.max_active == max_in_flight
    assert loop.engine_steps == (12 if max_in_flight == 1 else 6)


def test_run_one_by_one_keeps_its_latency_result(fake_vllm):
    from benchmarks.latency import run_one_by_one

    llm = types.SimpleNamespace(llm_engine=FakeEngine(length=5, tokens_per_step=2))
    result = run_one_by_one(llm, [[1], [2, 3]], Params())
    assert result.outputs == [list(range(5))] * 2
    assert (result.generated_tokens, result.forward_passes) == (10, 6)
    assert result.compression == pytest.approx(10 / 6) and result.seconds > 0


# -- metrics --------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, expected", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [], None),
])
def test_first_divergence(a, b, expected):
    assert metrics.first_divergence(a, b) == expected


def _request(id_, turn, tokens, passes, seconds=1.0, category="c", spec=None):
    return {"id": id_, "turn": turn, "category": category, "prompt_tokens": 3,
            "output_tokens": tokens, "forward_passes": passes, "seconds": seconds,
            "ttft": 0.1, "decode_seconds": seconds - 0.1, "spec_decode": spec}


def test_equality_compares_later_turns_only_after_identical_earlier_ones():
    reference = {("a", 1): [1, 2], ("a", 2): [3], ("b", 1): [1, 2], ("b", 2): [4, 4]}
    requests = [_request("a", 1, [1, 2], 2), _request("a", 2, [3], 1),
                _request("b", 1, [1, 5], 2), _request("b", 2, [4, 4], 2)]
    result = metrics.equality(requests, reference)
    assert result["1"] == {"compared": 2, "identical": 1, "prompt_differed": 0,
                           "first_divergence_mean": 1, "first_divergence_min": 1}
    assert result["2"]["compared"] == 1 and result["2"]["prompt_differed"] == 1


def _measurement(method, requests, mode="latency", dataset="spec_bench", wall=2.0, spec=None,
                 proposer=None, steps=8):
    return {"method": method, "mode": mode, "dataset": dataset, "concurrency": 1,
            "wall_seconds": wall, "engine_steps": steps, "requests": requests,
            "spec_decode": spec or {"drafts": 0, "draft_tokens": 0, "accepted": 0,
                                    "accepted_per_pos": []},
            "proposer": proposer}


def test_summary_rows_speedup_compression_and_acceptance():
    spec = {"drafts": 2, "draft_tokens": 8, "accepted": 4, "accepted_per_pos": [2, 1, 1, 0]}
    missed = {"drafts": 2, "draft_tokens": 8, "accepted": 0, "accepted_per_pos": [0, 0, 0, 0]}
    base = _measurement("none", [_request("q", 1, [1] * 8, 8, 2.0, "qa"),
                                 _request("r", 1, [2] * 4, 4, 1.0, "rag")])
    fast = _measurement("x", [_request("q", 1, [1] * 8, 2, 0.5, "qa", spec),
                              _request("r", 1, [2, 2, 2, 9], 2, 0.5, "rag", missed)],
                        proposer={"steps": 4, "seconds": 0.02,
                                  "accepted_by_source": {"context": 3, "pool": 1, "tree": 0}},
                        steps=4)
    rows = {(r["method"], r["group"]): r for r in metrics.summarize([base, fast])}
    overall = rows[("x", "all")]
    assert overall["tokens_per_second"] == pytest.approx(12.0)
    assert overall["speedup"] == pytest.approx(3.0)
    assert overall["compression"] == pytest.approx(3.0)
    assert overall["mean_acceptance_length"] == pytest.approx(2.0)
    assert overall["acceptance_per_position"] == [0.5, 0.25, 0.25, 0.0]
    assert overall["equality"]["1"]["identical"] == 1
    assert overall["proposer_ms_per_step"] == pytest.approx(5.0)
    assert overall["proposer_share"] == pytest.approx(0.01)
    assert overall["accepted_share_by_source"] == {"context": 0.75, "pool": 0.25, "tree": 0.0}
    assert rows[("x", "qa")]["accepted_share_by_source"] is None  # whole measurements only
    # shares are of vLLM's accepted tokens: what the sources miss shows as uncounted
    fast["proposer"]["accepted_by_source"] = {"context": 1, "pool": 1, "tree": 0}
    rows = {(r["method"], r["group"]): r for r in metrics.summarize([base, fast])}
    assert rows[("x", "all")]["accepted_share_by_source"] == {
        "context": 0.25, "pool": 0.25, "tree": 0.0, "uncounted": 0.5}
    assert rows[("x", "qa")]["speedup"] == pytest.approx(4.0)
    assert rows[("x", "rag")]["mean_acceptance_length"] == pytest.approx(1.0)
    assert rows[("none", "all")]["compression"] == 1.0


def test_batched_modes_use_wall_time_and_no_category_rows():
    base = _measurement("none", [_request("q", 1, [1] * 6, 6, 3.0)], mode="throughput", wall=3.0)
    rows = metrics.summarize([base])
    assert len(rows) == 1 and rows[0]["tokens_per_second"] == pytest.approx(2.0)


def test_sampled_runs_average_over_seeds_against_the_same_seeds_baseline():
    def run(method, seed, seconds):
        return {**_measurement(method, [_request("q", 1, [1] * 8, 4, seconds)],
                               dataset="humaneval"), "seed": seed, "temperature": 0.7}

    measurements = [run("none", 0, 2.0), run("x", 0, 1.0), run("none", 1, 4.0), run("x", 1, 1.0)]
    rows = {r["method"]: r for r in metrics.summarize(measurements)}
    assert len(rows) == 2 and rows["x"]["seeds"] == [0, 1]
    assert rows["x"]["concurrency"] == 1 and isinstance(rows["x"]["concurrency"], int)
    assert rows["x"]["speedup"] == pytest.approx(3.0)  # 2x with seed 0, 4x with seed 1
    assert rows["x"]["spread"]["speedup"] == pytest.approx(2 ** 0.5)
    assert rows["x"]["tokens_per_second"] == pytest.approx(8.0)
    assert rows["x"]["equality"] is None  # sampled outputs are not compared
    results = _results(measurements, methods={"none": None, "x": {"method": "x"}})
    results["settings"].update(temperature=0.7, top_p=0.95, seeds=[0, 1], datasets=["humaneval"])
    text = report.render_markdown(results, list(rows.values()))
    assert "Sampled at temperature 0.7, top-p 0.95, engine seeds 0, 1" in text
    assert "| humaneval | x | 8.0 ± 0.0 | 3.00x ± 1.41 | 2.00 ± 0.00 |" in text
    # greedy: the seeds repeat the same outputs, which are compared per seed
    for m in measurements:
        m["temperature"] = 0.0
    rows = {r["method"]: r for r in metrics.summarize(measurements)}
    assert rows["x"]["equality"]["1"]["identical"] == 1
    assert rows["x"]["spread"]["speedup"] == pytest.approx(2 ** 0.5)
    results["settings"].update(temperature=0.0)
    text = report.render_markdown(results, list(rows.values()))
    assert "Greedy, measured once per engine seed 0, 1 (the same outputs, repeated" in text


def test_missing_baseline_gives_na():
    rows = metrics.summarize([_measurement("x", [_request("q", 1, [1], 1)], dataset="humaneval")])
    assert rows[0]["speedup"] is None and rows[0]["equality"] is None


# -- server flags and report ----------------------------------------------------------

def test_engine_args_become_server_flags():
    assert cli_flags({"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False,
                      "max_model_len": 4096, "compilation_config": {"mode": 0}}) == [
        "--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching",
        "--max-model-len", "4096", "--compilation-config", '{"mode": 0}']


def _results(measurements, modes=("latency",), methods=None, runs=()):
    return {
        "created": "2026-01-01", "command": "python -m benchmarks.run",
        "machine": {"name": "cpu-2c", "cpu_model": "cpu", "cores_usable": 2,
                    "memory_gib": 8, "platform": "linux"},
        "software": {"vllm": "0"}, "git": {"commit": None, "dirty": None},
        "model": {"name": "m"}, "engine_args": {"dtype": "float32"},
        "settings": {"modes": list(modes), "max_tokens": 2, "num_prompts": {"spec_bench": 1}},
        "methods": methods or {"none": None}, "runs": list(runs), "measurements": measurements,
    }


def test_report_renders_every_mode(tmp_path):
    server = {**_measurement("none", [_request("q", 1, [1, 2], 2)], mode="server"),
              "concurrency": 4}
    results = _results(
        [_measurement("none", [_request("q", 1, [1, 2], 2)]), server],
        modes=("latency", "server"), methods={"none": None, "suffix": {"method": "suffix"}},
        runs=[{"method": "suffix", "mode": "latency", "status": "unavailable",
               "reason": "needs arctic_inference"}])
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    written = report.write_report(results, path)
    text = (tmp_path / "results.md").read_text()
    assert "**unavailable**: needs arctic_inference" in text and "spec_bench 1 per category" in text
    assert "| spec_bench/c | none |" in text and "| spec_bench | 4 | none |" in text
    # only `none` ran offline: S has a bar to draw, a speedup over itself has none
    assert {p.name for p in written} == {"results.md", "compression.png", "concurrency.png"}
    assert all(p.parent == tmp_path and p.stat().st_size > 0 for p in written)


@pytest.mark.parametrize("methods, speedup_plot", [
    (["none", "x"], True), (["x", "y"], False), (["none"], False)])
def test_speedup_plot_only_with_a_baseline_and_another_method(tmp_path, methods, speedup_plot):
    measurements = [_measurement(m, [_request("q", 1, [1, 2], 1 if m != "none" else 2)])
                    for m in methods]
    written = report.write_plots(_results(measurements),
                                 metrics.summarize(measurements), tmp_path)
    assert {p.name for p in written} == (
        {"compression.png", "speedup.png"} if speedup_plot else {"compression.png"})
    assert sorted(tmp_path.iterdir()) == sorted(written)


def test_report_cli_regenerates_tables_and_plots_from_a_results_json(tmp_path, capsys):
    measurements = [_measurement("none", [_request("q", 1, [1, 2], 2, 1.0)]),
                    _measurement("x", [_request("q", 1, [1, 2], 1, 0.5)])]
    folder = tmp_path / "2026-01-01-cpu-2c-m-latency"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(_results(measurements)))
    report.main([str(folder / "results.json")])
    assert sorted(p.name for p in folder.iterdir()) == [
        "compression.png", "results.json", "results.md", "speedup.png"]
    assert "| spec_bench | x | 4.0 | 2.00x | 2.00 |" in (folder / "results.md").read_text()
    assert capsys.readouterr().out.split() == [str(folder / n) for n in (
        "results.md", "speedup.png", "compression.png")]


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
])
def test_sampling_arguments_are_checked_before_anything_runs(argv, message, capsys):
    from benchmarks.run import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


# -- replay ---------------------------------------------------------------------------

@pytest.mark.parametrize("second_dataset, second_helped", [("b", False), ("a", True)])
def test_replay_gives_each_dataset_a_fresh_proposer(second_dataset, second_helped):
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import LookaheadReplayer

    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    trace = [Request("a", "c", [1, 2, 3], answer), Request(second_dataset, "c", [1, 2, 3], answer)]
    results = replay(lambda: LookaheadReplayer({"method": "lookahead"}), trace)
    (tokens, passes, _, _), (tokens_2, passes_2, drafted_2, _) = results
    assert tokens == tokens_2 == len(answer) and passes == len(answer)  # nothing to copy
    # within one dataset the first answer is in the corpus and the second one copies it
    assert (passes_2 < passes) == second_helped and (drafted_2 > 0) == second_helped


def test_replay_oracle_cut_keeps_s_and_verifies_only_accepted_tokens():
    from benchmarks.replay.loop import Request, StepCost, replay
    from benchmarks.replay.replayers import Replayer

    class HalfRight(Replayer):
        """Drafts the next two answer tokens, then two wrong ones."""

        def __init__(self, answer):
            super().__init__({"num_speculative_tokens": 4})
            self.answer = answer

        def propose_row(self, row, sampled):
            done = int(self.num_tokens[row]) - 1  # one prompt token
            return self.answer[done : done + 2] + [0, 0]

    answer = list(range(10, 29))  # the prefill's token, then 6 passes of 3 tokens
    trace = [Request("a", "c", [1], answer)]
    cost = StepCost(0.010, 0.001)
    (tokens, passes, drafted, seconds), = replay(lambda: HalfRight(answer), trace, cost)
    (tokens_2, passes_2, drafted_2, seconds_2), = replay(lambda: HalfRight(answer), trace,
                                                        cost, oracle_cut=True)
    assert (tokens_2, passes_2) == (tokens, passes)  # the same accepted tokens
    accepted = tokens - passes  # every pass yields one token more than it accepts
    assert drafted == 4 * (passes - 1) and drafted_2 == accepted
    assert seconds_2 == pytest.approx(seconds - 0.001 * (drafted - drafted_2))


def test_copy_oracle_copies_the_best_continuation_of_the_longest_match():
    from benchmarks.replay.replayers import best_copy

    text = np.array([7, 1, 2, 3, 8, 1, 2, 4, 7, 1], dtype=np.int32)
    # "7 1" repeats once (a continuation right for one token); "1" alone also repeats
    # after 8, right for two: the longest match decides, then the continuation
    assert best_copy(text, len(text), text[-2:], np.array([2, 4], np.int32)) == (2, 2, 1)
    assert best_copy(text, len(text), text[-1:], np.array([2, 4], np.int32)) == (1, 6, 2)
    # no continuation right: nothing to copy; a continuation stops at the text's end
    assert best_copy(text, len(text), text[-2:], np.array([5], np.int32))[2] == 0
    assert best_copy(text, 4, np.array([1], np.int32), np.array([2, 3, 8], np.int32)) == (
        1, 2, 2)


def test_replay_copy_oracle_copies_earlier_outputs_of_its_dataset():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import REPLAY_ONLY_METHODS, CopyOracleReplayer

    answer = list(range(10, 40))  # no token repeats: the first answer copies nothing
    trace = [Request("a", "c", [1, 2], answer), Request("a", "c", [1, 2], answer)]
    spec = REPLAY_ONLY_METHODS["copy-oracle"].config
    first, second = replay(lambda: CopyOracleReplayer(spec), trace)
    assert first == (30, 30, 0, 0.0)
    # the prefill's token, then 24 copied tokens and one, then the last 4 copied
    assert second == (30, 3, 28, 0.0)


def test_replay_copy_oracle_copies_only_after_its_min_match():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import CopyOracleReplayer

    # after "9 5" only "5" repeats (the prompt's first token): the oracle copies "6 7 8"
    # there; with min_match 2 it waits for "5 6", then copies "7 8"
    trace = [Request("a", "c", [5, 6, 7, 8], [9, 5, 6, 7, 8, 4])]
    spec = {"method": "copy-oracle", "num_speculative_tokens": 24}
    assert replay(lambda: CopyOracleReplayer(spec), trace) == [(6, 3, 3, 0.0)]
    spec["min_match"] = 2
    assert replay(lambda: CopyOracleReplayer(spec), trace) == [(6, 4, 2, 0.0)]


def test_replay_run_writes_its_table_into_a_run_folder(tmp_path, monkeypatch, capsys):
    import datetime

    from benchmarks import machine
    from benchmarks.replay import cli
    from benchmarks.replay.replayers import Replayer

    class NoDrafts(Replayer):
        def propose_row(self, row, sampled):
            return []

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"dataset": "a", "category": "c", "prompt": [1, 2],
                                  "output": [3, 4, 5]}]))
    monkeypatch.setitem(cli.REPLAYERS, "ngram", NoDrafts)
    monkeypatch.setattr(machine, "git_state", lambda: {"commit": "abc", "dirty": False})
    argv = ["run", str(trace), "--methods", "ngram", "--output-dir", str(tmp_path / "out"),
            "--name", "m-replay"]
    monkeypatch.setattr(sys, "argv", ["replay.py", *argv])
    cli.main()
    folder = tmp_path / "out" / f"{datetime.date.today().isoformat()}-m-replay"
    assert sorted(p.name for p in folder.iterdir()) == ["command.txt", "results.md"]
    command = (folder / "command.txt").read_text()
    assert command.endswith(" -m benchmarks.replay " + " ".join(argv) + "\n")
    text = (folder / "results.md").read_text()
    assert f"* Command: `{command.strip()}`" in text and "* Repository: commit abc" in text
    assert "| all | 1.000 (0.0) |" in text  # 3 tokens in 3 passes, nothing drafted
    assert f"results: {folder}/" in capsys.readouterr().out



def test_replay_batches_requests_on_one_clock():
    from benchmarks.replay.loop import Request, StepCost, replay
    from benchmarks.replay.replayers import NoDraftReplayer

    trace = [Request("a", "c", [i + 1], [7, 8, 9]) for i in range(3)]
    cost = StepCost(0.010, 0.001)
    results = replay(lambda: NoDraftReplayer(None, batch_size=2), trace, cost)
    # requests 0 and 1 share two passes of 2 tokens; request 2 then has two of its own
    assert [r[:3] for r in results] == [(3, 3, 0)] * 3
    assert [r[3] for r in results] == pytest.approx([0.012, 0.012, 0.022])


def test_replay_starts_a_conversations_next_turn_once_its_last_one_finished():
    from benchmarks.replay.loop import Request, replay
    from benchmarks.replay.replayers import NoDraftReplayer

    events = []

    class Recording(NoDraftReplayer):
        def start(self, row, request_id, prompt, output):
            events.append(("start", request_id))
            super().start(row, request_id, prompt, output)

        def finish(self, row):
            events.append(("finish", self.req_ids[row]))
            super().finish(row)

    first_turn = Request("a", "c", [1, 2], [5, 6, 7, 8])
    second_turn = Request("a", "c", [1, 2, 5, 6, 7, 8, 9], [3, 4])  # repeats the first
    other = Request("a", "c", [7], [1, 2])
    replay(lambda: Recording(None, batch_size=2), [first_turn, second_turn, other])
    # the second turn waits for the first although a row is free before it ends
    assert events.index(("start", "replay-2")) < events.index(("finish", "replay-0")) \
        < events.index(("start", "replay-1"))


@pytest.mark.parametrize("trees, measured", [("auto", True), ("off", False)])
def test_replay_tells_lookahead_the_step_cost_where_the_engine_measures_it(trees, measured):
    from benchmarks.replay.loop import SimulatedClock, StepCost
    from benchmarks.replay.replayers import LookaheadReplayer

    replayer = LookaheadReplayer({"method": "lookahead", "trees": trees}, batch_size=4)
    replayer.use_clock(SimulatedClock(), StepCost(0.060, 0.0032))
    # the worker measures the step at start-up for trees auto only
    assert replayer.proposer.cost_model.has_estimate == measured
    if measured:
        assert replayer.proposer.cost_model.free_tokens() == pytest.approx(60 / 3.2)


def test_replay_table_compares_each_method_with_no_speculation_at_its_batch_size():
    from benchmarks.replay.cli import replay_table
    from benchmarks.replay.loop import Request, StepCost

    trace = [Request("a", "c", [1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2, 3])]
    specs = {"none": None, "ngram": methods.DEFAULT_METHODS["ngram"].config}
    table = replay_table(trace, specs, StepCost(0.010, 0.001), 2, oracle_cut=True)
    assert table[0].endswith(", batch 2 | none | ngram | ngram (oracle cut) |")
    cells = dict(zip(["key", "none", "ngram", "cut"], table[2].strip("| ").split(" | ")))
    assert cells["none"] == "1.000 (0.0) 90.9/s 1.00x"  # a token each 11 ms pass
    speedup = float(cells["cut"].rsplit(" ", 1)[1].rstrip("x"))
    assert speedup > 1 and cells["cut"].startswith(cells["ngram"].split(" (")[0])


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

