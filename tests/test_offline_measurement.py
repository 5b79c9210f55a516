"""The measurements' bookkeeping (benchmarks/offline.py, benchmarks/server.py), without a
vLLM engine: each engine's own spec-decode counters, and the methods taking turns
(``--interleave``) on conversations at batch 1 and on rounds of conversations in
throughput and server modes."""

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
            assert len(conversations) == 1
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
    outcome = offline.measure_interleaved("latency", "m", methods, "d", range(3), {}, None)
    assert calls == [("none", 0), ("suffix", 0), ("flaky", 0),
                     ("suffix", 1), ("flaky", 1), ("none", 1),
                     ("none", 2), ("suffix", 2)]
    assert list(outcome) == ["none", "broken", "suffix", "flaky"]
    assert outcome["none"] == {"method": "none", "mode": "latency", "dataset": "d"}
    assert str(outcome["broken"]) == "no start" and str(outcome["flaky"]) == "mid-run"


def test_interleaved_throughput_takes_turns_on_rounds_and_keeps_their_times(monkeypatch):
    """Throughput mode: each round of ``round_size`` conversations (the last one shorter)
    is answered at once by every method in turn, the order rotating; each measurement
    keeps its rounds' conversations, times and tokens for paired speedups, and says
    how many conversations it ran at once."""
    from benchmarks import offline

    calls = []

    def drive(engine, next_prompt, conversations, params, max_in_flight, on_finish):
        calls.append((engine, conversations, max_in_flight))  # the engine: its name here
        record = types.SimpleNamespace(output=[1] * len(conversations))
        return types.SimpleNamespace(records=[record], wall_seconds=2.0, engine_steps=3)

    class Engine(offline._Engine):
        def __init__(self, model_path, config, engine_args, conversations, sampling):
            self.name, self.conversations, self.params = config, conversations, None
            self.records, self.rounds, self.wall_seconds, self.engine_steps = [], [], 0.0, 0
            self.startup_seconds = 0.0
            self.llm = types.SimpleNamespace(llm_engine=config)

        def close(self):
            pass

    monkeypatch.setattr(offline, "_Engine", Engine)
    monkeypatch.setattr(offline, "drive", drive)
    monkeypatch.setattr(offline, "SWITCH_PAUSE_SECONDS", 0)
    monkeypatch.setattr(offline, "measurement_json", lambda mode, dataset, at_once, wall,
                        steps, *rest: {"at_once": at_once, "wall": wall, "steps": steps})
    for name in ("start_state", "cut_state", "proposer_stats"):
        monkeypatch.setattr(offline, name, lambda *args: None)
    monkeypatch.setattr(offline.graph_modes, "read", lambda llm: {})
    monkeypatch.setattr(offline.graph_modes, "difference", lambda after, before: {})
    Engine.tally = types.SimpleNamespace(counters=SpecDecodeCounters())
    Engine.counters_before = SpecDecodeCounters()
    Engine.proposer_before = Engine.graph_steps_before = None
    class Conversations(list):
        next_prompt, samples = None, []

    methods = {name: (name, {}) for name in ("none", "lookahead")}
    outcome = offline.measure_interleaved("throughput", "m", methods, "d",
                                          Conversations(range(5)), {}, None, round_size=2)
    assert [(name, (c.start, c.stop), n) for name, c, n in calls] == [
        ("none", (0, 2), 2), ("lookahead", (0, 2), 2),
        ("lookahead", (2, 4), 2), ("none", (2, 4), 2),
        ("none", (4, 5), 1), ("lookahead", (4, 5), 1)]
    assert outcome["none"]["at_once"] == 2 and outcome["none"]["wall"] == 6.0
    assert outcome["lookahead"]["rounds"] == [
        {"conversations": [0, 2], "wall_seconds": 2.0, "output_tokens": 2},
        {"conversations": [2, 4], "wall_seconds": 2.0, "output_tokens": 2},
        {"conversations": [4, 5], "wall_seconds": 2.0, "output_tokens": 1}]


def test_interleaved_servers_take_turns_on_rounds(monkeypatch):
    """Every method's server up at once; rounds of at least the concurrency's size,
    answered by each server in turn, the order rotating; each measurement keeps its
    rounds; a server that fails to start or fails mid-run is reported alone, and every
    server started is stopped."""
    from benchmarks import offline
    from benchmarks import server as server_module

    calls, stopped = [], []

    class Server:
        def __init__(self, model_path, config, engine_args, startup_timeout):
            self.name, self.startup_seconds = config, 1.0

        def __enter__(self):
            if self.name == "broken":
                raise RuntimeError("no start")
            return self

        def __exit__(self, *exc_info):
            stopped.append(self.name)

        def counters(self):
            return SpecDecodeCounters(), None

    async def warm_up(server, prompt, sampling):
        pass

    async def run_conversations(server, conversations, sampling, concurrency, timeout,
                                on_request, which):
        calls.append((server.name, which.start, which.stop))
        if server.name == "flaky" and which.start:
            raise RuntimeError("mid-run")
        return [], 2.0

    monkeypatch.setattr(server_module, "ApiServer", Server)
    monkeypatch.setattr(server_module, "_warm_up", warm_up)
    monkeypatch.setattr(server_module, "_run_conversations", run_conversations)
    monkeypatch.setattr(offline, "SWITCH_PAUSE_SECONDS", 0)
    conversations = type("Conversations", (), {
        "__len__": lambda self: 5, "samples": [],
        "prompter": types.SimpleNamespace(prompt=lambda *args: [1])})()
    methods_ = {name: (name, {}) for name in ("none", "broken", "lookahead", "flaky")}
    outcome = server_module.measure_server_interleaved(
        "m", methods_, "d", conversations, {}, concurrency=2, round_size=1,
        request_timeout=1, startup_timeout=1, on_request=None)
    assert calls == [("none", 0, 2), ("lookahead", 0, 2), ("flaky", 0, 2),
                     ("lookahead", 2, 4), ("flaky", 2, 4), ("none", 2, 4),
                     ("none", 4, 5), ("lookahead", 4, 5)]
    assert str(outcome["broken"]) == "no start" and str(outcome["flaky"]) == "mid-run"
    assert outcome["lookahead"]["wall_seconds"] == 6.0
    assert outcome["lookahead"]["concurrency"] == 2
    assert [r["conversations"] for r in outcome["none"]["rounds"]] == [[0, 2], [2, 4], [4, 5]]
    assert sorted(stopped) == ["flaky", "lookahead", "none"]
