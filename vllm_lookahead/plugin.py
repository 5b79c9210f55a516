"""Registration with vLLM: ``register`` is the ``vllm.general_plugins`` entry point.

It runs in every vLLM process (API server, engine core, each worker), so every step
is idempotent: the configuration layer (``engine_config.py``), the metrics export
(``metrics.py``), Model Runner V2's speculator registry (``model_runner_v2``) and the
worker-side patches, installed when a worker is built by the runner adapter for the
engine's runner: ``worker/`` (V1, vLLM 0.26 - 0.33), ``model_runner_v2`` (V2, 0.34 on).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.worker_base.WorkerBase.__init__`` | wrapped | installs the worker-side patches in worker processes only, before the runner exists, each adapter only where vLLM has its runner and (but for the CPU sampling fixes) only in engines running our methods | 0.32.0, 0.26.0 (CPU, mp executor, TP 1 and 2); 0.33.0 read; 0.34.0 imported (``tests/test_never_breaking_vllm.py``) |
"""

from __future__ import annotations

from vllm_lookahead import _patching
from vllm_lookahead.log import get_logger

logger = get_logger(__name__)


def register() -> None:
    """Entry point of ``vllm.general_plugins``; idempotent, runs in every vLLM process."""
    try:
        import vllm.engine.arg_utils  # noqa: F401
    except ImportError as exc:  # vLLM too different to even parse our method
        logger.error("vllm-lookahead: cannot register with this vLLM (%s)", exc)
        return
    from vllm.v1.worker import worker_base

    from vllm_lookahead import engine_config, metrics, model_runner_v2, worker

    engine_config.install()
    metrics.install()
    model_runner_v2.register()
    worker.install()

    def make_wrapper(original):
        def __init__(self, *args, **kwargs):
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            worker.install_worker_patches(vllm_config)
            model_runner_v2.install_worker_patches(vllm_config)
            original(self, *args, **kwargs)

        return __init__

    _patching.wrap(worker_base.WorkerBase, "__init__", make_wrapper)
