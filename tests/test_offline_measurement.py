"""The offline measurement's bookkeeping (benchmarks/offline.py), without a vLLM engine:
each engine's own spec-decode counters, and the methods taking turns (``--interleave``)."""

from __future__ import annotations

import types

import pytest

from benchmarks.records import SpecDecodeCounters


def test_each_engine_tallies_its_own_spec_decode_counters():
    """Summed from the steps' stats each engine hands its stat loggers (keyword or
    positional), the loggers still called: with several engines up, the process-wide
    Prometheus registry holds only the newest engine's counters."""
    from benchmarks.offline import SpecDecodeTally

    class Manager:
        def __init__(self):
            self.calls = 0

        def record(self, scheduler_stats, iteration_stats=None, **_):
            self.calls += 1

    def step(drafts, tokens, accepted, per_pos):
        stats = types.SimpleNamespace(num_drafts=drafts, num_draft_tokens=tokens,
                                      num_accepted_tokens=accepted,
                                      num_accepted_tokens_per_pos=per_pos)
        return types.SimpleNamespace(spec_decoding_stats=stats)

    first, second = (types.SimpleNamespace(logger_manager=Manager()) for _ in range(2))
    tallies = SpecDecodeTally(first), SpecDecodeTally(second)
    first.logger_manager.record(scheduler_stats=step(1, 3, 2, [1, 1, 0]), iteration_stats=None)
    first.logger_manager.record(step(1, 2, 1, [1, 0]), None)
    first.logger_manager.record(types.SimpleNamespace(spec_decoding_stats=None), None)
    second.logger_manager.record(scheduler_stats=step(1, 5, 0, [0] * 5))
    assert tallies[0].counters == SpecDecodeCounters(2, 5, 3, [2, 1, 0])
    assert tallies[1].counters == SpecDecodeCounters(1, 5, 0, [0] * 5)
    assert first.logger_manager.calls == 3 and second.logger_manager.calls == 1
    assert tallies[0].counters - SpecDecodeCounters(1, 3, 2, [1, 1]) == SpecDecodeCounters(
        1, 2, 1, [1, 0, 0])
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        SpecDecodeTally(types.SimpleNamespace(logger_manager=None))


def test_interleaved_methods_take_turns_on_each_conversation(monkeypatch):
    """Every conversation is answered by every method before the next one, the order
    rotating; a method that fails to start or fails mid-run is reported alone."""
    from benchmarks import offline

    calls = []

    class Engine:
        def __init__(self, model_path, config, engine_args, conversations, sampling):
            if config == "broken":
                raise RuntimeError("no start")
            self.name, self.closed = config, False

        def answer(self, conversations, one_at_a_time, on_request):
            assert one_at_a_time
            calls.append((self.name, conversations.start))
            if self.name == "flaky" and conversations.start == 1:
                raise RuntimeError("mid-run")

        def measurement(self, mode, dataset):
            return {"method": self.name, "mode": mode, "dataset": dataset}

        def close(self):
            self.closed = True

    monkeypatch.setattr(offline, "_Engine", Engine)
    monkeypatch.setattr(offline, "SWITCH_PAUSE_SECONDS", 0)
    methods = {name: (name, {}) for name in ("none", "broken", "suffix", "flaky")}
    outcome = offline.measure_latency_interleaved("m", methods, "d", range(3), {}, None)
    assert calls == [("none", 0), ("suffix", 0), ("flaky", 0),
                     ("suffix", 1), ("flaky", 1), ("none", 1),
                     ("none", 2), ("suffix", 2)]
    assert list(outcome) == ["none", "broken", "suffix", "flaky"]
    assert outcome["none"] == {"method": "none", "mode": "latency", "dataset": "d"}
    assert str(outcome["broken"]) == "no start" and str(outcome["flaky"]) == "mid-run"
