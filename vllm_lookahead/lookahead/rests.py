"""Requests whose drafts the cut keeps dropping whole rest from drafting a step or two,
in sampling classes where such a request's next draft is rarely kept.

Under load a draft token costs about a row of the step, and where the text is rarely
predicted (sampling at temperature 1.0) the cut keeps almost nothing: 16 MT-Bench
requests at T 1.0 on a 2-core CPU (SmolLM2-135M, run (ff)) kept 0.12 draft tokens a
step, while the sources and the cut ran for every request every step, half of the
proposer's 1.5 ms a step. So a request whose ``DROPS_BEFORE_REST``-th draft in a row
the cut dropped whole sits out the next step, after another the next two
(``MAX_REST_STEPS``), and so on; a draft the cut keeps any of ends the run. Its drafts
between rests are still checked in hindsight, so its estimates keep learning, and a
copied span that begins while it rests is drafted at most ``MAX_REST_STEPS`` steps
late.

Greedy text is different: there a draft dropped twice is often followed by one that is
kept (a match that grows), and with rests lookahead's S on 64 greedy MT-Bench first
turns, 16 at a time, fell from 1.24 to 1.12. So each sampling class counts how often a
request's draft after ``DROPS_BEFORE_REST`` whole drops was kept (decayed like the
cut's estimates), and its requests rest only while that is below ``KEPT_RATE_TO_REST``:
a rest saves a request's proposal (about 60 us on that CPU), and skips a kept draft
worth a few milliseconds at that rate. Replayed on a CPU-like clock (20 ms + 2.2 ms a
token) over the committed traces at 16 and 32 requests, requests rested in 35-55 % of
the request steps of the sampled and the greedy HumanEval / MT-Bench loads (in none of
Spec-Bench's: its drafts after two drops were kept), the simulated tokens/s moved by
-0.14 % to +0.2 %, and the proposer took 0.52 instead of 0.68 ms a step on the T 1.0
trace at 16 requests, 0.79 instead of 1.36 at 32.

Only in steps of at least ``MIN_REQUESTS`` requests: with 8 the T 1.0 trace lost 0.6 %
of its simulated tokens/s (a request's proposal costs little against its share of a
small step, and a copied span drafted late costs it whole steps). Only steps that are
cut rest requests (a filled step computes every slot anyway), and every
tensor-parallel rank cuts alike, so all rest the same requests.
"""

from __future__ import annotations

import numpy as np

from vllm_lookahead.lookahead.budget import NUM_SAMPLING_CLASSES, WORKER_DECAY
from vllm_lookahead.lookahead.state import RequestState

#: The longest rest, in steps.
MAX_REST_STEPS = 2
#: Fewest requests in a step for any of them to rest.
MIN_REQUESTS = 12
#: Drafts dropped whole in a row that send a request to its first rest.
DROPS_BEFORE_REST = 2
#: A sampling class rests its requests while fewer than this share of drafts proposed
#: after ``DROPS_BEFORE_REST`` whole drops are kept ...
KEPT_RATE_TO_REST = 0.05
#: ... smoothed by this many pseudo-drafts at half kept (no rests before evidence).
PRIOR_DRAFTS = 4.0


class DraftRests:
    """Which requests rest from drafting, step by step, and each sampling class's
    record of drafts proposed after repeated whole drops."""

    def __init__(self) -> None:
        self._proposed = np.zeros(NUM_SAMPLING_CLASSES)
        self._kept = np.zeros(NUM_SAMPLING_CLASSES)

    def take(self, states: list[RequestState]) -> np.ndarray:
        """Which requests rest this step (a step of each one's rest goes by); none in a
        step of fewer than ``MIN_REQUESTS``. Decays the classes' records."""
        self._proposed *= WORKER_DECAY
        self._kept *= WORKER_DECAY
        resting = np.zeros(len(states), dtype=bool)
        if len(states) < MIN_REQUESTS:
            return resting
        for b, state in enumerate(states):
            if state.rest_left:
                state.rest_left -= 1
                resting[b] = True
        return resting

    def settle(self, states: list[RequestState], proposed: list[int], kept: list[int],
               resting: np.ndarray) -> None:
        """After the cut: count each drafting request's proposed drafts dropped whole in
        a row (a kept token resets it); from ``DROPS_BEFORE_REST`` on, its class records
        whether the draft was kept, and where its class rests, the request rests, twice
        as long each time up to ``MAX_REST_STEPS``."""
        rest_classes = self.resting_classes()
        for state, num_proposed, num_kept, rested in zip(states, proposed, kept,
                                                         resting.tolist()):
            if rested or not num_proposed:
                continue
            if state.whole_drops >= DROPS_BEFORE_REST:
                self._proposed[state.sampling_class] += 1
                self._kept[state.sampling_class] += num_kept > 0
            state.whole_drops = 0 if num_kept else state.whole_drops + 1
            if state.whole_drops >= DROPS_BEFORE_REST and rest_classes[state.sampling_class]:
                state.rest_left = min(1 << (state.whole_drops - DROPS_BEFORE_REST),
                                      MAX_REST_STEPS)

    def resting_classes(self) -> np.ndarray:
        """The sampling classes whose requests rest after repeated whole drops."""
        rate = (self._kept + PRIOR_DRAFTS / 2) / (self._proposed + PRIOR_DRAFTS)
        return rate < KEPT_RATE_TO_REST
