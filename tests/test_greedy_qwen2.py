"""Greedy lookahead output is bit-exact with plain decoding on a Qwen2 architecture."""

from __future__ import annotations

from conftest import (
    ENGINE_KWARGS,
    LOOKAHEAD,
    generate,
    greedy,
    make_prompts,
    metrics,
    shutdown,
)
from vllm import LLM


def test_qwen2_matches_plain_decoding(qwen2_path):
    prompts = make_prompts(seed=1)
    plain = LLM(qwen2_path, **ENGINE_KWARGS)
    expected = generate(plain, prompts, greedy())
    shutdown(plain)
    llm = LLM(qwen2_path, speculative_config=LOOKAHEAD, disable_log_stats=False,
              **ENGINE_KWARGS)
    assert generate(llm, prompts, greedy()) == expected
    assert metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    shutdown(llm)
