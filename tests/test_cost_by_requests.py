"""The step cost apart by requests and draft tokens: a request's own token costs more
than a draft token (it is sampled, output and streamed), and a batch that drains would
otherwise have the cut price a draft token as one."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_lookahead.lookahead.budget import affordable_draft_lengths
from vllm_lookahead.lookahead.step_cost import MAX_REQUEST_EXTRA, WINDOW, StepCostModel

FIXED, PER_REQUEST, PER_DRAFT = 0.117, 0.0042, 0.0026


def truth(requests, drafts):
    return FIXED + PER_REQUEST * requests + PER_DRAFT * drafts


def draining_batch(model: StepCostModel, seed: int = 0, told: bool = True) -> None:
    """64 requests finishing one by one, each step up to a quarter as many draft tokens
    as requests; 30 % of the steps 1.5-4x slower (other work on the machine)."""
    rng = np.random.default_rng(seed)
    for step in range(WINDOW):
        requests = max(1, 64 - step // 8)
        drafts = int(rng.integers(0, requests // 4 + 2))
        slowdown = rng.uniform(1.5, 4.0) if rng.random() < 0.3 else 1.0
        seconds = truth(requests, drafts) * slowdown * rng.lognormal(0, 0.03)
        model.add(requests + drafts, seconds, requests if told else 0)


@pytest.mark.parametrize("seed", range(4))
def test_a_draining_batch_prices_a_draft_token_below_a_requests_token(seed):
    model = StepCostModel()
    draining_batch(model, seed)
    step = model.curve_at(48)  # fits
    assert model.request_seconds == pytest.approx(PER_REQUEST - PER_DRAFT, rel=0.25)
    kept = np.arange(0, 48, 6)
    assert step(48 + kept) == pytest.approx(truth(48, kept), rel=0.05)
    assert model.free_tokens(48) == pytest.approx((FIXED + 48 * (PER_REQUEST - PER_DRAFT))
                                                  / PER_DRAFT, rel=0.25)


def test_the_cut_keeps_the_tokens_a_draft_tokens_cost_affords():
    """Drafts accepted at 0.55 pay where a draft token costs 0.0026 s and a request's
    share of a step 0.0042 + 0.117 / 48 s: kept by the split cost, cut by the cost by
    total tokens (whose slope on a draining batch is a request's)."""
    model = StepCostModel()
    draining_batch(model)
    lengths, rates = np.full(48, 1), np.full(48, 0.55)
    split = affordable_draft_lengths(lengths, rates, np.ones(1), model.curve_at(48))
    blind = StepCostModel()
    draining_batch(blind, told=False)
    by_tokens = affordable_draft_lengths(lengths, rates, np.ones(1), blind.curve_at(48))
    assert model.request_seconds > 0 and blind.request_seconds == 0
    assert split.sum() > 0.8 * lengths.sum() and by_tokens.sum() < 0.2 * lengths.sum()


@pytest.mark.parametrize("case", ["no drafts", "one request", "constant batch"])
def test_requests_are_not_split_from_tokens_where_they_never_varied_apart(case):
    """No drafts: as many requests as tokens; one request, or a full batch: the requests
    do not vary. A split fitted there would be noise."""
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for step in range(WINDOW):
        requests = {"no drafts": max(1, 64 - step // 8), "one request": 1,
                    "constant batch": 32}[case]
        drafts = 0 if case == "no drafts" else int(rng.integers(0, 8))
        model.add(requests + drafts, truth(requests, drafts) * rng.lognormal(0, 0.03),
                  requests)
    assert model.curve() is not None and model.request_seconds == 0


def test_a_requests_extra_cost_is_bounded_by_a_draft_tokens():
    """Steps whose time grows with the requests only (draft tokens look free): the
    extra is capped at ``MAX_REQUEST_EXTRA`` draft tokens, and draft tokens stay
    priced."""
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for step in range(WINDOW):
        requests, drafts = max(1, 64 - step // 8), int(rng.integers(0, 16))
        model.add(requests + drafts, 0.05 + 0.004 * requests + 1e-5 * drafts, requests)
    model.curve()
    assert 0 < model.request_seconds <= MAX_REQUEST_EXTRA * model.token_seconds + 1e-12


def test_the_replay_clock_prices_requests_and_draft_tokens_apart():
    import argparse

    from benchmarks.replay.loop import StepCost

    split = StepCost.parse("16,1.07,0.8")
    assert split(64 + 10, 64) == pytest.approx(0.016 + 0.00107 * 64 + 0.0008 * 10)
    assert "0.8 ms/draft token" in split.label
    same = StepCost.parse("16,1.07")
    assert same(74, 64) == same(74) == pytest.approx(0.016 + 0.00107 * 74)
    for bad in ("16", "16,1,1,1", "16,0,1", "16,1,0"):
        with pytest.raises(argparse.ArgumentTypeError, match="--step-cost"):
            StepCost.parse(bad)
