"""Requests whose drafts the cut keeps dropping whole rest from drafting
(``lookahead/rests.py``), replayed on a simulated clock: no model, no wall-clock
timing."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.replay.loop import Request, replay
from benchmarks.replay.replayers import LookaheadReplayer
from test_cost_aware_cut import CHEAP, DEFAULT, EXPENSIVE, noise, synthetic_requests
from vllm_lookahead.lookahead import rests, step_cost
from vllm_lookahead.lookahead.state import RequestState


def drafted_rows(batch_size: int, requests: list[Request], step_cost=EXPENSIVE):
    """Replay ``requests`` ``batch_size`` at a time; the proposer's counters, the rows
    the sources were asked to draft over all steps, and (tokens, passes) per request."""
    replayer = LookaheadReplayer(DEFAULT, batch_size)
    sources = replayer.proposer._sources
    draft = sources.draft
    asked: list[int] = []
    sources.draft = lambda *args: asked.append(len(args[0])) or draft(*args)
    results = replay(lambda: replayer, requests, step_cost)
    return replayer.proposer.stats, sum(asked), [(tokens, passes)
                                                 for tokens, passes, _, _ in results]


def load(copying: bool) -> list[Request]:
    """16 requests on rarely predictable text, and with ``copying`` one of them
    copying an edited function out of its prompt instead."""
    rng = np.random.default_rng(1)
    requests = [Request("s", "noise", noise(rng, 50), noise(rng, 200)) for _ in range(16)]
    if copying:
        requests[0] = synthetic_requests()["copy"]
    return requests


def test_requests_rarely_predicted_under_load_rest_from_drafting():
    """Under load whose drafts the cut drops nearly always, the sources are asked for
    a fraction of the requests' steps (each asked for every step without rests)."""
    stats, asked, _ = drafted_rows(16, load(copying=False))
    assert stats.resting_drafts > 0.5 * stats.request_passes
    assert asked + stats.resting_drafts == stats.request_passes
    assert asked < 0.5 * stats.request_passes


def test_a_copied_span_under_load_is_drafted_long_despite_rests(monkeypatch):
    """The copying request among rarely predicted ones keeps nearly all its compression
    (it rests through its free text, then drafts the copy: at most ``MAX_REST_STEPS``
    late); the others rest. Rests of up to 4 steps lost it 11 % of its S."""
    copying = {}
    for rest_steps in (0, rests.MAX_REST_STEPS):
        monkeypatch.setattr(rests, "MAX_REST_STEPS", rest_steps)
        stats, _, results = drafted_rows(16, load(copying=True), CHEAP)
        tokens, passes = results[0]
        copying[rest_steps] = tokens / passes
        assert (stats.resting_drafts > 0) == bool(rest_steps)
    assert copying[0] > 2.5
    assert copying[rests.MAX_REST_STEPS] >= 0.92 * copying[0]


def test_a_few_requests_never_rest(monkeypatch):
    """Below ``rests.MIN_REQUESTS`` a request's proposal costs little against its share
    of the step, and a copied span drafted late costs it whole steps (no step left
    undrafted to time its baseline here: every pass is asked)."""
    monkeypatch.setattr(step_cost, "BASELINE_INTERVAL", 1 << 30)
    stats, asked, _ = drafted_rows(rests.MIN_REQUESTS - 1, load(copying=False))
    assert stats.resting_drafts == 0 and asked == stats.request_passes


@pytest.mark.parametrize("kept_every", [0, 3], ids=["never-kept", "kept-after-two-drops"])
def test_a_sampling_class_rests_only_where_drafts_after_whole_drops_stay_dropped(kept_every):
    """16 requests of one class proposing every step they do not rest: where every draft
    is dropped whole they rest; where every third is kept (a greedy text's growing
    match), a draft after two whole drops is kept, and the class does not rest."""
    draft_rests = rests.DraftRests()
    states = [RequestState(None, 0, 0) for _ in range(16)]
    resting_steps = 0
    for step in range(200):
        resting = draft_rests.take(states)
        resting_steps += int(resting.sum())
        kept = [5 if kept_every and (step + b) % kept_every == 0 else 0
                for b in range(len(states))]
        draft_rests.settle(states, [5] * len(states), kept, resting)
    assert draft_rests.resting_classes()[0] == (kept_every == 0)
    if kept_every:
        assert resting_steps < 0.05 * 200 * len(states)  # only while evidence came in
    else:
        assert resting_steps > 0.4 * 200 * len(states)
