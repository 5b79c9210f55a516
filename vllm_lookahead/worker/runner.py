"""Runner binding, the package's top floor: when vLLM builds a model runner, hand it to
its drafter and connect the drafter's hooks (``hooks.DrafterHooks``) to the mechanism
below: step starts and removed requests, the tree step (``tree_step``), its start-up
procedures (``start_up``) and the sampler's hooks (``sampler``). What drafters read of
the runner is in ``runner_state``.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (``CPUModelRunner`` inherits it), ``runner.drafter`` | wrapped, read | hands the runner to its drafter and connects the drafter's hooks | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner._update_states`` (instance attribute) | wrapped | step start (scheduled tokens, requests, prompt tokens or not) and finished, aborted or preempted requests reach the drafter | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``SchedulerOutput.total_num_scheduled_tokens``, ``.num_scheduled_tokens``, ``.scheduled_spec_decode_tokens``, ``.finished_req_ids``, ``.preempted_req_ids`` | read | what the drafter is told of the step | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

from typing import Any

from vllm_lookahead.options import method_config
from vllm_lookahead.worker import sampler, start_up, tree_step
from vllm_lookahead.worker.hooks import hook


def binding_init(original):
    """Wrap ``GPUModelRunner.__init__``: hand the runner to its drafter and connect the
    drafter's hooks (``hooks.DrafterHooks``)."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not method_config(self.vllm_config):
            return  # another engine of this process, plain or with a method of vLLM's
        drafter = getattr(self, "drafter", None)
        sampler.connect(self, drafter)
        if drafter is None:
            return
        if hook(drafter, "bind_model_runner"):
            drafter.bind_model_runner(self)
        if hook(drafter, "on_requests_removed") and hasattr(self, "_update_states"):
            _observe_scheduler_output(self, drafter)
        if hook(drafter, "draft_tree"):
            tree_step.place_tree_nodes(self, drafter)
            start_up.check_at_start(self, drafter)

    return __init__


def _observe_scheduler_output(runner: Any, drafter: Any) -> None:
    """Wrap ``runner._update_states`` (instance attribute): step start and removed
    requests reach the drafter."""
    original = runner._update_states
    step_started = hook(drafter, "on_step_start")

    def _update_states(scheduler_output, *args, **kwargs):
        if step_started is not None:
            step_started(scheduler_output.total_num_scheduled_tokens,
                         is_decode_only(scheduler_output),
                         len(scheduler_output.num_scheduled_tokens))
        result = original(scheduler_output, *args, **kwargs)
        finished = scheduler_output.finished_req_ids  # aborted ones included
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        if finished or preempted:
            drafter.on_requests_removed(set(finished), set(preempted))
        return result

    runner._update_states = _update_states


def is_decode_only(scheduler_output: Any) -> bool:
    """No prompt token in the step: each request computes one token plus its draft."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return all(count == 1 + len(drafts.get(req_id, ()))
               for req_id, count in scheduler_output.num_scheduled_tokens.items())
