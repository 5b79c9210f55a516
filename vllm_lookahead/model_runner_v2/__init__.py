"""Every place where the plugin touches vLLM's Model Runner V2 (vLLM 0.34 on, which has no
V1 runner and no ``custom_class``): lookahead registered in V2's speculator registry, and
its speculator (``speculator.py``) bound to the runner that built it. Installed only where
vLLM has the registry; the runner's patch only in engines that run lookahead.

MTAD is not registered: V2 lets a speculator neither replace verification (MTAD's joint
acceptance rule) nor run a second model on the runner's KV cache outside
``DraftModelSpeculator``; asking for it is refused at start-up, naming why
(``proposer.Method.without_v2``).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.gpu.spec_decode.speculator_config.register_speculative_method`` | called (every process, by ``plugin.register``) | ``{"method": "lookahead"}`` names ``config.LookaheadSpeculatorConfig`` | 0.34.0 imported on CPU (no engine: ``tests/test_model_runner_v2.py``) |
| ``vllm.v1.worker.gpu.model_runner.GPUModelRunner.__init__`` | wrapped (worker processes of engines running lookahead) | binds the runner's ``LookaheadSpeculator``: wraps the runner's ``add_requests`` (instance attribute) | 0.34.0 read |
| ``runner.add_requests`` (instance attribute), ``SchedulerOutput.scheduled_new_reqs`` (``req_id``, ``sampling_params``) | wrapped, read | V2 shows a speculator only slots (``add_request(req_index)``); the core needs each request's ``SamplingParams`` (greedy or not, ``extra_args``, ``logit_bias``/``min_p`` served without drafts) and to know a resumed request (V2 sends it as new) | 0.34.0 read |
"""

from __future__ import annotations

from typing import Any

from vllm_lookahead import _patching
from vllm_lookahead.proposer import METHODS

#: lookahead's K where none is given: V2 computes every one of the K draft slots of each
#: decoding request, so V1's 24 (an upper bound there) would multiply a loaded step's
#: tokens; 8 is what vLLM's V2 ``suffix`` defaults to for that reason.
DEFAULT_K = 8


def has_speculator_registry() -> bool:
    try:
        from vllm.v1.worker.gpu.spec_decode import speculator_config
    except ImportError:
        return False
    return hasattr(speculator_config, "register_speculative_method")


def register() -> None:
    """Every process: our methods with a V2 speculator, where vLLM has the registry."""
    if not has_speculator_registry():
        return
    from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

    for method in METHODS.values():
        if method.speculator_config:
            register_speculative_method(method.name, method.speculator_config)


def runs_lookahead(vllm_config: Any) -> bool:
    speculative_config = getattr(vllm_config, "speculative_config", None)
    return getattr(speculative_config, "custom_method", None) in METHODS


def install_worker_patches(vllm_config: Any) -> None:
    """A worker is being built: bind our speculator to its runner, in engines running it."""
    if not (has_speculator_registry() and runs_lookahead(vllm_config)):
        return
    from vllm.v1.worker.gpu import model_runner

    _patching.wrap(model_runner.GPUModelRunner, "__init__", _binding_init)


def _binding_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        from vllm_lookahead.model_runner_v2.speculator import LookaheadSpeculator

        speculator = getattr(self, "speculator", None)
        if isinstance(speculator, LookaheadSpeculator):
            _note_new_requests(self, speculator)

    return __init__


def _note_new_requests(runner: Any, speculator: Any) -> None:
    """Wrap ``runner.add_requests`` (instance attribute): each new request's
    ``SamplingParams`` reach the speculator before vLLM gives it a slot."""
    original = runner.add_requests

    def add_requests(scheduler_output, *args, **kwargs):
        for new in scheduler_output.scheduled_new_reqs:
            speculator.note_request(new.req_id, new.sampling_params)
        return original(scheduler_output, *args, **kwargs)

    runner.add_requests = add_requests
