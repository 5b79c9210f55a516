"""Which vLLM this plugin supports, and the one place that detects what a vLLM lacks.

Support is decided by feature, never by version string: ``missing_features`` names the
extension points our methods need; the version range below is what has been run or
read (README, "Install").
"""

from __future__ import annotations

import importlib.util
import inspect

SUPPORTED_VLLM = "0.26 - 0.33"


def missing_features() -> list[str]:
    """vLLM extension points the methods need and this vLLM lacks."""
    missing = []
    try:
        from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer  # noqa: F401
    except ImportError:
        missing.append("vllm.v1.spec_decode.custom_class_proposer.create_custom_proposer")
    try:
        from vllm.config import SpeculativeConfig

        if "custom_class" not in str(SpeculativeConfig.__dataclass_fields__["method"].type):
            missing.append("SpeculativeConfig.method 'custom_class'")
    except (ImportError, KeyError):
        missing.append("vllm.config.SpeculativeConfig")
    try:
        from vllm.v1.sample import rejection_sampler

        params = list(inspect.signature(rejection_sampler.rejection_sample).parameters)
        expected = ["draft_token_ids", "num_draft_tokens", "max_spec_len",
                    "cu_num_draft_tokens", "draft_probs", "target_logits", "bonus_token_ids"]
        if params[: len(expected)] != expected:
            missing.append("rejection_sample(draft_token_ids, ..., bonus_token_ids) signature")
    except (ImportError, AttributeError):
        missing.append("vllm.v1.sample.rejection_sampler.rejection_sample")
    return missing


def has_model_runner_v1() -> bool:
    """vLLM's Model Runner V1 and its sampler, which the ``custom_class`` path patches
    (removed in vLLM 0.34.0)."""
    return all(_has_module(name) for name in ("vllm.v1.worker.gpu_model_runner",
                                              "vllm.v1.sample.rejection_sampler"))


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # noqa: BLE001 - only used in an error message
        return "unknown"
