"""Offline modes, driven by the step loop, with a fresh `LLM` per measurement.

* latency: one request at a time (batch 1); per-request spec-decode counters.
* throughput: every conversation's first turn submitted at once; later turns
  join as soon as their previous turn finishes.

A fresh engine per method, mode and dataset: suffix decoding keeps past outputs
across requests, and Spec-Bench's MT-Bench part repeats MT-Bench's questions, so
a shared engine would hand one dataset the answers of another (and the prefix
cache would skip their prefills). Each engine first answers one untimed warm-up
request (datasets.WARMUP). Both modes can also be measured with every method's engine
up at once, the methods taking turns on each conversation (latency) or on each round of
conversations (throughput; `--interleave`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator

from benchmarks import graph_modes
from benchmarks.datasets import WARMUP, WARMUP_TOKENS, Conversations
from benchmarks.engine_loop import drive
from benchmarks.records import (
    RequestRecord,
    SpecDecodeCounters,
    measurement_json,
    proposer_delta,
    round_json,
)

MODES = ("latency", "throughput")

#: Before each interleaved turn (also the server's): Intel OpenMP's threads of the
#: engine that just ran spin for 200 ms (KMP_BLOCKTIME) after their last parallel region,
#: on the cores the next engine's threads need.
SWITCH_PAUSE_SECONDS = 0.25


def measure_offline(mode: str, model_path: str, speculative_config: dict | None,
                    engine_args: dict, dataset: str, conversations: Conversations,
                    sampling: dict, on_request: Callable[[], None]) -> dict:
    """One measurement (JSON-ready) of `conversations` in `mode` on a new engine;
    `sampling`: `SamplingParams` keywords (max_tokens, temperature, top_p)."""
    engine = _Engine(model_path, speculative_config, engine_args, conversations, sampling)
    try:
        engine.answer(range(len(conversations)), mode == "latency", on_request)
        return engine.measurement(mode, dataset)
    finally:
        engine.close()


def measure_interleaved(mode: str, model_path: str,
                        methods: dict[str, tuple[dict | None, dict]], dataset: str,
                        conversations: Conversations, sampling: dict,
                        on_request: Callable[[], None], round_size: int = 1
                        ) -> dict[str, dict | Exception]:
    """`mode` with every method's engine up at once, the methods taking turns on each
    round of `round_size` conversations (the order rotating by one each round): at
    batch 1 (latency) a round's conversations are answered one at a time, in
    throughput mode all at once (later turns joining as earlier ones finish).

    The machine's speed drifts by up to 20 % over tens of minutes on the small hosts,
    and under load a round-cell moves by +- 10 % from one minute to the next; measured
    one method after another, that lands in the comparison. Here each round is answered
    by every method within seconds (throughput: a measurement keeps its rounds' times,
    for paired speedups). `methods`: name -> (speculative config, engine arguments).
    Returns name -> measurement, or the exception that ended that method (the others
    go on).
    """
    engines: dict[str, _Engine] = {}
    outcome: dict[str, dict | Exception] = {}
    try:
        for name, (config, engine_args) in methods.items():
            try:
                engines[name] = _Engine(model_path, config, engine_args, conversations,
                                        sampling)
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
        for which, name in turns(len(conversations), round_size, lambda: list(engines)):
            try:
                engines[name].answer(which, mode == "latency", on_request)
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
                engines.pop(name).close()
        for name, engine in engines.items():
            try:
                outcome[name] = engine.measurement(mode, dataset)
            except Exception as exc:  # noqa: BLE001 - reported for this method only
                outcome[name] = exc
        return {name: outcome[name] for name in methods}
    finally:
        for engine in engines.values():
            engine.close()


def turns(count: int, size: int, names: Callable[[], list[str]]
          ) -> Iterator[tuple[range, str]]:
    """(conversations, method) in the order methods take turns: rounds of ``size`` of
    ``count`` conversations, each answered by every method ``names()`` still lists at the
    round's start, the order rotating by one each round, after a pause
    (``SWITCH_PAUSE_SECONDS``) before each turn."""
    for number, first in enumerate(range(0, count, size)):
        order = names()
        shift = number % len(order) if order else 0
        for name in order[shift:] + order[:shift]:
            time.sleep(SWITCH_PAUSE_SECONDS)
            yield range(first, min(first + size, count)), name


class _Engine:
    """One method's engine through a measurement: started and warmed up, then answering
    conversations (in one go or in turns), its counters read before the first answer."""

    def __init__(self, model_path: str, speculative_config: dict | None, engine_args: dict,
                 conversations: Conversations, sampling: dict):
        from vllm import LLM, SamplingParams

        started = time.perf_counter()
        self.llm = LLM(model_path, speculative_config=speculative_config,
                       disable_log_stats=False, **engine_args)
        self.startup_seconds = time.perf_counter() - started
        self.conversations = conversations
        self.params = SamplingParams(**sampling)
        try:
            self.tally = SpecDecodeTally(self.llm.llm_engine)
            graph_modes.install(self.llm)
            _warm_up(self.llm, conversations, self.params)
            self.counters_before = self.last_counters = self.tally.counters
            self.proposer_before = proposer_stats(self.llm)
            self.graph_steps_before = graph_modes.read(self.llm)
        except BaseException:
            self.close()
            raise
        self.records: list[RequestRecord] = []
        self.wall_seconds = 0.0
        self.engine_steps = 0
        #: each `answer`'s conversations, time and tokens (throughput: paired speedups)
        self.rounds: list[dict] = []

    def answer(self, conversations: range, one_at_a_time: bool,
               on_request: Callable[[], None]) -> None:
        def on_finish(record: RequestRecord) -> None:
            if one_at_a_time:  # the counters moved for this request only
                now = self.tally.counters
                record.spec_decode, self.last_counters = now - self.last_counters, now
            on_request()

        loop = drive(self.llm.llm_engine, self.conversations.next_prompt, conversations,
                     self.params, max_in_flight=1 if one_at_a_time else len(conversations),
                     on_finish=on_finish)
        self.records += loop.records
        self.wall_seconds += loop.wall_seconds
        self.engine_steps += loop.engine_steps
        self.rounds.append(round_json(conversations, loop.wall_seconds, loop.records))

    def measurement(self, mode: str, dataset: str) -> dict:
        llm = self.llm
        at_once = max((stop - start for start, stop in
                       (r["conversations"] for r in self.rounds)), default=0)
        measurement = measurement_json(
            mode, dataset, 1 if mode == "latency" else at_once,
            self.wall_seconds, self.engine_steps, self.tally.counters - self.counters_before,
            proposer_delta(self.proposer_before, proposer_stats(llm)), self.records,
            self.conversations.samples, self.startup_seconds)
        measurement["start"] = start_state(llm, self.proposer_before)
        measurement["steps_by_graph_mode"] = graph_modes.difference(
            graph_modes.read(llm), self.graph_steps_before)
        if mode == "throughput" and len(self.rounds) > 1:
            measurement["rounds"] = self.rounds
        cut = cut_state(llm)
        if cut is not None:
            measurement["cut"] = cut
        return measurement

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()


def _warm_up(llm, conversations: Conversations, params) -> None:
    prompt = conversations.prompter.prompt(WARMUP, [])
    warm_params = params.clone()
    warm_params.max_tokens = WARMUP_TOKENS
    drive(llm.llm_engine, lambda i, answers: None if answers else prompt, 1, warm_params,
          max_in_flight=1)


def cut_state(llm) -> dict | None:
    """Lookahead's cost-aware cut after the run (since start-up, warm-up included): its
    kept tokens by estimated acceptance against the text (``lookahead/calibration.py``)
    and the recent passes' times by token count against its cost curve."""

    def read(worker) -> dict | None:
        drafter = getattr(worker.model_runner, "drafter", None)
        if getattr(drafter, "calibration", None) is None:
            return None
        return {"calibration": drafter.calibration.table(),
                "step_seconds": drafter.cost_model.by_token_count()}

    return llm.collective_rpc(read)[0]


class SpecDecodeTally:
    """One engine's spec-decode counters, summed from the stats each step hands the
    engine's stat loggers. Not `LLM.get_metrics()`: vLLM's Prometheus registry is one
    per process, and a new engine unregisters the one before's metrics, so with several
    engines up (`--interleave`) it would read another engine's counters."""

    def __init__(self, engine):
        self.counters = SpecDecodeCounters()
        manager = engine.logger_manager
        if manager is None:
            raise ValueError("the engine keeps no stats: start it with disable_log_stats=False")
        record = manager.record

        def tallying_record(*args, **kwargs):
            stats = kwargs.get("scheduler_stats", args[0] if args else None)
            step = getattr(stats, "spec_decoding_stats", None)
            if step is not None:
                self.counters += SpecDecodeCounters.from_step_stats(step)
            return record(*args, **kwargs)

        manager.record = tallying_record


def proposer_stats(llm) -> dict | None:
    """The drafter's own counters where it keeps them (lookahead: steps and seconds).

    Needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (a callable crosses into the worker).
    """
    stats = llm.collective_rpc(
        lambda worker: getattr(getattr(worker.model_runner, "drafter", None), "stats", None))
    first = stats[0] if stats else None
    return dataclasses.asdict(first) if dataclasses.is_dataclass(first) else None


def start_state(llm, proposer: dict | None) -> dict:
    """What the engine decided at start-up: the KV cache's blocks and those held back
    as scratch (tree branches, MTAD beams), and (lookahead) the trees' start-up cost
    measurement (its free tokens and the fastest pass of each size timed) and
    self-check."""
    from vllm_lookahead.worker.scratch import blocks_in_use

    def read(worker) -> tuple[int, int, dict | None]:
        cost = getattr(getattr(worker.model_runner, "drafter", None), "start_cost", None)
        passes = None if cost is None else {"sizes": list(cost.sizes),
                                            "seconds": list(cost.size_seconds)}
        return (worker.model_runner.kv_cache_config.num_blocks, len(blocks_in_use(worker)),
                passes)

    total, held, passes = llm.collective_rpc(read)[0]
    state = {"kv_blocks": total, "held_blocks": held}
    if proposer is not None and "start_free_tokens" in proposer:
        state.update(start_free_tokens=proposer["start_free_tokens"],
                     tree_check=proposer["tree_check"], start_passes=passes)
    return state
