"""Temperature > 0 with lookahead: drafts are verified against correct probabilities
(vLLM's CPU fallback corrupts them; worker.py fixes it) and samples keep the target's
distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    ENGINE_KWARGS,
    LOOKAHEAD,
    generate,
    greedy,
    make_prompts,
    metrics,
    shutdown,
)
from scipy.stats import chi2_contingency
from vllm import LLM, SamplingParams

from vllm_lookahead.worker import expand_batch_to_tokens

SAMPLES = 1500
SIGNIFICANCE = 0.001  # per position tested; three positions


@pytest.fixture(scope="module")
def lookahead_llm(llama_path):
    llm = LLM(llama_path, speculative_config=LOOKAHEAD, disable_log_stats=False,
              **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


def acceptance(llm, run):
    """Mean acceptance length of the drafts verified during ``run()``."""
    before = metrics(llm)
    outputs = run()
    after = metrics(llm)
    accepted, drafts = (after[k] - before[k] for k in (
        "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_drafts"))
    return outputs, 1 + accepted / drafts


def test_cpu_expand_fix_matches_reference():
    x = torch.tensor([0.7, 0.0, 1.3])
    cu = torch.tensor([2, 2, 5])
    assert expand_batch_to_tokens(x, cu, 5, replace_from=0, replace_to=1).tolist() == \
        pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3])


def test_fix_is_installed_in_the_worker(lookahead_llm):
    def expand_module(worker):
        from vllm.v1.sample import rejection_sampler

        return rejection_sampler.expand_batch_to_tokens.__module__

    assert lookahead_llm.collective_rpc(expand_module) == ["vllm_lookahead.worker"]


def test_drafts_equal_to_the_targets_sample_are_accepted(lookahead_llm):
    """At T=0.01 the target's sample is its argmax almost surely: drafts that match it
    must be accepted as often as under greedy verification (garbage probabilities, as
    without the CPU fix, accept about 5%)."""
    prompts = make_prompts()
    _, greedy_mal = acceptance(lookahead_llm, lambda: generate(
        lookahead_llm, prompts, greedy(64)))
    _, sampled_mal = acceptance(lookahead_llm, lambda: generate(
        lookahead_llm, prompts,
        SamplingParams(temperature=0.01, max_tokens=64, ignore_eos=True)))
    assert greedy_mal > 2.0
    assert sampled_mal >= 0.9 * greedy_mal


def sample_tokens(llm, prompt):
    # No per-request seeds: vLLM's CPU runner crashes when a seeded request's prefill is
    # chunked ("CPU Generator does not use offset"); the engine seed keeps runs repeatable.
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outputs])


def same_distribution_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity test; tokens rarer than 10 in both samples are pooled."""
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = tokens[counts >= 10]
    table = [[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))] for x in (a, b)]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    return chi2_contingency(table).pvalue


@pytest.fixture(scope="module")
def samples(llama_path, lookahead_llm):
    plain = LLM(llama_path, **ENGINE_KWARGS)
    # the model's own greedy loop as context: drafts are likely samples, not noise
    base = make_prompts()[0]
    prompt = base + generate(plain, [base], greedy())[0]
    reference = sample_tokens(plain, prompt)
    shutdown(plain)
    speculated, mal = acceptance(lookahead_llm, lambda: sample_tokens(lookahead_llm, prompt))
    assert mal > 1.5  # the positions below really went through draft verification
    return reference, speculated


@pytest.mark.parametrize("position", [1, 2, 3])
def test_sampled_tokens_follow_the_target_distribution(samples, position):
    reference, speculated = samples
    assert same_distribution_pvalue(reference[:, position], speculated[:, position]) > SIGNIFICANCE


def test_distribution_test_detects_a_biased_sampler(samples):
    """Control: a sampler that returns one fixed plausible token (the reference's second
    most common) instead of its sample 10% of the time is caught by the same test."""
    reference, speculated = samples
    biased = speculated[:, 1].copy()
    favoured = np.bincount(reference[:, 1]).argsort()[-2]
    rng = np.random.default_rng(0)
    biased[rng.random(SAMPLES) < 0.10] = favoured
    assert same_distribution_pvalue(reference[:, 1], biased) < SIGNIFICANCE
