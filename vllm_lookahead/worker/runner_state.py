"""The model runner's state as drafters and the worker's start-up passes read it.

The package's bottom floor: it imports nothing from ``vllm_lookahead``, so every module
above (the tree step, its start-up self-check and cost measurement, the runner binding)
and the drafters read vLLM's runner, its input batch, its requests' ``SamplingParams``
and the tensor-parallel group here instead of reaching into vLLM objects.

| vLLM attribute | use | why | verified on |
|---|---|---|---|
| ``runner.input_batch.req_ids``, ``.num_prompt_tokens``, ``runner.requests``, ``runner.device`` | read | request id and prompt length per row, live requests, the model's device | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``SamplingParams`` (``temperature``, ``extra_args``, ``logprobs``, penalties, ``bad_words``, ``min_tokens``, ``structured_outputs``) of ``runner.requests[id].sampling_params`` | read | greedy or not, per-request options, whether a request may take tree drafts | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner.cudagraph_dispatcher.cudagraph_keys`` (``BatchDescriptor.uniform``, ``.num_reqs``) | read | which batch sizes of uniform decode steps replay a full CUDA graph | 0.32.0, 0.26.0 read (CPU: no keys); never run on CUDA |
| ``vllm.distributed.parallel_state``: ``model_parallel_is_initialized``, ``get_tp_group()`` (``world_size``, ``rank_in_group``, ``cpu_group``, ``broadcast_object``), ``get_pp_group().world_size`` | called, read | every rank takes the first rank's (or the largest) value | 0.32.0, 0.26.0 (CPU, TP 2); 0.33.0 read |
"""

from __future__ import annotations

import math
from typing import Any

import torch


def uniform_graph_requests(runner: Any) -> int:
    """Most requests whose *uniform* decode step (each computing 1 + K tokens) replays a
    full CUDA graph, where other speculative steps run piecewise: 0 where no step
    replays one (CPU, ``enforce_eager``, piecewise graphs only) or where every step may
    (full graphs for mixed batches too). Read from the runner's graph dispatcher, whose
    keys exist once the graphs are captured."""
    from vllm.config import CUDAGraphMode

    keys = getattr(getattr(runner, "cudagraph_dispatcher", None), "cudagraph_keys", None)
    full = (keys or {}).get(CUDAGraphMode.FULL, ())
    if any(not descriptor.uniform for descriptor in full):
        return 0
    return max((descriptor.num_reqs or 0 for descriptor in full), default=0)


def check_bound(runner: Any) -> None:
    """Raise unless ``runner.binding_init`` handed the runner over (vLLM calls the drafter's
    ``load_model`` after building the runner, so this is the place to check)."""
    if runner is None:
        raise RuntimeError(
            "vllm-lookahead: the model runner was not bound to the proposer; "
            "is the vllm_lookahead plugin installed in this Python environment?"
        )


def request_ids(runner: Any) -> list[str | None]:
    """Request id of each input-batch row (the rows ``propose`` receives)."""
    return runner.input_batch.req_ids


def live_request_ids(runner: Any) -> Any:
    """Requests the runner still holds state for (running, paused or preempted)."""
    return runner.requests.keys()


def num_prompt_tokens(runner: Any, row: int) -> int:
    return int(runner.input_batch.num_prompt_tokens[row])


def device(runner: Any) -> torch.device:
    return runner.device


def sampling_params(runner: Any, req_id: str) -> Any:
    """The request's ``SamplingParams`` (None for pooling requests)."""
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def extra_args(runner: Any, req_id: str) -> dict[str, Any] | None:
    """The request's ``SamplingParams.extra_args`` (None for pooling requests)."""
    return getattr(sampling_params(runner, req_id), "extra_args", None)


def is_greedy(runner: Any, req_id: str) -> bool:
    params = sampling_params(runner, req_id)
    return params is None or params.temperature == 0


def allows_trees(params: Any) -> bool:
    """Tree drafts need every node's target distribution to depend on its ancestors
    only: vLLM applies penalties, bad words, min_tokens, structured output and
    logprobs by position in the flat draft, so such requests (``SamplingParams``)
    get linear drafts."""
    if params is None:
        return False
    return (params.logprobs is None and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and not params.bad_words and not params.min_tokens
            and getattr(params, "structured_outputs", None) is None)


def worker_rank() -> int:
    """This worker's rank in the engine's process group (0 without one)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _tp_group() -> Any:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group()


def model_parallel_size() -> int:
    """Tensor-parallel times pipeline-parallel ranks (1 without a process group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tp_group().world_size * parallel_state.get_pp_group().world_size


def max_over_tp_ranks(value: float) -> float:
    """The largest ``value`` of all tensor-parallel ranks (NaN counts as infinite), so
    that every rank takes the same decision from it."""
    value = math.inf if math.isnan(value) else value
    group = _tp_group()
    if group is None or group.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX,
                                 group=group.cpu_group)
    return float(tensor.item())


def is_first_tp_rank() -> bool:
    group = _tp_group()
    return group is None or group.rank_in_group == 0


def broadcast_from_first_tp_rank(obj: Any) -> Any:
    """``obj`` as the first tensor-parallel rank has it (no-op without TP)."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return obj
    return group.broadcast_object(obj, src=0)
