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
    SAMPLES,
    SIGNIFICANCE,
    generate,
    greedy,
    make_prompts,
    metrics,
    same_distribution_pvalue,
    sample_tokens,
    shutdown,
)
from vllm import LLM, SamplingParams

from vllm_lookahead.lookahead.options import DEFAULT_SPEC_TOKENS
from vllm_lookahead.worker.sampler import expand_batch_to_tokens


@pytest.fixture(scope="module")
def lookahead_llm(llama_path):
    # Without the cost-aware cut: with 1500 requests in flight it may drop every draft
    # (it depends on the timings it fitted), and this module tests verification.
    llm = LLM(llama_path, speculative_config={**LOOKAHEAD, "cost_aware_drafts": False},
              disable_log_stats=False, **ENGINE_KWARGS)
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


def test_fix_is_installed_in_the_worker_where_vllm_needs_it(lookahead_llm):
    def expand_module(worker):
        from vllm.v1.sample import rejection_sampler

        from vllm_lookahead.worker.sampler import cpu_expand_is_broken

        return cpu_expand_is_broken(), rejection_sampler.expand_batch_to_tokens.__module__

    for broken, module in lookahead_llm.collective_rpc(expand_module):
        assert module == ("vllm_lookahead.worker.sampler" if broken
                          else "vllm.v1.sample.rejection_sampler")


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


@pytest.fixture(scope="module")
def samples(plain_samples, lookahead_llm):
    prompt, reference = plain_samples
    speculated, mal = acceptance(lookahead_llm, lambda: sample_tokens(lookahead_llm, prompt))
    assert mal > 1.5  # the positions below really went through draft verification
    return reference, speculated


@pytest.mark.parametrize("position", [1, 2, 3])
def test_sampled_tokens_follow_the_target_distribution(samples, position):
    reference, speculated = samples
    assert same_distribution_pvalue(reference[:, position], speculated[:, position]) > SIGNIFICANCE


def biased(reference: np.ndarray, speculated: np.ndarray, seed: int) -> np.ndarray:
    """The samples' second tokens from a sampler that returns one fixed plausible token
    (the reference's second most common) instead of its sample 20% of the time (at 10%
    the p-value sat near the threshold: 0.00114 in one run, with 1500 samples)."""
    tokens = speculated[:, 1].copy()
    favoured = np.bincount(reference[:, 1]).argsort()[-2]
    tokens[np.random.default_rng(seed).random(SAMPLES) < 0.20] = favoured
    return tokens


def test_distribution_test_detects_a_biased_sampler(samples):
    """Control: a biased sampler (``biased``) is caught by the same test."""
    reference, speculated = samples
    assert same_distribution_pvalue(reference[:, 1], biased(reference, speculated, 0)) \
        < SIGNIFICANCE


#: Mean acceptance length the penalised samples below must reach for their positions to
#: have gone through verification (1.24 and 1.25 with vLLM 0.26 and 0.32: 4-token samples
#: at T = 1.0, a repetition penalty against the prompt's loop).
MIN_PENALISED_ACCEPTANCE = 1.1


def _penalised_samples(llm, prompt, penalties: dict, drafts: bool = True) -> np.ndarray:
    """SAMPLES 4-token samples after ``prompt`` at T = 1.0, drawn ``n`` = 4 at a time;
    without drafts (``lookahead_num_speculative_tokens: 0``) the plain sampler's, token
    for token (test_request_matrix.py's seeded test)."""
    undrafted = {} if drafts else {"extra_args": {"lookahead_num_speculative_tokens": 0}}
    params = SamplingParams(n=4, temperature=1.0, max_tokens=4, ignore_eos=True,
                            **penalties, **undrafted)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * (SAMPLES // 4), params,
                           use_tqdm=False)
    return np.array([c.token_ids for o in outputs for c in o.outputs])


def test_penalised_samples_with_n_follow_the_target_distribution(plain_samples, lookahead_llm):
    """Penalties on sampled requests with ``n`` = 4: the distribution of the same requests
    without drafts; the control (no penalties) shows the test sees the penalties. The
    engine is this module's, without the cost-aware cut: the defaults' cut may drop every
    draft of 1500 sequences in flight (it did in a CI run), leaving nothing verified."""
    prompt, _ = plain_samples
    penalties = dict(repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5)
    reference = _penalised_samples(lookahead_llm, prompt, penalties, drafts=False)
    speculated, mal = acceptance(lookahead_llm,
                                 lambda: _penalised_samples(lookahead_llm, prompt, penalties))
    unpenalised = _penalised_samples(lookahead_llm, prompt, {}, drafts=False)
    assert mal > MIN_PENALISED_ACCEPTANCE
    for position in (1, 2, 3):
        assert same_distribution_pvalue(reference[:, position],
                                        speculated[:, position]) > SIGNIFICANCE
    assert min(same_distribution_pvalue(unpenalised[:, p], speculated[:, p])
               for p in (1, 2, 3)) < SIGNIFICANCE


#: Lookahead's defaults with drafts filled to K (``DEFAULT_SPEC_TOKENS``: every slot
#: verified under sampling, which the cost cut would otherwise mostly drop with 1500
#: requests in flight).
FILLED_DEFAULTS = {"method": "lookahead", "uniform_drafts": "on"}
#: KV pool, in requests of the sampled prompt (its tokens, 4 samples and K slots):
#: vLLM admits more and preempts the running ones when their drafts need blocks.
PRESSED_REQUESTS = 3


def kv_bytes_per_token(model_path: str, dtype_bytes: int = 4) -> int:
    """Keys and values of one token, from the model's config (float32)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return (2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads)
            * head_dim * dtype_bytes)


@pytest.fixture(scope="module")
def pressed_samples(plain_samples, llama_path):
    """Samples with the defaults and filled drafts under memory pressure: chunked prefill
    on a 32-token budget and a KV pool of a few requests, prefix caching off (the samples
    share their prompt)."""
    prompt, reference = plain_samples
    # the samples, K slots and a bonus token
    max_model_len = len(prompt) + 4 + DEFAULT_SPEC_TOKENS + 16
    kv_bytes = PRESSED_REQUESTS * max_model_len * kv_bytes_per_token(llama_path)
    llm = LLM(llama_path, speculative_config=FILLED_DEFAULTS, disable_log_stats=False,
              **{**ENGINE_KWARGS, "max_model_len": max_model_len, "kv_cache_memory_bytes":
                 kv_bytes, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
                 "enable_prefix_caching": False})
    try:
        speculated, mal = acceptance(llm, lambda: sample_tokens(llm, prompt))
        pressure = metrics(llm)["vllm:num_preemptions"]
    finally:
        shutdown(llm)
    return reference, speculated, mal, pressure


def test_sampling_under_preemption_was_speculated_and_preempted(pressed_samples):
    """The tests below are not vacuous: drafts were accepted (1.48 in one run: the
    samples are 4 tokens, at T = 0.7) and vLLM preempted requests."""
    _, _, mal, preemptions = pressed_samples
    assert mal > 1.2
    assert preemptions > 0


@pytest.mark.parametrize("position", [1, 2, 3])
def test_sampled_tokens_under_preemption_follow_the_target_distribution(pressed_samples,
                                                                        position):
    reference, speculated, _, _ = pressed_samples
    assert same_distribution_pvalue(reference[:, position], speculated[:, position]) > SIGNIFICANCE


def test_the_distribution_test_under_preemption_detects_a_biased_sampler(pressed_samples):
    """Control: the same samples from a biased sampler (``biased``) fail the test."""
    reference, speculated, _, _ = pressed_samples
    assert same_distribution_pvalue(reference[:, 1], biased(reference, speculated, 1)) \
        < SIGNIFICANCE
