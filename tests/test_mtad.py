"""MTAD end to end: exactness, acceptance, aborts, preemption, distributions, tensor
parallel (tiny random Llama as target; as auxiliary the same model, or the tiny Qwen2)."""

from __future__ import annotations

import math

import pytest
from conftest import (
    ENGINE_KWARGS,
    SIGNIFICANCE,
    STRESSED,
    generate,
    generate_aborting_one,
    greedy,
    make_prompts,
    metrics,
    mtad,
    proposer_stats,
    same_distribution_pvalue,
    sample_tokens,
    shutdown,
    stats_once_idle,
)
from scheduler_probe import run_beside_scheduler
from vllm import LLM, SamplingParams

SAMPLED = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def joint_llm(llama_path):
    llm = LLM(llama_path, speculative_config=mtad(llama_path, draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


def tokens_per_pass(llm, run):
    before = proposer_stats(llm)[0]
    outputs = run()
    after = proposer_stats(llm)[0]
    passes = after.request_passes - before.request_passes
    return outputs, (after.generated_tokens - before.generated_tokens) / passes


def test_auxiliary_equal_to_target_is_almost_always_accepted(joint_llm):
    outputs, per_pass = tokens_per_pass(joint_llm, lambda: generate(
        joint_llm, make_prompts(), SAMPLED))
    assert all(len(o) == 64 for o in outputs)
    assert per_pass > 4.3  # of at most K + 1 = 5; only a request's last step is short


def test_greedy_requests_match_plain_decoding(joint_llm, llama_reference):
    outputs, per_pass = tokens_per_pass(joint_llm, lambda: generate(
        joint_llm, make_prompts(), greedy()))
    assert outputs == llama_reference
    assert per_pass > 4.3


def test_mixed_batch_keeps_greedy_rows_exact(joint_llm, llama_reference):
    prompts = make_prompts()
    params = [greedy() if i % 2 == 0 else SAMPLED for i in range(len(prompts))]
    outputs = joint_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
    for i, output in enumerate(outputs):
        if i % 2 == 0:
            assert list(output.outputs[0].token_ids) == llama_reference[i]


def test_logprobs_come_with_the_accepted_tokens(joint_llm):
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=2)
    (output,) = joint_llm.generate([{"prompt_token_ids": make_prompts()[1]}], params,
                                   use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 32
    for token, candidates in zip(completion.token_ids, completion.logprobs):
        assert token in candidates and math.isfinite(candidates[token].logprob)


def test_logit_bias_requests_are_served_without_drafts(joint_llm):
    """vLLM refuses logit_bias under speculation; MTAD serves it through the plain
    sampler (the bias decides every token here), without drafts, counted."""
    before = proposer_stats(joint_llm)[0].requests_without_drafts
    params = greedy(16)
    params.logit_bias = {7: 100.0}
    assert generate(joint_llm, make_prompts()[:2], params) == [[7] * 16] * 2
    assert proposer_stats(joint_llm)[0].requests_without_drafts - before == 2


def test_abort_mid_generation_frees_state(joint_llm, llama_reference):
    finished = generate_aborting_one(joint_llm, [greedy(), SAMPLED, greedy()])
    assert finished == {"r0": llama_reference[0], "r2": llama_reference[2]}
    (stats,) = stats_once_idle(joint_llm)
    assert stats.active_requests == 0


def test_chunked_prefill_and_preemption_keep_greedy_exact(llama_path, llama_reference):
    """A 64-token prefill budget chunks the long prompts; a KV cache of 1024 tokens cannot
    hold the 8 requests, so some are preempted and resumed (their auxiliary cache
    rebuilt). The auxiliary layers take as much KV per token as the target's here."""
    stressed = {**STRESSED, "kv_cache_memory_bytes": 2 * STRESSED["kv_cache_memory_bytes"]}
    llm = LLM(llama_path, speculative_config=mtad(llama_path), disable_log_stats=False,
              **stressed)
    outputs = generate(llm, make_prompts(), greedy())
    sampled = generate(llm, make_prompts(), SAMPLED)
    preemptions = metrics(llm)["vllm:num_preemptions"]
    shutdown(llm)
    assert outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    assert preemptions > 0


def test_all_beams_under_a_tight_kv_budget_count_their_lookahead_slots_at_admission(
        llama_path, llama_reference):
    """candidates='all' under the KV budget of the test above: vLLM's admission estimate
    (built in Scheduler.__init__) counts the auxiliary model's gamma lookahead slots, and
    requests are preempted and resumed with their trees, greedy rows exact."""
    stressed = {**STRESSED, "kv_cache_memory_bytes": 2 * STRESSED["kv_cache_memory_bytes"]}
    result = run_beside_scheduler(llama_path, mtad(llama_path, candidates="all"), stressed,
                                  make_prompts(), greedy().max_tokens)
    assert result["num_spec_tokens"] == 16 and result["num_lookahead_tokens"] == 4
    if result["config_lookahead_tokens"] is not None:  # vLLM 0.32: Scheduler.__init__ reads it
        assert result["config_lookahead_tokens"] == 4
    if result["step_blocks"] is not None:  # vLLM 0.32's admission estimate
        assert result["step_blocks"] == math.ceil((1 + 16 + 4) / result["block_size"])
    assert result["outputs"] == llama_reference
    assert result["preemptions"] > 0


def test_all_beams_of_another_auxiliary_model_verified_as_a_tree(llama_path, qwen2_path,
                                                                  llama_reference):
    """candidates='all': the trie of all beams in one target pass (tree attention on
    CPU). Greedy rows stay exact; sampled rows accept tree nodes off the best beam; an
    auxiliary model other than the target is accepted in part."""
    llm = LLM(llama_path, speculative_config=mtad(qwen2_path, candidates="all"),
              **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(), greedy())
    sampled, per_pass = tokens_per_pass(llm, lambda: generate(llm, make_prompts(), SAMPLED))
    (stats,) = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    assert 1.0 <= per_pass < 4.0
    assert stats.tree_nodes > 0 and stats.tree_branches > 0


def test_transformers_runner_drafts_alike(llama_path, llama_reference):
    """``auxiliary_runner="transformers"`` (the fallback): the same guarantees."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, auxiliary_runner="transformers",
                                                  draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    outputs, per_pass = tokens_per_pass(llm, lambda: generate(llm, make_prompts(), greedy()))
    sampled, sampled_per_pass = tokens_per_pass(
        llm, lambda: generate(llm, make_prompts(), SAMPLED))
    shutdown(llm)
    assert outputs == llama_reference and per_pass > 4.3
    assert all(len(o) == 64 for o in sampled) and sampled_per_pass > 4.3


@pytest.mark.parametrize("candidates", ["best", "all"])
def test_lossless_mode_keeps_the_target_distribution(llama_path, plain_samples,
                                                      llama_reference, candidates):
    """The lossless rule, on the best beam and on the trie of all beams: samples follow
    the target's distribution, and greedy rows stay exact."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, acceptance="lossless",
                                                  candidates=candidates), **ENGINE_KWARGS)
    prompt, reference = plain_samples
    speculated, per_pass = tokens_per_pass(llm, lambda: sample_tokens(llm, prompt))
    outputs = generate(llm, make_prompts(), greedy())
    (stats,) = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    assert per_pass > 1.3  # drafts really were verified (4 tokens a request)
    if candidates == "all":
        assert stats.tree_nodes > 0 and stats.tree_branches > 0
    for position in (1, 2, 3):
        assert same_distribution_pvalue(reference[:, position],
                                        speculated[:, position]) > SIGNIFICANCE


@pytest.mark.once
def test_joint_mode_shifts_the_distribution(llama_path, plain_samples):
    """Control for the test above: the joint rule is not lossless (it keeps the most
    likely of the sampled beams), and the same test sees it. Beams sampled at a low
    temperature make the shift plain: a likely token passes the joint ratio more often
    than the target samples it (from the target itself at temperature 1, position 1's
    p-value was 0.0007 against the 0.001 threshold)."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, draft_temperature=0.3,
                                                  draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    prompt, reference = plain_samples
    speculated = sample_tokens(llm, prompt)
    shutdown(llm)
    pvalues = [same_distribution_pvalue(reference[:, p], speculated[:, p]) for p in (1, 2, 3)]
    assert min(pvalues) < SIGNIFICANCE


def test_tp2_drafts_on_the_first_rank_and_agrees(llama_path, llama_reference, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=mtad(llama_path, draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    greedy_outputs = generate(llm, make_prompts(), greedy())
    sampled = generate(llm, make_prompts(), SAMPLED)
    stats = proposer_stats(llm)
    shutdown(llm)
    assert greedy_outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    # rank 1 verified with rank 0's log-probabilities (a mismatch raises in accept)
    assert stats[0].draft_tokens == stats[1].draft_tokens > 0
