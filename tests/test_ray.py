"""The plugin under Ray (``distributed_executor_backend="ray"``): the entry point loads in
Ray's workers, the drafter binds to their runners, and output stays exact.

vLLM's CPU platform refuses Ray, so this runs only where CUDA is (scripts/gpu_validate.sh);
elsewhere it is reported as skipped with that reason.
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import ENGINE_KWARGS, LOOKAHEAD, generate, greedy, make_prompts, shutdown


def _why_not_here() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed"
    import torch

    if not torch.cuda.is_available():
        return "vLLM's CPU platform refuses Ray (runs in scripts/gpu_validate.sh)"
    return None


@pytest.mark.skipif(_why_not_here() is not None, reason=str(_why_not_here()))
def test_lookahead_under_ray_matches_plain_decoding(llama_path, llama_reference):
    from vllm import LLM

    llm = LLM(llama_path, speculative_config=LOOKAHEAD, distributed_executor_backend="ray",
              **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(), greedy())
    stats = llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats)
    shutdown(llm)
    assert outputs == llama_reference
    assert stats[0].generated_tokens > 1.5 * stats[0].request_passes  # really speculated
