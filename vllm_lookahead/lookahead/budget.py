"""Draft budget under load: keep only the draft tokens that pay for their compute.

Every draft token is computed by the target. At batch size 1 a forward pass costs
nearly the same for 1 or 20 tokens, so a draft token that is rarely accepted is
still worth proposing; with 32 requests in the batch the pass is compute-bound and
every token adds to its time. The proposer therefore measures the step time by its
token count online (``step_cost.py``), estimates each draft token's acceptance from
what verification accepted (``AcceptanceByDepth``), and keeps the draft tokens that
raise the expected tokens per second of the whole step (``affordable_draft_lengths``).
"""

from __future__ import annotations

import bisect
import math
from typing import Any, NamedTuple

import numba
import numpy as np

from vllm_lookahead.lookahead.calibration import AcceptanceCalibration
from vllm_lookahead.lookahead.step_cost import CostCurve

#: Pseudo-verifications behind each acceptance-by-depth estimate.
PRIOR_WEIGHT = 2.0
#: Per-step decay of the worker-wide acceptance counts (about the last 100
#: verifications count).
WORKER_DECAY = 0.99
#: Acceptance at the second position before any verification.
PRIOR_DEPTH_RATE = 0.5
#: Acceptance of first draft tokens before any draft was checked.
PRIOR_FIRST_RATE = 0.5
#: Sampling classes (``sampling_class``): greedy, then temperature up to 0.5, up to 1
#: and above, each with top-p up to 0.9 or above it.
TEMPERATURE_EDGES = (0.5, 1.0)
TOP_P_EDGE = 0.9
NUM_SAMPLING_CLASSES = 1 + 2 * (len(TEMPERATURE_EDGES) + 1)
#: What the cut counts an accepted draft token as saving, as a share of its request's
#: part of a step. The whole part only where another request takes the place a request
#: frees by finishing early (a queue, a closed-loop client with more to send); in a batch
#: that drains, a request that finishes a step early saves only its own row of one later
#: step. Replayed at batch 1-64 on the 2-core CPU's measured step cost and on a GPU-like
#: one (run (dh)), 0.8 kept batch 1-32 within 0.02x of 1.0's gain and took 64 requests
#: from 0.98x / 0.97x no speculation to 1.00x / 0.99x.
ACCEPTED_TOKEN_WORTH = 0.8


class StepPlan(NamedTuple):
    """What a step affords, as the first tensor-parallel rank timed it (every rank then
    drafts the same tokens and trees): the tokens it computes nearly free by the cost
    line (inf without ``cost_aware_drafts``, None before the cost model has an
    estimate), its cost curve from its requests' baseline (for the cut; None: nothing
    is cut), whether its drafts are filled to K (``uniform_drafts.py``), whether it
    may drop them to time that baseline (``step_cost.StepCostModel.wants_baseline``;
    where they gain little, ``cut.py``) and whether it grows trees
    (``tree_switch.py``)."""

    free_tokens: float | None
    step_cost: CostCurve | None
    fill: bool
    time_baseline: bool = False
    trees: bool = False


def sampling_class(params: Any) -> int:
    """The request's sampling class, by its ``SamplingParams`` (None: greedy).

    Under sampling a point-mass draft token is accepted with the target's probability
    of it, so a request sampled at T = 1 accepts far fewer tokens than the same text
    decoded greedily. The worker-wide estimates (acceptance by depth, its calibration)
    are kept per class, so that greedy and sampled requests in one batch do not set each
    other's draft budgets; within a class, each request's own first-token rate adapts.
    """
    temperature = getattr(params, "temperature", 0.0) or 0.0
    if temperature <= 0:
        return 0
    by_temperature = bisect.bisect_left(TEMPERATURE_EDGES, temperature)
    return 1 + 2 * by_temperature + int(getattr(params, "top_p", 1.0) > TOP_P_EDGE)


class AcceptanceByDepth:
    """Worker-wide acceptance by draft position and by the calibration class of each
    draft token, for one sampling class, from recent drafts checked in hindsight
    (``hindsight.py``: every proposed draft, also the tokens the cut dropped).

    Acceptance is far from geometric: a draft whose first tokens were right (a copied
    span) tends to stay right, so deep tokens are conditioned on the ones before them,
    per position. And it differs by source: a token the context's own repeat drafted is
    accepted several times as often as one the n-gram pool guessed; within a source, by
    how well the source supported it (``sources/support.py``). So each class (a source
    and a support bin) has its rates, and a draft's estimate follows the classes of its
    tokens. Classes come in groups of ``group_size`` (a source's bins): a class seen
    rarely is smoothed towards its group's rate, the group towards the prior.
    """

    def __init__(self, max_depth: int, num_classes: int = 1, decay: float = WORKER_DECAY,
                 group_size: int = 1):
        if num_classes % group_size:
            raise ValueError(f"{num_classes} classes do not split into groups of {group_size}")
        # drafts checked at position j whose token there was of class s, and those
        # right there
        self._reached = np.zeros((num_classes, max_depth))
        self._accepted = np.zeros((num_classes, max_depth))
        self._decay = decay
        self._group_size = group_size
        self._empty = True  # nothing counted yet: nothing to decay

    def decay(self) -> None:
        """Once per step: older evidence counts less (a sampling class no request has
        used skips it: zeros stay zeros, and a step has ``NUM_SAMPLING_CLASSES``)."""
        if not self._empty:
            self._reached *= self._decay
            self._accepted *= self._decay

    def add(self, first: int, compared: int, confirmed: int,
            classes: np.ndarray | None = None) -> None:
        """Draft positions ``[first, first + compared)`` were checked against the text
        that followed, and the first ``confirmed`` of them were right; ``classes``: the
        class of each of the draft's tokens (all class 0 if None)."""
        if classes is None:
            classes = np.zeros(first + compared, dtype=np.int64)
        self._empty = self._empty and not compared
        _count_checked(self._reached, self._accepted, classes, first, compared, confirmed)

    def first_token_rate(self, token_class: int | None = None) -> float:
        """Acceptance of first draft tokens (of class ``token_class``, or of any): what
        each request's own record scales (smoothed towards its group's rate, the group's
        towards ``PRIOR_FIRST_RATE``)."""
        if token_class is None:
            return _smoothed(self._accepted[:, 0].sum(), self._reached[:, 0].sum(),
                             PRIOR_FIRST_RATE)
        return float(self.first_token_rates()[token_class])

    def first_token_rates(self) -> np.ndarray:
        """``first_token_rate`` of every class (once a step, for the whole batch)."""
        size = self._group_size
        accepted, reached = self._accepted[:, 0], self._reached[:, 0]
        groups = _smoothed(accepted.reshape(-1, size).sum(axis=1),
                           reached.reshape(-1, size).sum(axis=1), PRIOR_FIRST_RATE)
        return groups if size == 1 else _smoothed(accepted, reached, np.repeat(groups, size))

    def conditional_rates(self) -> np.ndarray:
        """``[s, j]``: P(token j+1 accepted | the tokens before it were), for a token of
        class s (column 0 is 1: the first token's rate is ``first_token_rate``, scaled
        by the request's own record). Deep positions are reached rarely: each group's
        rate is smoothed towards the group's rate at the position before
        (``PRIOR_WEIGHT`` pseudo-verifications), not towards a constant, which would
        compound into a vanishing estimate for long copied spans; each class's rate
        towards its group's at the same position."""
        return _grouped_depth_rates(self._accepted, self._reached, self._group_size,
                                    PRIOR_DEPTH_RATE, PRIOR_WEIGHT)

    def survival(self, classes: np.ndarray | None = None) -> np.ndarray:
        """P(token j accepted | token 1 accepted) at index j-1, for a draft whose tokens
        are of ``classes`` (class 0 throughout, all positions, if None)."""
        rates = self.conditional_rates()
        return survival_along(rates, np.zeros(rates.shape[1], dtype=np.int64)
                              if classes is None else classes)


@numba.njit(cache=True, nogil=True)
def _count_checked(reached, accepted, classes, first, compared, confirmed):
    """``AcceptanceByDepth.add`` (compiled: it runs for every draft settled in a step,
    dozens a step under load, where numpy's indexed adds cost microseconds each)."""
    for j in range(first, first + compared):
        reached[classes[j], j] += 1.0
        if j < first + confirmed:
            accepted[classes[j], j] += 1.0


@numba.njit(cache=True, nogil=True)
def _grouped_depth_rates(accepted, reached, group_size, prior_rate, prior_weight):
    """``AcceptanceByDepth.conditional_rates`` (compiled: it runs every step, a
    recurrence over the depths of every class)."""
    num_classes, depth = accepted.shape
    rates = np.ones((num_classes, depth))
    for group in range(0, num_classes, group_size):
        rate = prior_rate
        for j in range(1, depth):
            group_accepted, group_reached = 0.0, 0.0
            for s in range(group, group + group_size):
                group_accepted += accepted[s, j]
                group_reached += reached[s, j]
            rate = (group_accepted + prior_weight * rate) / (group_reached + prior_weight)
            for s in range(group, group + group_size):
                rates[s, j] = rate if group_size == 1 else (
                    (accepted[s, j] + prior_weight * rate) / (reached[s, j] + prior_weight))
    return rates


def _smoothed(accepted, reached, prior):
    """``accepted / reached`` with ``PRIOR_WEIGHT`` pseudo-verifications at ``prior``."""
    return (accepted + PRIOR_WEIGHT * prior) / (reached + PRIOR_WEIGHT)


def survival_along(rates: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``AcceptanceByDepth.survival`` from its ``conditional_rates`` (the cut computes
    the same, compiled, in ``cut._draft_estimates``)."""
    return np.cumprod(rates[classes, np.arange(len(classes))])


class WorkerEstimates:
    """The worker's estimates by sampling class (``sampling_class``): acceptance by
    depth of ``num_classes`` calibration classes in groups of ``group_size`` and the
    calibration of the estimates they give (learned in hindsight, read by the cut)."""

    def __init__(self, max_depth: int, num_classes: int, group_size: int):
        self.depth_acceptance = [AcceptanceByDepth(max_depth, num_classes,
                                                   group_size=group_size)
                                 for _ in range(NUM_SAMPLING_CLASSES)]
        self.calibrations = [AcceptanceCalibration(WORKER_DECAY)
                             for _ in range(NUM_SAMPLING_CLASSES)]
        # compiled before the first request
        self.depth_acceptance[0].conditional_rates()
        self.depth_acceptance[0].add(0, 0, 0)
        self.calibrations[0].add(np.zeros(0), np.zeros(0, dtype=bool))

    def decay(self) -> None:
        """Once per step: older evidence of acceptance counts less."""
        for depth_acceptance, calibration in zip(self.depth_acceptance, self.calibrations):
            depth_acceptance.decay()
            calibration.decay()


def affordable_draft_lengths(
    lengths: np.ndarray, first_rates: np.ndarray, survival: np.ndarray, step_cost: CostCurve,
    max_kept: int | None = None, worth: float = 1.0,
) -> np.ndarray:
    """How many leading tokens of each request's draft to keep, at most ``max_kept`` in
    all (the most probable ones).

    Request r's j-th draft token is accepted with probability
    ``first_rates[r] * survival[r, j-1]`` (its own recent first-token acceptance, and
    the worker's acceptance by depth for its sampling class; one ``survival`` row
    serves all requests). Keeping k tokens, the best k are the most probable ones (a
    prefix of each draft: probabilities do not rise along a draft); the step then
    yields E(k) = requests + ``worth`` x their probabilities' sum in
    ``step_cost(requests + k)``, and the k with the most expected tokens per second is
    kept (the largest on a tie).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    survival = np.asarray(survival, dtype=np.float64)
    survival = np.array(np.broadcast_to(survival, (len(lengths), survival.shape[-1])))
    return _kept_lengths(lengths, np.asarray(first_rates, dtype=np.float64), survival,
                         step_cost.tokens, step_cost.seconds, step_cost.slope,
                         -1 if max_kept is None else max_kept, worth)


@numba.njit(cache=True, nogil=True)
def _kept_lengths(lengths, first_rates, survival, knots, knot_seconds, slope, max_kept,
                  worth):
    """``affordable_draft_lengths`` (compiled: it runs every step, and in numpy a step of
    one request paid a dozen calls' overhead for a few tokens); ``max_kept`` -1: none."""
    num_requests, total = len(lengths), lengths.sum()
    if total == 0:
        return lengths.copy()
    prob, owner = np.empty(total), np.empty(total, dtype=np.int64)
    i = 0
    for r in range(num_requests):
        for j in range(lengths[r]):
            prob[i], owner[i] = first_rates[r] * survival[r, j], r
            i += 1
    order = np.argsort(-prob, kind="mergesort")  # stable: ties by request, then depth
    counts = num_requests + np.arange(total + 1).astype(np.float64)
    expected = np.empty(total + 1)
    expected[0] = num_requests
    for k in range(total):
        expected[k + 1] = expected[k] + worth * prob[order[k]]
    kept = _best_count(expected, _curve_seconds(counts, knots, knot_seconds, slope))
    if kept < 0:  # the tokens look free: keep them all
        return lengths.copy()
    if max_kept >= 0:
        kept = min(kept, max_kept)
    out = np.zeros(num_requests, dtype=np.int64)
    for k in range(kept):
        out[owner[order[k]]] += 1
    return out


@numba.njit(cache=True, nogil=True)
def _curve_seconds(counts, knots, knot_seconds, slope):
    """``step_cost.CostCurve``'s seconds at ``counts`` tokens (its ``__call__``)."""
    inside = np.interp(counts, knots, knot_seconds)
    outside = np.minimum(counts - knots[0], 0.0) + np.maximum(counts - knots[-1], 0.0)
    return np.maximum(inside + outside * slope, 0.0)


@numba.njit(cache=True, nogil=True)
def _best_count(expected, seconds):
    """The count of kept tokens (an index of ``expected`` tokens in ``seconds``) with
    the most expected tokens a second, the largest on a tie; -1 where the tokens look
    free."""
    if not seconds[-1] > seconds[0]:
        return -1
    rate = expected / np.maximum(seconds, 1e-12)
    return int(np.flatnonzero(rate >= rate.max() * (1 - 1e-12))[-1])


def any_token_affordable(bounds: np.ndarray, step_cost: CostCurve) -> bool:
    """Whether ``cut_to_budget`` could keep any token of drafts of up to ``bounds``
    tokens: whether it keeps some of them were each certain to be accepted (their
    expected tokens then the count itself: no sort). Where it would keep none of those,
    it keeps none of any draft: every estimate is at most 1."""
    num_requests, total = len(bounds), int(np.sum(bounds))
    if not total:
        return False
    counts = np.arange(total + 1, dtype=np.float64)
    kept = _best_count(num_requests + ACCEPTED_TOKEN_WORTH * counts,
                       step_cost(num_requests + counts))
    return kept != 0


def cut_to_budget(drafts: list[list[int]], estimates: list[np.ndarray],
                  step_cost: CostCurve, max_kept: int | None = None) -> int:
    """Shorten drafts (in place) to the tokens the step's compute affords, by each
    token's estimated acceptance (non-increasing along each draft) and what an accepted
    token is worth (``ACCEPTED_TOKEN_WORTH``), at most ``max_kept`` in all; returns the
    tokens cut."""
    lengths = np.array([len(draft) for draft in drafts])
    padded = np.zeros((len(drafts), max(1, int(lengths.max(initial=0)))))
    for b, estimate in enumerate(estimates):
        padded[b, : len(estimate)] = estimate
    kept = affordable_draft_lengths(lengths, np.ones(len(drafts)), padded, step_cost,
                                    max_kept, ACCEPTED_TOKEN_WORTH)
    cut = 0
    for draft, keep in zip(drafts, kept.tolist()):
        cut += len(draft) - keep
        del draft[keep:]
    return cut
