"""A speculative step without draft tokens skips vLLM's rejection sampling
(``worker/sampler.bonus_tokens_only``): the same verdict, the bonus tokens, without
the vocabulary of noise vLLM draws for sampled rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler

from vllm_lookahead.worker.sampler import (
    _hooked_rejection_sample,
    _route_verification,
    cpu_expand_is_broken,
    expand_batch_to_tokens,
)

VOCAB = 64
BONUS = torch.tensor([[5], [7], [9]], dtype=torch.int32)
# vLLM's own function, whether or not the plugin has wrapped it in this process
VLLM_REJECTION_SAMPLE = getattr(rejection_sampler.rejection_sample, "__wrapped__",
                                rejection_sampler.rejection_sample)


def sampling(temperatures: list[float]) -> SimpleNamespace:
    """What ``rejection_sample`` reads of vLLM's ``SamplingMetadata``."""
    t = torch.tensor(temperatures, dtype=torch.float32)
    return SimpleNamespace(all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()),
                           temperature=t, generators={})


def undrafted_args(temperatures: list[float]) -> tuple:
    rows = len(temperatures)
    return (torch.empty(0, dtype=torch.int32), [0] * rows, 0,
            torch.zeros(rows, dtype=torch.int32), None, torch.empty(0, VOCAB),
            BONUS[:rows].clone(), sampling(temperatures))


@pytest.mark.parametrize("temperatures", [[0.0, 0.0, 0.0], [0.0, 0.7, 1.0], [0.7, 1.0, 0.7]])
def test_the_verdict_is_vllms(temperatures):
    register = getattr(type(current_platform), "register_triton_kernel_overrides", None)
    if register is None:  # 0.26 on CPU; CUDA kernels would need CUDA tensors
        pytest.skip("vLLM's rejection kernels are callable outside an engine only with "
                    "vLLM 0.32's CPU overrides")
    register()
    hooked = _hooked_rejection_sample(VLLM_REJECTION_SAMPLE)
    expected = VLLM_REJECTION_SAMPLE(*undrafted_args(temperatures))
    got = hooked(*undrafted_args(temperatures))
    assert got.dtype == expected.dtype and got.tolist() == expected.tolist()


def test_undrafted_steps_draw_no_noise():
    """vLLM draws a row of exponential noise over the vocabulary per sampled request
    (1.2 ms a step on a 2-core CPU at 49152 tokens); without draft tokens none is needed,
    and steps with drafts still go to vLLM."""
    calls = []

    def original(*args, **kwargs):
        calls.append(len(args[0]))
        return "vLLM's verdict"

    hooked = _hooked_rejection_sample(original)
    state = torch.get_rng_state()
    assert hooked(*undrafted_args([0.7, 1.0, 0.7])).tolist() == [[5], [7], [9]]
    assert torch.equal(torch.get_rng_state(), state)
    assert calls == []
    drafted = hooked(torch.tensor([3], dtype=torch.int32), [1, 0, 0], 1,
                     torch.tensor([1, 1, 1], dtype=torch.int32), None, torch.zeros(1, VOCAB),
                     BONUS.clone(), sampling([0.7, 1.0, 0.7]))
    assert drafted == "vLLM's verdict" and calls == [1]


def real_sampling_metadata(temperatures: list[float], seeded_row: int | None = None,
                           max_num_logprobs: int | None = None):
    """vLLM's ``SamplingMetadata`` for rows at these temperatures, top-p 0.9 on sampled
    rows, no penalties; ``seeded_row`` draws from its own generator."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    t = torch.tensor(temperatures, dtype=torch.float32)
    rows = len(temperatures)
    generators = {} if seeded_row is None else {
        seeded_row: torch.Generator().manual_seed(1234)}
    return SamplingMetadata(
        temperature=None if bool((t == 0).all()) else t, all_greedy=bool((t == 0).all()),
        all_random=bool((t > 0).all()), top_p=torch.where(t > 0, 0.9, 1.0), top_k=None,
        generators=generators, max_num_logprobs=max_num_logprobs, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows), repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(rows)])


def undrafted_metadata(rows: int):
    """vLLM's ``SpecDecodeMetadata`` of a step without draft tokens, as the runner
    builds it (``make_dummy`` points every row at row 0)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    zeros, rows_ = torch.zeros(rows, dtype=torch.int32), torch.arange(rows, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.empty(0, dtype=torch.int32), num_draft_tokens=[0] * rows,
        cu_num_draft_tokens=zeros, cu_num_sampled_tokens=rows_ + 1,
        target_logits_indices=torch.empty(0, dtype=torch.int32),
        bonus_logits_indices=rows_, logits_indices=rows_)


def rejection_sampler_of(monkeypatch, rejection_sample=None):
    """vLLM's ``RejectionSampler`` over its ``Sampler``, with the plugin's CPU fixes;
    its verdict ``rejection_sample``'s, by default vLLM's behind the plugin's hook (on a
    step without draft tokens the bonus tokens, ``bonus_tokens_only``, which
    ``test_the_verdict_is_vllms`` holds to vLLM's)."""
    from vllm.v1.sample.sampler import Sampler

    monkeypatch.setattr(rejection_sampler, "rejection_sample",
                        rejection_sample or _hooked_rejection_sample(VLLM_REJECTION_SAMPLE))
    if cpu_expand_is_broken():
        monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
    return rejection_sampler.RejectionSampler(Sampler())


@pytest.mark.parametrize("temperatures,seeded_row", [
    ([0.0, 0.0, 0.0], None), ([0.0, 0.7, 1.0], None), ([0.7, 1.0, 0.7], 1)])
def test_a_step_without_drafts_samples_as_vllms_rejection_sampler(
        monkeypatch, temperatures, seeded_row):
    """The sampler alone gives the tokens vLLM's whole verification would, from the same
    logits and random state, for greedy, sampled and seeded rows."""
    rows = len(temperatures)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    metadata = undrafted_metadata(rows)
    verifier = rejection_sampler_of(monkeypatch)
    by_route: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for route in (False, True):
        if route:
            _route_verification(verifier, None, None)
        for seed in range(20):
            torch.manual_seed(seed)
            by_route[route].append(verifier.forward(
                metadata, None, logits.clone(),
                real_sampling_metadata(temperatures, seeded_row)).sampled_token_ids)
    for vllms, alone in zip(by_route[False], by_route[True]):
        assert alone.dtype == vllms.dtype and alone.tolist() == vllms.tolist()
    if any(temperatures):  # the seeds did draw different tokens
        assert len({tuple(out.view(-1).tolist()) for out in by_route[True]}) > 1


def test_only_steps_without_drafts_or_logprobs_skip_vllms_verification(monkeypatch):
    """vLLM's path around its sampler (a logits copy, constraints on an empty target) is
    skipped where nothing is verified; a drafted step, one asking for log-probabilities
    and one under a drafter's own acceptance rule still take it."""
    verified = []

    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, *args, **kwargs):
        verified.append(list(num_draft_tokens))
        return torch.zeros(len(num_draft_tokens), max_spec_len + 1, dtype=torch.int32)

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    logits = torch.randn(4, VOCAB)
    drafted = SpecDecodeMetadata(
        draft_token_ids=torch.tensor([3], dtype=torch.int32), num_draft_tokens=[0, 1, 0],
        cu_num_draft_tokens=torch.tensor([0, 1, 1], dtype=torch.int32),
        cu_num_sampled_tokens=torch.tensor([1, 3, 4], dtype=torch.int32),
        target_logits_indices=torch.tensor([1], dtype=torch.int32),
        bonus_logits_indices=torch.tensor([0, 2, 3], dtype=torch.int32),
        logits_indices=torch.arange(4, dtype=torch.int32))
    plain = rejection_sampler_of(monkeypatch, rejection_sample)
    _route_verification(plain, None, None)
    sampled = real_sampling_metadata([0.0, 0.7, 1.0])
    plain.forward(undrafted_metadata(3), None, logits[:3].clone(), sampled)
    assert verified == []
    plain.forward(drafted, None, logits.clone(), sampled)
    assert verified == [[0, 1, 0]]
    plain.forward(undrafted_metadata(3), None, logits[:3].clone(),
                  real_sampling_metadata([0.0, 0.0, 0.0], max_num_logprobs=2))
    assert verified == [[0, 1, 0], [0, 0, 0]]
    ruled = rejection_sampler_of(monkeypatch, rejection_sample)
    _route_verification(ruled, None, lambda *args: None)
    ruled.forward(undrafted_metadata(3), None, logits[:3].clone(), sampled)
    assert verified == [[0, 1, 0], [0, 0, 0], [0, 0, 0]]
