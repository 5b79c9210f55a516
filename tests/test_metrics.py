"""Worker snapshots -> frontend collector, without an engine."""

from __future__ import annotations

import dataclasses

from conftest import fake_vllm_config

from vllm_lookahead import metrics
from vllm_lookahead.metrics import ProposerStats


def samples(collector) -> dict:
    """{(name, sorted labels): value} of everything the collector exports."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in collector.collect() for sample in family.samples}


def test_collector_reports_the_lowest_rank_of_each_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    config = fake_vllm_config(4, 64, instance_id="engine-a")
    rank0 = ProposerStats(steps=10, drafts=7, pool_tokens=5, suffix_tokens=2,
                          generated_tokens=30, request_passes=12, active_requests=1,
                          pool_ngrams=40, corpus_size=100)
    metrics.SnapshotWriter(config, rank=1).write(dataclasses.replace(rank0, steps=99))
    writer = metrics.SnapshotWriter(config, rank=0)
    assert writer.due()
    writer.write(rank0)
    assert not writer.due()  # rate-limited until SNAPSHOT_INTERVAL_S has passed

    collector = metrics.SnapshotCollector()
    collector.watch(metrics.snapshot_dir(config), "m", [0])
    labels = (("engine", "0"), ("model_name", "m"))
    exported = samples(collector)
    assert exported[("vllm:lookahead_proposer_steps_total", labels)] == 10  # rank 0's
    assert exported[("vllm:lookahead_active_requests", labels)] == 1
    assert exported[("vllm:lookahead_pool_ngrams", labels)] == 40
    assert exported[("vllm:lookahead_compression_ratio", labels)] == 30 / 12
    assert exported[("vllm:lookahead_draft_tokens_total", (*labels, ("source", "pool")))] == 5
    assert exported[("vllm:lookahead_draft_tokens_total",
                     (*labels, ("source", "context")))] == 2


def test_no_snapshots_without_an_instance_id_or_before_the_first_write(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.tempfile, "gettempdir", lambda: str(tmp_path))
    writer = metrics.SnapshotWriter(fake_vllm_config(4, 64), rank=0)
    assert writer.path is None and not writer.due()
    writer.write(ProposerStats())
    assert not list(tmp_path.iterdir())
    collector = metrics.SnapshotCollector()
    collector.watch(tmp_path / "never-written", "m", [0])
    assert all(not family.samples for family in collector.collect())
