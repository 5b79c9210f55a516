"""Greedy lookahead output is bit-exact with plain decoding on a Qwen2 architecture,
with linear drafts, drafts filled to K and tree drafts.

The tiny Qwen2 is nearly a bigram model (small residual scale), so its output loops and
drafts are often accepted, also on tree branches off the first chain: there a wrong
ancestor mask, position or KV move changes the output (checked by breaking each)."""

from __future__ import annotations

import pytest
from conftest import (
    ENGINE_KWARGS,
    LOOKAHEAD,
    TREE,
    generate,
    greedy,
    make_prompts,
    metrics,
    proposer_stats,
    shutdown,
)
from vllm import LLM


@pytest.fixture(scope="module")
def expected(qwen2_path):
    plain = LLM(qwen2_path, **ENGINE_KWARGS)
    outputs = generate(plain, make_prompts(seed=1), greedy())
    shutdown(plain)
    return outputs


def test_qwen2_matches_plain_decoding(qwen2_path, expected):
    llm = LLM(qwen2_path, speculative_config=LOOKAHEAD, disable_log_stats=False,
              **ENGINE_KWARGS)
    assert generate(llm, make_prompts(seed=1), greedy()) == expected
    assert metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    shutdown(llm)


def test_drafts_filled_to_k_match_plain_decoding(qwen2_path, expected):
    filled = {**LOOKAHEAD, "uniform_drafts": "on", "trees": "off"}
    llm = LLM(qwen2_path, speculative_config=filled, disable_log_stats=False, **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(seed=1), greedy())
    counters = metrics(llm)
    stats, = proposer_stats(llm)
    shutdown(llm)
    assert outputs == expected
    assert stats.filled_steps > 0 and stats.padding_tokens > 0
    # every request of every step drafted and verified K tokens: each step was uniform
    k = LOOKAHEAD["num_speculative_tokens"]
    assert stats.draft_tokens == k * stats.drafts
    verified = counters["vllm:spec_decode_num_draft_tokens"]
    assert verified == k * counters["vllm:spec_decode_num_drafts"]
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0


def test_tree_drafts_match_plain_decoding(qwen2_path, expected):
    llm = LLM(qwen2_path, speculative_config=TREE, **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(seed=1), greedy())
    stats, = proposer_stats(llm)
    shutdown(llm)
    assert outputs == expected
    assert stats.tree_nodes > 0 and stats.harvested_ngrams > 0
    assert stats.tree_accepted >= 10  # accepted tokens off the first chain
