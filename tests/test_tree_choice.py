"""Trees ``auto``'s choice of step shape (``lookahead/tree_choice.py``): on made-up step
reports, then through the default proposer on a simulated clock (benchmarks/replay/,
trees verified along their longest matching path): no model, no wall-clock timing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import LookaheadReplayer
from vllm_lookahead.lookahead.tree_choice import (
    MAX_PROBE_INTERVAL,
    MIN_STEPS,
    PROBE_INTERVAL,
    PROBE_STEPS,
    TreeChoice,
    batch_bucket,
)

TRACE = (Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
         / "smollm2-135m-code-edit-reasoning.json")


def run(choice: TreeChoice, steps: int, tree_seconds: float, linear_seconds: float,
        tree_tokens: int, main_tokens: int, num_requests: int = 1) -> list[bool]:
    """``steps`` decode steps as the proposer reports them; the shapes chosen."""
    shapes = []
    for _ in range(steps):
        tree = choice.wanted(num_requests)
        shapes.append(tree)
        if tree:
            choice.add(num_requests, True, tree_seconds, tree_tokens, main_tokens)
        else:
            choice.add(num_requests, False, linear_seconds, main_tokens, main_tokens)
    return shapes


def test_both_shapes_are_tried_first_then_tokens_a_second_decide():
    # trees emit 2x their main drafts' tokens in 1.5x the time: trees
    choice = TreeChoice()
    shapes = run(choice, 2 * MIN_STEPS + 100, 1.5, 1.0, 4, 2)
    assert shapes[: 2 * MIN_STEPS] == [True, False] * MIN_STEPS  # alternating, trees first
    assert sum(shapes[2 * MIN_STEPS:]) > 90  # the losing shape only in probes
    # 1.2x the tokens in 1.5x the time: linear drafts
    shapes = run(TreeChoice(), 2 * MIN_STEPS + 100, 1.5, 1.0, 12, 10)
    assert sum(shapes[2 * MIN_STEPS:]) < 10
    # a tree step as fast as a linear one, however few tokens its branches add: trees
    shapes = run(TreeChoice(), 2 * MIN_STEPS + 100, 1.0, 1.0, 10, 10)
    assert sum(shapes[2 * MIN_STEPS:]) > 90


def test_the_losing_shape_is_retried_ever_less_often_until_the_workload_turns():
    choice = TreeChoice()
    shapes = run(choice, 2 * MIN_STEPS + 4000, 2.0, 1.0, 3, 2)
    probes = [n for n, tree in enumerate(shapes[2 * MIN_STEPS:]) if tree]
    starts = [n for n in probes if n - 1 not in probes]
    assert all(n + 1 in probes for n in starts)  # PROBE_STEPS each
    gaps = np.diff(starts)
    assert gaps[0] >= PROBE_INTERVAL and gaps.max() <= MAX_PROBE_INTERVAL + PROBE_STEPS
    assert (np.diff(gaps) >= 0).all() and len(probes) < 40
    # the text turns predictable for branches (3x the tokens): a probe finds it
    shapes = run(choice, 2 * MAX_PROBE_INTERVAL, 2.0, 1.0, 6, 2)
    assert shapes[-50:].count(True) > 45


def test_batch_sizes_are_chosen_apart():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == \
        [1, 2, 3, 4, 5, 5, 6, 6, 7, 8]
    choice = TreeChoice()
    alone = run(choice, 200, 1.1, 1.0, 3, 2, num_requests=1)  # trees pay alone
    loaded = run(choice, 200, 3.0, 1.0, 3, 2, num_requests=32)  # not under load
    assert sum(alone[-100:]) > 90 and sum(loaded[-100:]) < 10


def replayed(spec: dict, step_cost: StepCost) -> tuple[float, float]:
    """Simulated tokens/s of the committed trace at batch 1, and the share of decode
    steps that grew trees."""
    trace = [Request(**row) for row in json.loads(TRACE.read_text())]
    replayers = []

    def make():
        replayers.append(LookaheadReplayer(spec))
        return replayers[-1]

    tokens_per_second = summarize(trace, replay(make, trace, step_cost))["all"][2]
    stats = [replayer.proposer.stats for replayer in replayers]
    return tokens_per_second, sum(s.tree_steps for s in stats) / sum(s.steps for s in stats)


@pytest.mark.parametrize("step_cost, trees_pay", [
    (StepCost(0.010, 0.00001), True),  # a GPU at batch 1: extra tokens nearly free
    (StepCost(0.010, 0.0025), False),  # each token a quarter of the pass's fixed part
])
def test_the_defaults_keep_up_with_the_better_of_trees_forced_and_off(step_cost, trees_pay):
    auto, tree_share = replayed({"method": "lookahead"}, step_cost)
    forced, _ = replayed({"method": "lookahead", "trees": "on"}, step_cost)
    off, _ = replayed({"method": "lookahead", "trees": "off"}, step_cost)
    assert (forced > off) == trees_pay
    assert auto >= 0.97 * max(forced, off)
    assert (tree_share > 0.8) if trees_pay else (tree_share < 0.2)
