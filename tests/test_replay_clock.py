"""The replay's simulated clock (``benchmarks.replay.loop.StepCost``): a request's own
token and a draft token priced apart, as a step on a real engine prices them."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.replay.loop import StepCost


def test_the_replay_clock_prices_requests_and_draft_tokens_apart():
    split = StepCost.parse("16,1.07,0.8")
    assert split(64 + 10, 64) == pytest.approx(0.016 + 0.00107 * 64 + 0.0008 * 10)
    assert "0.8 ms/draft token" in split.label
    same = StepCost.parse("16,1.07")
    assert same(74, 64) == same(74) == pytest.approx(0.016 + 0.00107 * 74)
    assert same.label == "16 ms + 1.07 ms/token (15 free tokens)"


@pytest.mark.parametrize("bad", ["16", "16,1,1,1", "16,0,1", "16,1,0", "-1,1", "a,b"])
def test_the_replay_clock_names_its_bad_step_cost(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="--step-cost"):
        StepCost.parse(bad)
