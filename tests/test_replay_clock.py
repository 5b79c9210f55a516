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
    assert StepCost.parse("30,1.1")(10) == pytest.approx(0.041)
    same = StepCost.parse("16,1.07")
    assert same(74, 64) == same(74) == pytest.approx(0.016 + 0.00107 * 74)
    assert same.label == "16 ms + 1.07 ms/token (15 free tokens)"


@pytest.mark.parametrize("bad", ["30", "a,b", "30,0", "-1,2", "16,1,1,1", "16,1,0"])
def test_replay_step_cost_option_names_its_format(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="--step-cost"):
        StepCost.parse(bad)
