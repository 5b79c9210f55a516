"""Requests whose drafts the cut keeps dropping whole rest from drafting a step or two.

Under load a draft token costs about a row of the step, and where the text is rarely
predicted (sampling at temperature 1.0) the cut keeps almost nothing: 16 MT-Bench
requests at T 1.0 on a 2-core CPU (SmolLM2-135M, run (ff)) kept 0.12 draft tokens a
step, while the sources and the cut ran for every request every step, half of the
proposer's 1.5 ms a step. So a request whose ``DROPS_BEFORE_REST``-th draft in a row
the cut dropped whole sits out the next step, after another the next two
(``MAX_REST_STEPS``), and so on; a draft the cut keeps any of ends the run. Its drafts
between rests are still checked in hindsight, so its estimates keep learning, and a
copied span that begins while it rests is drafted at most ``MAX_REST_STEPS`` steps
late. Replayed on a CPU-like clock (20 ms + 2.2 ms a token) with the committed traces,
rests skipped the sources for 22-57 % of the request steps at 12-32 requests and
changed the simulated tokens/s by -0.9 % to +0.7 % (the proposer's own time, which they
save, is not on that clock); four rests at most lost a copying request 11 % of its S among 15
unpredictable ones, two 5 %.

Only in steps of at least ``MIN_REQUESTS`` requests: with 8, the same replays lost
0.3-1.3 %, more than the proposer time saved there (a request's proposal costs little
against its share of a small step, and a copied span drafted late costs it whole
steps). Only steps that are cut rest requests (a filled step computes every slot
anyway), and every tensor-parallel rank cuts alike, so all rest the same requests.
"""

from __future__ import annotations

import numpy as np

from vllm_lookahead.lookahead.state import RequestState

#: The longest rest, in steps.
MAX_REST_STEPS = 2
#: Fewest requests in a step for any of them to rest.
MIN_REQUESTS = 12
#: Drafts dropped whole in a row that send a request to its first rest.
DROPS_BEFORE_REST = 2


def take_rests(states: list[RequestState]) -> np.ndarray:
    """Which requests rest this step (a step of each one's rest goes by); none in a
    step of fewer than ``MIN_REQUESTS``."""
    resting = np.zeros(len(states), dtype=bool)
    if len(states) < MIN_REQUESTS:
        return resting
    for b, state in enumerate(states):
        if state.rest_left:
            state.rest_left -= 1
            resting[b] = True
    return resting


def settle_rests(states: list[RequestState], proposed: list[int], kept: list[int],
                 resting: np.ndarray) -> None:
    """After the cut: count each drafting request's proposed drafts dropped whole in a
    row (a kept token resets it), and from the second on send it to rest, twice as long
    each time up to ``MAX_REST_STEPS``."""
    for state, num_proposed, num_kept, rested in zip(states, proposed, kept,
                                                     resting.tolist()):
        if rested or not num_proposed:
            continue
        state.whole_drops = 0 if num_kept else state.whole_drops + 1
        if state.whole_drops >= DROPS_BEFORE_REST:
            state.rest_left = min(1 << (state.whole_drops - DROPS_BEFORE_REST), MAX_REST_STEPS)
