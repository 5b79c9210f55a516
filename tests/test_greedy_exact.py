"""Greedy lookahead output is bit-exact with plain decoding (float32, tiny random models)."""

from __future__ import annotations

import pytest
from conftest import (
    ENGINE_KWARGS,
    generate,
    make_prompts,
    metrics,
    proposer_stats,
    shutdown,
)
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
LOOKAHEAD = {"method": "lookahead", "num_speculative_tokens": 5}

# Chunked prefill with a 64-token budget splits the long prompts (up to 300 tokens);
# a KV cache of 1024 tokens cannot hold the 8 requests (~1650 tokens) at once, so
# some are preempted and recomputed.
STRESSED = {**ENGINE_KWARGS, "max_model_len": 512, "enable_chunked_prefill": True,
            "max_num_batched_tokens": 64, "kv_cache_memory_bytes": 1024 * 1024}


@pytest.fixture(scope="module")
def stressed_lookahead(llama_path):
    llm = LLM(llama_path, speculative_config=LOOKAHEAD, disable_log_stats=False, **STRESSED)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def batch_of_8(stressed_lookahead):
    outputs = generate(stressed_lookahead, make_prompts(), GREEDY)
    return outputs, metrics(stressed_lookahead)


def test_batch_of_8_matches_plain_decoding(batch_of_8, llama_reference):
    outputs, _ = batch_of_8
    assert outputs == llama_reference


def test_batch_of_8_really_speculated_chunked_and_preempted(batch_of_8, stressed_lookahead):
    _, counters = batch_of_8
    assert counters["vllm:num_preemptions"] > 0
    mean_acceptance_length = 1 + (counters["vllm:spec_decode_num_accepted_tokens"]
                                  / counters["vllm:spec_decode_num_drafts"])
    assert mean_acceptance_length > 2.0
    assert max(map(len, make_prompts())) > STRESSED["max_num_batched_tokens"]
    config = stressed_lookahead.llm_engine.vllm_config.scheduler_config
    assert config.enable_chunked_prefill


def test_batch_of_1_matches_plain_decoding(stressed_lookahead, llama_reference):
    for prompt, expected in zip(make_prompts(), llama_reference):
        assert generate(stressed_lookahead, [prompt], GREEDY) == [expected]


def test_proposer_state_is_freed_after_requests_finish(stressed_lookahead):
    generate(stressed_lookahead, make_prompts()[:3], GREEDY)
    (stats,) = proposer_stats(stressed_lookahead)
    assert stats.active_requests == 0
    assert stats.harvested_ngrams > 0


def test_qwen2_matches_plain_decoding(qwen2_path):
    prompts = make_prompts(seed=1)
    plain = LLM(qwen2_path, **ENGINE_KWARGS)
    expected = generate(plain, prompts, GREEDY)
    shutdown(plain)
    llm = LLM(qwen2_path, speculative_config=LOOKAHEAD, disable_log_stats=False,
              **ENGINE_KWARGS)
    assert generate(llm, prompts, GREEDY) == expected
    assert metrics(llm)["vllm:spec_decode_num_accepted_tokens"] > 0
    shutdown(llm)
