"""Recovered tokens on CPU by inverse transform (``worker/cpu_recovered_tokens.py``):
the distribution vLLM's Gumbel draw samples, the target's without the draft token,
from one uniform number a request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler

from vllm_lookahead.worker.cpu_recovered_tokens import recovered_tokens

PROBS = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
DRAFT = 1  # the target's likeliest token, rejected
SAMPLES = 40_000
# vLLM's own function, whether or not the plugin has wrapped it in this process
VLLM_FUNCTION = getattr(rejection_sampler.sample_recovered_tokens, "__wrapped__",
                        rejection_sampler.sample_recovered_tokens)


def expected() -> torch.Tensor:
    without_draft = PROBS.clone()
    without_draft[DRAFT] = 0
    return without_draft / without_draft.sum()


def frequencies(draw) -> torch.Tensor:
    """Token frequencies of ``SAMPLES`` requests with one draft token each (seeded)."""
    torch.manual_seed(0)
    tokens = draw([1] * SAMPLES, torch.full((SAMPLES,), DRAFT, dtype=torch.int64),
                  PROBS.expand(SAMPLES, -1).contiguous(), {})
    return torch.bincount(tokens, minlength=len(PROBS)).double() / SAMPLES


def assert_draws_expected(draw) -> None:
    """Within 0.01 of each token's probability (4 standard deviations at 40000 draws);
    never the draft token or a token of probability 0."""
    got = frequencies(draw)
    assert got[DRAFT] == 0 and got[2] == 0
    assert torch.allclose(got, expected().double(), atol=0.01), got


def test_draws_the_target_without_the_draft_token():
    assert_draws_expected(recovered_tokens)


def test_a_placeholder_draft_position_draws_from_the_whole_target():
    """vLLM pads a draft with -1 (a position always rejected, seen under preemption and
    aborts): its token comes from the target itself, as vLLM's kernel draws it."""
    torch.manual_seed(0)
    drafts = torch.tensor([-1, DRAFT] * (SAMPLES // 2), dtype=torch.int64)
    tokens = recovered_tokens([1] * SAMPLES, drafts, PROBS.expand(SAMPLES, -1).contiguous(), {})
    placeholder = torch.bincount(tokens[0::2], minlength=len(PROBS)).double() / (SAMPLES // 2)
    drafted = torch.bincount(tokens[1::2], minlength=len(PROBS)).double() / (SAMPLES // 2)
    assert torch.allclose(placeholder, PROBS.double(), atol=0.015), placeholder
    assert drafted[DRAFT] == 0 and torch.allclose(drafted, expected().double(), atol=0.015)


def test_a_draw_keeping_the_draft_token_fails_the_check():
    """The check's failing control: drawing from the target itself."""
    def keeps_draft(counts, draft_ids, probs, generators):
        return torch.multinomial(probs, 1).view(-1)

    with pytest.raises(AssertionError):
        assert_draws_expected(keeps_draft)


def test_vllms_draw_passes_the_same_check():
    """vLLM's Gumbel draw samples the same distribution (callable outside an engine with
    vLLM 0.32's CPU kernel overrides only)."""
    register = getattr(type(current_platform), "register_triton_kernel_overrides", None)
    if register is None:
        pytest.skip("vLLM's recovered-token kernel is callable outside an engine only with "
                    "vLLM 0.32's CPU overrides")
    register()

    def vllms(counts, draft_ids, probs, generators):
        return VLLM_FUNCTION(1, counts, torch.tensor(counts).cumsum(0).int(), draft_ids, None,
                             probs, SimpleNamespace(generators=generators), probs.device)

    assert_draws_expected(vllms)


def test_positions_share_their_requests_number_and_seeded_requests_repeat():
    probs = torch.softmax(torch.randn(5, 50), dim=-1)
    drafts = torch.tensor([3, 3, 3, 7, 7])
    seeded = {1: torch.Generator().manual_seed(11)}
    first = recovered_tokens([3, 2], drafts, probs, seeded)
    again = recovered_tokens([3, 2], drafts, probs, {1: torch.Generator().manual_seed(11)})
    assert first[3:].tolist() == again[3:].tolist()  # the seeded request's
    same_rows = recovered_tokens([3], drafts[:3], probs[:1].expand(3, -1).contiguous(), {})
    assert len(set(same_rows.tolist())) == 1  # one number for a request's positions
    assert not (first == drafts).any()


def test_installed_on_cpu_without_exponential_noise(monkeypatch):
    """With the plugin loaded on CPU, vLLM's function is wrapped and draws no
    exponential noise; drafts with probabilities still go to vLLM's own draw."""
    if not current_platform.is_cpu():
        pytest.skip("installed on CPU only")
    from vllm_lookahead.worker import cpu_recovered_tokens

    cpu_recovered_tokens.install()

    def no_noise(*args, **kwargs):
        raise AssertionError("exponential noise drawn")

    monkeypatch.setattr(torch.Tensor, "exponential_", no_noise)
    probs = torch.softmax(torch.randn(2, 50), dim=-1)
    got = rejection_sampler.sample_recovered_tokens(
        2, [2], torch.tensor([2], dtype=torch.int32), torch.tensor([4, 9]), None, probs,
        SimpleNamespace(generators={}), probs.device)
    assert got.shape == (2,) and got.dtype == torch.int64
    with pytest.raises(AssertionError, match="noise"):
        rejection_sampler.sample_recovered_tokens(
            2, [2], torch.tensor([2], dtype=torch.int32), torch.tensor([4, 9]), probs.clone(),
            probs, SimpleNamespace(generators={}), probs.device)
