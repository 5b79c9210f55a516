"""Fast checks of the benchmark harness's records, engine loop, metrics and report (no vLLM
engine)."""

from __future__ import annotations

import enum
import json
import math
import statistics
import sys
import types
from dataclasses import dataclass

import pytest

from benchmarks import methods, metrics, report
from benchmarks.records import (
    RequestRecord,
    SpecDecodeCounters,
    proposer_counters,
    proposer_delta,
)

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
vllm:lookahead_tree_steps_total{engine="0",model_name="m"} 4.0
vllm:speculative_tree_nodes_total{engine="0",method="lookahead",model_name="m"} 24.0
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
    after = proposer_counters(PROMETHEUS.replace(" 40.0", " 50.0").replace(" 20.0", " 26.0")
                              .replace(" 4.0", " 6.0").replace(" 24.0", " 36.0"))
    delta = proposer_delta(before, after)
    assert delta["steps"] == 10 and delta["kept_tokens_matched"] == 0
    assert delta["tree_steps"] == 2 and delta["tree_nodes"] == 12
    assert delta["step_token_seconds"] == 0.002  # a gauge: its value at the end
    assert delta["accepted_by_source"]["context"] == 6
    assert delta["accepted_by_source"]["corpus"] == 0  # not exported yet: none
    assert proposer_delta({}, {}) is None  # methods that export none


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
                        proposer={"steps": 4, "seconds": 0.02, "tree_steps": 2, "tree_nodes": 9,
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
    assert (overall["tree_steps"], overall["tree_nodes"]) == (2, 9)
    assert report._trees(overall) == "2 (4.5)" and report._trees(rows[("x", "qa")]) == "n/a"
    assert report._trees({"tree_steps": 0, "tree_nodes": 0}) == "0"
    assert report._trees({"tree_steps": 0, "tree_nodes": 7}) == "n/a (7 nodes)"  # MTAD
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


def test_interleaved_rounds_give_paired_speedups():
    """Throughput with the methods taking turns on rounds: each round's tokens/s
    against the baseline's on the same round (the machine slowed by half in the second
    round for both), mean and standard error in the table; none without rounds."""
    def run(method, walls):
        rounds = [{"conversations": [2 * i, 2 * i + 2], "wall_seconds": wall,
                   "output_tokens": 8} for i, wall in enumerate(walls)]
        return {**_measurement(method, [_request("q", 1, [1] * 24, 24)], mode="throughput",
                               dataset="humaneval", wall=sum(walls)), "rounds": rounds}

    measurements = [run("none", [1.0, 2.0, 1.0]), run("x", [0.5, 1.0, 1.0])]
    rows = {r["method"]: r for r in metrics.summarize(measurements)}
    by_round = rows["x"]["speedup_by_round"]
    assert by_round["mean"] == pytest.approx(5 / 3) and by_round["rounds"] == 3
    assert by_round["stderr"] == pytest.approx(by_round["stdev"] / 3 ** 0.5)
    assert by_round["stdev"] == pytest.approx(statistics.stdev([2.0, 2.0, 1.0]))
    assert rows["none"]["speedup_by_round"]["mean"] == pytest.approx(1.0)
    results = _results(measurements, modes=("throughput",),
                       methods={"none": None, "x": {"method": "x"}})
    results["settings"].update(interleave=True, round_size=2, datasets=["humaneval"])
    text = report.render_markdown(results, list(rows.values()))
    assert "| humaneval | x | 9.6 | 1.60x | 1.667x ± 0.333 (3) |" in text
    assert "taking turns on each round of 2 conversations answered at once" in text
    # seeds: their rounds pooled
    second = [{**m, "seed": 1} for m in measurements]
    rows = {r["method"]: r for r in metrics.summarize(measurements + second)}
    assert rows["x"]["speedup_by_round"]["rounds"] == 6
    assert rows["x"]["speedup_by_round"]["mean"] == pytest.approx(5 / 3)
    del measurements[0]["rounds"]
    assert metrics.summarize(measurements)[1]["speedup_by_round"] is None


def test_missing_baseline_gives_na():
    rows = metrics.summarize([_measurement("x", [_request("q", 1, [1], 1)], dataset="humaneval")])
    assert rows[0]["speedup"] is None and rows[0]["equality"] is None


# -- report ---------------------------------------------------------------------------

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
