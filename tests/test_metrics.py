"""Worker snapshots -> frontend collector, without an engine."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from conftest import fake_vllm_config

from vllm_lookahead import metrics
from vllm_lookahead.metrics import ProposerStats

METRICS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
DASHBOARD = (Path(__file__).resolve().parents[1]
             / "examples" / "grafana" / "vllm_lookahead_dashboard.json")
#: vLLM's spec-decode counters the dashboard reads, as scraped
#: (``vllm/v1/spec_decode/metrics.py``, the same names in 0.26.0 and 0.32.0).
VLLM_SPEC_DECODE = {"vllm:spec_decode_num_drafts_total",
                    "vllm:spec_decode_num_draft_tokens_total",
                    "vllm:spec_decode_num_accepted_tokens_total",
                    "vllm:spec_decode_num_accepted_tokens_per_pos_total"}


def samples(collector) -> dict:
    """{(name, sorted labels): value} of everything the collector exports."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in collector.collect() for sample in family.samples}


def test_collector_reports_the_lowest_rank_of_each_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    config = fake_vllm_config(4, 64, instance_id="engine-a")
    rank0 = ProposerStats(steps=10, drafts=7, pool_tokens=5, suffix_tokens=2,
                          accepted_pool_tokens=3, tree_accepted=4,
                          generated_tokens=30, request_passes=12, active_requests=1,
                          pool_ngrams=40, corpus_size=100)
    metrics.SnapshotWriter(config, rank=1).write(dataclasses.replace(rank0, steps=99))
    writer = metrics.SnapshotWriter(config, rank=0)
    assert writer.due()
    writer.write(rank0)
    assert not writer.due()  # rate-limited until SNAPSHOT_INTERVAL_S has passed

    collector = metrics.SnapshotCollector()
    collector.watch(metrics.snapshot_dir(config), "m", [0], "lookahead")
    labels = (("engine", "0"), ("model_name", "m"))
    by_method = (("engine", "0"), ("method", "lookahead"), ("model_name", "m"))
    exported = samples(collector)
    assert exported[("vllm:speculative_proposer_steps_total", by_method)] == 10  # rank 0's
    assert exported[("vllm:speculative_active_requests", by_method)] == 1
    assert exported[("vllm:speculative_compression_ratio", by_method)] == 30 / 12
    assert exported[("vllm:lookahead_pool_ngrams", labels)] == 40
    assert exported[("vllm:lookahead_draft_tokens_total", (*labels, ("source", "pool")))] == 5
    assert exported[("vllm:lookahead_draft_tokens_total",
                     (*labels, ("source", "context")))] == 2
    accepted = "vllm:lookahead_accepted_draft_tokens_total"
    assert exported[(accepted, (*labels, ("source", "pool")))] == 3
    assert exported[(accepted, (*labels, ("source", "tree")))] == 4
    assert exported[(accepted, (*labels, ("source", "context")))] == 0


def test_an_early_write_when_idle_does_not_postpone_the_next_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    writer = metrics.SnapshotWriter(fake_vllm_config(4, 64, instance_id="engine-a"), rank=0)
    writer.write(ProposerStats(active_requests=1))
    now[0] += 0.9 * metrics.SNAPSHOT_INTERVAL_S
    writer.write(ProposerStats())  # the last request finished: written at once
    assert json.loads(writer.path.read_text())["active_requests"] == 0
    now[0] += 0.2 * metrics.SNAPSHOT_INTERVAL_S  # the next request runs: a snapshot is due
    assert writer.due()


def test_no_snapshots_without_an_instance_id_or_before_the_first_write(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    writer = metrics.SnapshotWriter(fake_vllm_config(4, 64), rank=0)
    assert writer.path is None and not writer.due()
    writer.write(ProposerStats())
    assert not list(tmp_path.iterdir())
    collector = metrics.SnapshotCollector()
    collector.watch(tmp_path / "never-written", "m", [0], "lookahead")
    assert all(not family.samples for family in collector.collect())


def test_mtad_exports_the_shared_metrics_under_its_name_and_none_of_lookaheads(
        tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    config = fake_vllm_config(4, 64, instance_id="engine-mtad")
    metrics.SnapshotWriter(config, rank=0).write(ProposerStats(tree_nodes=6, tree_branches=2))
    collector = metrics.SnapshotCollector()
    collector.watch(metrics.snapshot_dir(config), "m", [0], "mtad")
    exported = samples(collector)
    by_method = (("engine", "0"), ("method", "mtad"), ("model_name", "m"))
    assert exported[("vllm:speculative_tree_nodes_total", by_method)] == 6
    assert exported[("vllm:speculative_tree_branches_total", by_method)] == 2
    assert not [name for name, _ in exported if name.startswith("vllm:lookahead_")]


def test_collector_exports_the_metric_table():
    """What ``exported_metrics`` lists (docs/metrics.md's table, the dashboard's check) is
    what the collector exports, name, type and label."""
    collector = metrics.SnapshotCollector()
    collector.watch(Path("/nonexistent"), "m", [0], "lookahead")
    scraped = {(family.name + ("_total" if family.type == "counter" else ""), family.type)
               for family in collector.collect()}
    assert scraped == {(name, kind) for name, kind, _, _ in metrics.exported_metrics()}


def test_metrics_page_table_is_the_exported_one():
    """docs/metrics.md holds the metric table the code generates."""
    assert metrics.metrics_table() in METRICS_PAGE.read_text()


def queried_metrics(node) -> set[str]:
    """Metric names in every PromQL string of the dashboard (panel targets, variables)."""
    if isinstance(node, list):
        return set().union(*map(queried_metrics, node))
    if not isinstance(node, dict):
        return set()
    names = {name for key in ("expr", "query", "definition")
             if isinstance(node.get(key), str)
             for name in re.findall(r"vllm:[a-z_]+", node[key])}
    return names.union(*map(queried_metrics, node.values()))


def test_dashboard_queries_only_exported_metrics():
    """Every metric the Grafana dashboard queries is one the plugin exports, or one of
    vLLM's spec-decode counters (``VLLM_SPEC_DECODE``): the two cannot drift apart."""
    dashboard = json.loads(DASHBOARD.read_text())
    ours = {name for name, _, _, _ in metrics.exported_metrics()}
    queried = queried_metrics(dashboard)
    assert queried <= ours | VLLM_SPEC_DECODE, queried - ours - VLLM_SPEC_DECODE
    assert {"vllm:speculative_compression_ratio", "vllm:lookahead_draft_tokens_total",
            "vllm:speculative_tree_nodes_total", "vllm:speculative_tree_fallbacks_total",
            "vllm:speculative_proposer_seconds_total", "vllm:lookahead_corpus_size_tokens",
            "vllm:lookahead_pool_ngrams"} <= queried
