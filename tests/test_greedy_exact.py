"""Greedy lookahead output is bit-exact with plain decoding (float32, tiny random Llama).

One lookahead engine serves the whole module. No other engine with stats enabled may
start while it lives: vLLM re-registers its Prometheus collectors process-wide, which
would freeze this engine's counters.
"""

from __future__ import annotations

import pytest
from conftest import (
    LONG_MAX_TOKENS,
    LONG_PROMPT,
    CAPTURING,
    STRESSED,
    generate,
    generate_aborting_one,
    greedy,
    make_prompts,
    metrics,
    shutdown,
    stats_once_idle,
)
from vllm import LLM

GREEDY = greedy()



@pytest.fixture(scope="module")
def stressed_lookahead(llama_path):
    llm = LLM(llama_path, speculative_config=CAPTURING, disable_log_stats=False, **STRESSED)
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
    # the default trees (auto) passed the self-check and were tried
    stats, = stats_once_idle(stressed_lookahead)
    assert stats.start_free_tokens > 0 and stats.tree_check == 1 and stats.tree_steps > 0


def test_batch_of_1_matches_plain_decoding(stressed_lookahead, llama_reference):
    for prompt, expected in zip(make_prompts(), llama_reference):
        assert generate(stressed_lookahead, [prompt], GREEDY) == [expected]


def test_proposer_state_is_freed_after_requests_finish(stressed_lookahead):
    generate(stressed_lookahead, make_prompts()[:3], GREEDY)
    (stats,) = stats_once_idle(stressed_lookahead)
    assert stats.active_requests == 0
    assert stats.harvested_ngrams > 0
    assert stats.lattice_tokens > 0  # draft rescoring (CAPTURING) chose lattice paths
    assert stats.recycled_rows > 0  # every pass's top-k reached the recycled table


def test_abort_mid_generation_frees_state_and_spares_the_others(stressed_lookahead,
                                                                  llama_reference):
    finished = generate_aborting_one(stressed_lookahead, [GREEDY] * 3)
    assert finished == {"r0": llama_reference[0], "r2": llama_reference[2]}
    (stats,) = stats_once_idle(stressed_lookahead)
    assert stats.active_requests == 0


def test_generation_up_to_max_model_len(stressed_lookahead, plain_llama_runs):
    """Drafts never run past max_model_len; the tokens next to the limit are exact."""
    assert len(LONG_PROMPT) + LONG_MAX_TOKENS == STRESSED["max_model_len"]
    params = greedy(LONG_MAX_TOKENS)
    before = metrics(stressed_lookahead)["vllm:spec_decode_num_accepted_tokens"]
    assert generate(stressed_lookahead, [LONG_PROMPT], params) == [plain_llama_runs["long"]]
    assert metrics(stressed_lookahead)["vllm:spec_decode_num_accepted_tokens"] > before


def test_per_request_options_offline(stressed_lookahead, llama_reference):
    """LLM.generate: a bad value fails at admission; good ones keep the output exact."""
    prompts = make_prompts()[:2]
    bad = greedy()
    bad.extra_args = {"lookahead_num_speculative_tokens": 6}  # the engine's K is 5
    with pytest.raises(Exception, match=r"must be an integer in \[0, 5\]"):
        generate(stressed_lookahead, prompts, bad)
    for k in (0, 3):
        params = greedy()
        params.extra_args = {"lookahead_num_speculative_tokens": k}
        assert generate(stressed_lookahead, prompts, params) == llama_reference[:2]
