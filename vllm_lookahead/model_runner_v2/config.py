"""Lookahead's entry in vLLM's speculator registry (Model Runner V2, vLLM 0.34 on).

vLLM imports this module in every process (``register_speculative_method`` names it by
path), so it imports nothing of the speculator itself.

| vLLM attribute (0.34.0) | use | why |
|---|---|---|
| ``SpeculatorConfig`` (``v1/worker/gpu/spec_decode/speculator_config.py``) | subclassed | names the speculator class; no draft model (the target's config stands in, as for vLLM's ``ngram``) |
| ``SpeculativeConfig.num_speculative_tokens`` | set when not given | lookahead's default K on V2 (``DEFAULT_K``) |
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from vllm_lookahead.model_runner_v2 import DEFAULT_K


class LookaheadSpeculatorConfig(SpeculatorConfig):
    speculator_class = "vllm_lookahead.model_runner_v2.speculator.LookaheadSpeculator"

    @classmethod
    def configure(cls, spec: Any) -> None:
        super().configure(spec)
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = DEFAULT_K
