"""Offline modes, driven by the step loop, with a fresh `LLM` per measurement.

* latency: one request at a time (batch 1); per-request spec-decode counters.
* throughput: every conversation's first turn submitted at once; later turns
  join as soon as their previous turn finishes.

A fresh engine per method, mode and dataset: suffix decoding keeps past outputs
across requests, and Spec-Bench's MT-Bench part repeats MT-Bench's questions, so
a shared engine would hand one dataset the answers of another (and the prefix
cache would skip their prefills). Each engine first answers one untimed warm-up
request (datasets.WARMUP).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

from benchmarks import graph_modes
from benchmarks.datasets import WARMUP, WARMUP_TOKENS, Conversations
from benchmarks.engine_loop import drive
from benchmarks.records import (
    RequestRecord,
    SpecDecodeCounters,
    measurement_json,
    proposer_delta,
)

MODES = ("latency", "throughput")


def measure_offline(mode: str, model_path: str, speculative_config: dict | None,
                    engine_args: dict, dataset: str, conversations: Conversations,
                    sampling: dict, on_request: Callable[[], None]) -> dict:
    """One measurement (JSON-ready) of `conversations` in `mode` on a new engine;
    `sampling`: `SamplingParams` keywords (max_tokens, temperature, top_p)."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model_path, speculative_config=speculative_config, disable_log_stats=False,
              **engine_args)
    startup_seconds = time.perf_counter() - started
    try:
        graph_modes.install(llm)
        params = SamplingParams(**sampling)
        _warm_up(llm, conversations, params)
        return _measure(llm, mode, dataset, conversations, params, startup_seconds, on_request)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _warm_up(llm, conversations: Conversations, params) -> None:
    prompt = conversations.prompter.prompt(WARMUP, [])
    warm_params = params.clone()
    warm_params.max_tokens = WARMUP_TOKENS
    drive(llm.llm_engine, lambda i, answers: None if answers else prompt, 1, warm_params,
          max_in_flight=1)


def _measure(llm, mode: str, dataset: str, conversations: Conversations, params,
             startup_seconds: float, on_request: Callable[[], None]) -> dict:
    one_at_a_time = mode == "latency"
    counters_before = last_counters = _counters(llm)
    proposer_before = proposer_stats(llm)
    graph_steps_before = graph_modes.read(llm)

    def on_finish(record: RequestRecord) -> None:
        nonlocal last_counters
        if one_at_a_time:  # the counters moved for this request only
            now = _counters(llm)
            record.spec_decode, last_counters = now - last_counters, now
        on_request()

    loop = drive(llm.llm_engine, conversations.next_prompt, len(conversations), params,
                 max_in_flight=1 if one_at_a_time else len(conversations), on_finish=on_finish)
    measurement = measurement_json(
        mode, dataset, 1 if one_at_a_time else len(conversations), loop.wall_seconds,
        loop.engine_steps, _counters(llm) - counters_before,
        proposer_delta(proposer_before, proposer_stats(llm)), loop.records,
        conversations.samples, startup_seconds)
    measurement["start"] = start_state(llm, proposer_before)
    measurement["steps_by_graph_mode"] = graph_modes.difference(graph_modes.read(llm),
                                                                graph_steps_before)
    cut = cut_state(llm)
    if cut is not None:
        measurement["cut"] = cut
    return measurement


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


def _counters(llm) -> SpecDecodeCounters:
    return SpecDecodeCounters.from_vllm_metrics(llm.get_metrics())


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
