"""Engine steps counted by the CUDA graph mode they ran in: FULL (one graph replayed for
the whole step), PIECEWISE (graphs between attention layers, attention launched from
Python) or NONE (eager: CPU, ``enforce_eager``, tree steps, batches past the captured
sizes). Tokens per second is S times the ratio of step times, and the step time depends
first on this mode, so every method's table carries it (``decomposition``).

The harness's only touch point in vLLM's worker; installed through
``LLM.collective_rpc`` once the engine has started (its graphs are captured), so the
capture and warm-up runs are not counted, for any method (speculative or not).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``worker.model_runner.cudagraph_dispatcher.dispatch`` (V1 runner; instance attribute) | wrapped | returns the step's ``CUDAGraphMode`` first | 0.32.0, 0.26.0 (CPU: NONE); 0.26.0 CUDA |
| ``worker.model_runner.cudagraph_manager.dispatch`` (model runner V2, which vLLM runs where no speculative method needs the V1 runner; instance attribute) | wrapped | returns a descriptor whose ``cg_mode`` is the step's mode; no manager: eager | 0.32.0, 0.26.0 read |
| ``worker.model_runner.execute_model`` (instance attribute) | wrapped | only the first dispatch of a step counts (the padding of a KV-sharing prefill and data-parallel re-dispatch come later) | 0.32.0, 0.26.0 (CPU); 0.26.0 CUDA |
"""

from __future__ import annotations

from collections import Counter

MODES = ("FULL", "PIECEWISE", "NONE")


def install(llm) -> None:
    """Start counting on every worker of ``llm`` (idempotent)."""
    llm.collective_rpc(_install_on_worker)


def read(llm) -> dict[str, int]:
    """Steps by mode since ``install``, on the first worker: {"FULL": n, ...}."""
    counts = llm.collective_rpc(_read_on_worker)[0]
    return {mode: counts.get(mode, 0) for mode in MODES}


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {mode: after.get(mode, 0) - before.get(mode, 0) for mode in MODES}


def _install_on_worker(worker) -> None:
    runner = worker.model_runner
    if hasattr(runner, "_lookahead_graph_modes"):
        return
    counts: Counter = Counter()
    runner._lookahead_graph_modes = counts
    pending = [False]
    dispatcher = (getattr(runner, "cudagraph_dispatcher", None)
                  or getattr(runner, "cudagraph_manager", None))
    execute_model = runner.execute_model

    def counted_execute_model(*args, **kwargs):
        if dispatcher is None:  # no graphs at all: every step is eager
            counts["NONE"] += 1
        pending[0] = True
        try:
            return execute_model(*args, **kwargs)
        finally:
            pending[0] = False  # a step with nothing scheduled dispatches nothing

    runner.execute_model = counted_execute_model
    if dispatcher is None:
        return
    dispatch = dispatcher.dispatch

    def counted_dispatch(*args, **kwargs):
        result = dispatch(*args, **kwargs)
        if pending[0]:
            mode = result[0] if isinstance(result, tuple) else result.cg_mode
            counts[mode.name] += 1
            pending[0] = False
        return result

    dispatcher.dispatch = counted_dispatch


def _read_on_worker(worker) -> dict[str, int]:
    return dict(getattr(worker.model_runner, "_lookahead_graph_modes", {}))
