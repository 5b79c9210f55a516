"""Every place where the plugin touches vLLM's model runner and sampler.

The ``custom_class`` proposer interface passes neither request ids nor the target's
predictions, and vLLM's CPU fallback corrupts sampling verification. Each patch
below wraps the original (no vLLM method body is copied) and is installed at most
once per process; the runner and sampler patches only in worker processes.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.worker_base.WorkerBase.__init__`` | wrapped | installs the patches below in worker processes only, before the runner exists | 0.32.0 (CPU, mp executor, TP 1 and 2) |
| ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (``CPUModelRunner`` inherits it) | wrapped | hands the runner to a drafter with ``bind_model_runner`` (request ids per batch row) and registers it as verification observer | 0.32.0 (CPU) |
| ``runner._update_states`` (instance attribute of the bound runner) | wrapped | tells the drafter which requests finished, were aborted or preempted, so their state is freed at once; and when a step starts, with its scheduled token count and whether it holds prompt tokens (the drafter times decode passes until ``propose``) | 0.32.0 (CPU) |
| ``vllm.v1.sample.rejection_sampler.rejection_sample`` | wrapped | captures the target's argmax (and, if the drafter asks, its top-k with log-probabilities) at every draft position, also after the first rejection (the Jacobi iteration the proposer harvests); hands verification to the drafter's ``acceptance_rule`` if it has one (MTAD's joint rule), after vLLM has applied the request's temperature, top-k and top-p | 0.32.0 (CPU) |
| ``vllm.distributed.get_tp_group().broadcast_object`` | called | MTAD drafts on the first tensor-parallel rank only and broadcasts them | 0.32.0 (CPU, TP 2) |
| ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` | replaced, only on CPU without Triton | vLLM's C++ fallback writes float results into a discarded int64 copy, so temperature/top-p reach verification as garbage | 0.32.0 (CPU) |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_lookahead import _patching

logger = logging.getLogger(__name__)


@dataclass
class VerificationCapture:
    """The target's view of one verification pass, rows in input-batch order.

    Tensors stay on the device until the proposer reads them, after vLLM's own sync.
    """

    num_draft_tokens: list[int]
    draft_token_ids: torch.Tensor  # [sum(num_draft_tokens)]
    target_argmax: torch.Tensor  # [sum(num_draft_tokens)]
    bonus_token_ids: torch.Tensor  # [rows]
    # the observer's ``capture_top_k`` most likely tokens at each position, if it asks
    target_top_ids: torch.Tensor | None = None  # [sum(num_draft_tokens), k]
    target_top_logprobs: torch.Tensor | None = None  # [sum(num_draft_tokens), k]


class VerificationObserver(Protocol):
    capture_top_k: int  # 0: argmax only

    def on_verification(self, capture: VerificationCapture) -> None: ...


class AcceptanceRule(Protocol):
    """Replaces vLLM's decisions: output tokens ``[rows, max_spec_len + 1]``, or None
    to leave this pass to vLLM (e.g. its warm-up runs)."""

    def __call__(self, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                 max_spec_len: int, target_logits: torch.Tensor,
                 bonus_token_ids: torch.Tensor, sampling_metadata: Any
                 ) -> torch.Tensor | None: ...


# One model runner per worker process, hence one observer and one acceptance rule.
_observer: VerificationObserver | None = None
_acceptance_rule: AcceptanceRule | None = None


def install() -> None:
    """Called by ``plugin.register`` in every process; defers real work to workers."""
    from vllm.v1.worker import worker_base

    def make_wrapper(original):
        def __init__(self, *args, **kwargs):
            _install_worker_patches()
            original(self, *args, **kwargs)

        return __init__

    _patching.wrap(worker_base.WorkerBase, "__init__", make_wrapper)


def _install_worker_patches() -> None:
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_model_runner

    _patching.wrap(gpu_model_runner.GPUModelRunner, "__init__", _binding_init)
    _patching.wrap(rejection_sampler, "rejection_sample", _hooked_rejection_sample)
    if _cpu_expand_is_broken():
        _patching.replace(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
        logger.info("vllm-lookahead: replaced CPU expand_batch_to_tokens (sampling fix)")


def _binding_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "bind_model_runner"):
            drafter.bind_model_runner(self)
        if hasattr(drafter, "on_requests_removed") and hasattr(self, "_update_states"):
            _observe_scheduler_output(self, drafter)
        global _observer, _acceptance_rule
        if hasattr(drafter, "on_verification"):
            _observer = drafter
        if getattr(drafter, "acceptance_rule", None) is not None:
            _acceptance_rule = drafter.acceptance_rule

    return __init__


def _observe_scheduler_output(runner: Any, drafter: Any) -> None:
    original = runner._update_states
    step_started = getattr(drafter, "on_step_start", None)

    def _update_states(scheduler_output, *args, **kwargs):
        if step_started is not None:
            step_started(scheduler_output.total_num_scheduled_tokens,
                         _is_decode_only(scheduler_output))
        result = original(scheduler_output, *args, **kwargs)
        finished = scheduler_output.finished_req_ids  # aborted ones included
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        if finished or preempted:
            drafter.on_requests_removed(set(finished), set(preempted))
        return result

    runner._update_states = _update_states


def _is_decode_only(scheduler_output: Any) -> bool:
    """No prompt token in the step: each request computes one token plus its draft."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return all(count == 1 + len(drafts.get(req_id, ()))
               for req_id, count in scheduler_output.num_scheduled_tokens.items())


def _hooked_rejection_sample(original):
    def rejection_sample(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
        draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
    ):
        if _observer is not None:
            _observer.on_verification(
                _capture(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids))
        if _acceptance_rule is not None:
            sampling_metadata = args[0] if args else kwargs["sampling_metadata"]
            output = _acceptance_rule(draft_token_ids, list(num_draft_tokens), max_spec_len,
                                      target_logits, bonus_token_ids, sampling_metadata)
            if output is not None:
                return output
        return original(
            draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
            draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
        )

    return rejection_sample


def _capture(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids
             ) -> VerificationCapture:
    capture = VerificationCapture(
        num_draft_tokens=list(num_draft_tokens),
        draft_token_ids=draft_token_ids,
        target_argmax=target_logits.argmax(dim=-1),
        bonus_token_ids=bonus_token_ids.view(-1),
    )
    top_k = min(getattr(_observer, "capture_top_k", 0), target_logits.shape[-1])
    if top_k and target_logits.shape[0]:
        values, capture.target_top_ids = target_logits.topk(top_k, dim=-1)
        capture.target_top_logprobs = values - target_logits.logsumexp(-1, keepdim=True)
    return capture


def _cpu_expand_is_broken() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: Any = 0,
    replace_to: Any = 0,
) -> torch.Tensor:
    """Pure-torch ``expand_batch_to_tokens``: row value i repeated count_i times."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def check_bound(runner: Any) -> None:
    """Raise unless ``_binding_init`` handed the runner over (vLLM calls the drafter's
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


def worker_rank() -> int:
    """This worker's rank in the engine's process group (0 without one)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def num_prompt_tokens(runner: Any, row: int) -> int:
    return int(runner.input_batch.num_prompt_tokens[row])


def sampling_params(runner: Any, req_id: str) -> Any:
    """The request's ``SamplingParams`` (None for pooling requests)."""
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def extra_args(runner: Any, req_id: str) -> dict[str, Any] | None:
    """The request's ``SamplingParams.extra_args`` (None for pooling requests)."""
    return getattr(sampling_params(runner, req_id), "extra_args", None)


def _tp_group() -> Any:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group()


def is_first_tp_rank() -> bool:
    group = _tp_group()
    return group is None or group.rank_in_group == 0


def broadcast_from_first_tp_rank(obj: Any) -> Any:
    """``obj`` as the first tensor-parallel rank has it (no-op without TP)."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return obj
    return group.broadcast_object(obj, src=0)
