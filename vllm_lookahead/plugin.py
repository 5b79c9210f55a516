"""Registration with vLLM: ``register`` is the ``vllm.general_plugins`` entry point.

It runs in every vLLM process (API server, engine core, each worker), so every step
is idempotent: the configuration layer (``engine_config.py``), the metrics export
(``metrics.py``) and the worker-side patches (``worker/``).
"""

from __future__ import annotations

from vllm_lookahead.log import get_logger

logger = get_logger(__name__)


def register() -> None:
    """Entry point of ``vllm.general_plugins``; idempotent, runs in every vLLM process."""
    try:
        import vllm.engine.arg_utils  # noqa: F401
    except ImportError as exc:  # vLLM too different to even parse our method
        logger.error("vllm-lookahead: cannot register with this vLLM (%s)", exc)
        return
    from vllm_lookahead import engine_config, metrics, worker

    engine_config.install()
    metrics.install()
    worker.install()
