"""The cost-aware cut (``cost_aware_drafts``): a step's main drafts shortened to the
tokens its compute affords (``budget.py``), each token's acceptance estimated by its
calibration class and corrected by what such estimates were worth
(``calibration.py``); every draft is kept as proposed, cut or not, for
``hindsight.py``, and a debug line now and then explains the cut.

Estimates are learned from drafts checked against the text that followed, which a
request's next passes write: a burst of new requests drafts before any of its drafts
is checked. With 64 HumanEval requests starting together (SmolLM2-135M, replayed on
an exact clock, run (ct)), the first ten passes at 60 ms + 3.2 ms a token kept 826
draft tokens of 24-token copies of the prompts, estimated at 742, of which 467
matched; on clocks of 45-90 ms + 3.0-3.2 ms a token the wave ran at 0.86x-0.92x no
speculation. So a step keeps at most ``EXPOSURE_PER_CHECKED_TOKEN`` times the
kept tokens checked lately (the calibration's decayed counts), and never fewer than
``MIN_EXPOSURE`` tokens, its longest draft (one request alone is never held back) or
the tokens its cost line makes nearly free (a GPU's hundreds: there a burst costs
little): what the step verifies grows with the evidence behind its estimates."""

from __future__ import annotations

import logging
import math
import time

import numba
import numpy as np

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.budget import (
    ACCEPTED_TOKEN_WORTH,
    StepPlan,
    WorkerEstimates,
    any_token_affordable,
    cut_to_budget,
)
from vllm_lookahead.lookahead.calibration import calibrated
from vllm_lookahead.lookahead.sources.draft import Draft
from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.lookahead.step_cost import CostCurve, StepCostModel
from vllm_lookahead.metrics import ProposerStats

logger = get_logger(__name__)

#: Seconds between two debug lines explaining the cost-aware cut.
CUT_LOG_INTERVAL_S = 10.0
#: A step's kept draft tokens: at most this share of the kept tokens checked lately
#: (in hindsight, decayed like the estimates), ...
EXPOSURE_PER_CHECKED_TOKEN = 0.5
#: ... but always this many, or the step's longest draft or free tokens.
MIN_EXPOSURE = 32
#: A step offered to time its baseline drops its kept drafts if they raise its expected
#: tokens a second by less than this share (16 sampled requests on a 2-core CPU: their
#: verification cost 5 % of the step, ``step_cost.py``).
BASELINE_DOUBT = 0.1
#: The token classes of an empty draft (a resting request's, or the sources had none).
NO_CLASSES = np.zeros(0, dtype=np.int64)


class CostAwareCut:
    """Decides how many of each main draft's tokens the step verifies, by the worker's
    acceptance by depth (of the request's sampling class), the request's own first-token
    record and the step's cost curve."""

    def __init__(self, estimates: WorkerEstimates, cost_model: StepCostModel,
                 stats: ProposerStats):
        self._depth_acceptance = estimates.depth_acceptance
        self._calibrations = estimates.calibrations
        self._cost_model = cost_model
        self._stats = stats
        self._log = CutLog()
        # the last ``any_token_affordable`` answer, its curve and (requests, bound tokens)
        self._affordable_curve: object = None
        self._affordable_key = (0, 0)
        self._affordable = True
        # compiled before the first request
        _draft_estimates(np.zeros(1, dtype=np.int64), 1.0, np.ones((1, 1)), np.ones(1))
        cut_to_budget([[0]], [np.ones(1)], CostCurve.linear(1.0, 1.0))

    def may_keep_any(self, bounds: np.ndarray, plan: StepPlan) -> bool:
        """Whether the step may keep any draft token: not where its load makes every
        token cost more than it could save, were it certain to be accepted (64 requests
        a step on a 2-core CPU). Such a step is not drafted (counted): its sources, this
        cut and the hindsight checks would cost the step time for nothing, and a tree
        node, costing a token and accepted at most as surely, would not pay either."""
        if plan.fill or plan.step_cost is None or self._any_token_affordable(bounds, plan):
            return True
        self._stats.undrafted_steps += 1
        self._report(plan)
        return False

    def _any_token_affordable(self, bounds: np.ndarray, plan: StepPlan) -> bool:
        """``any_token_affordable``, asked again only when the cost curve (refitted every
        few steps), the request count or the bounds' sum changed: it prices every token
        count up to the sum, most of the proposer's time in a step of one request."""
        key = (len(bounds), int(np.sum(bounds)))
        if plan.step_cost is not self._affordable_curve or key != self._affordable_key:
            self._affordable = any_token_affordable(bounds, plan.step_cost)
            self._affordable_curve, self._affordable_key = plan.step_cost, key
        return self._affordable

    def apply(self, main: list[Draft], states: list[RequestState], num_tokens: np.ndarray,
              plan: StepPlan) -> None:
        """In a step that is cut (not filled, with a cost curve), estimate each draft
        token's acceptance and cut the drafts to the step's budget; keep every draft, as
        proposed, to check in hindsight."""
        classes = [draft.token_classes() if draft.tokens else NO_CLASSES for draft in main]
        proposed = [np.array(draft.tokens, dtype=np.int64) for draft in main]
        first_rates = {c: self._depth_acceptance[c].first_token_rates()
                       for c in {state.sampling_class for state in states}}
        first_estimates = [  # an empty draft has no first token to estimate
            float(first_rates[state.sampling_class][token_classes[0]])
            if len(token_classes) else 0.0
            for state, token_classes in zip(states, classes)]
        kept_estimates: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(main)
        if not plan.fill and plan.step_cost is not None:
            estimates = self._estimates(classes, first_estimates, states)
            fitted = [fitted for _, fitted in estimates]
            self._stats.cut_tokens += cut_to_budget([draft.tokens for draft in main], fitted,
                                                    plan.step_cost, self._exposure(main, plan))
            if plan.time_baseline and self._timing_baseline(main, fitted, plan):
                self._stats.cut_tokens += sum(len(draft.tokens) for draft in main)
                for draft in main:
                    del draft.tokens[:]
            kept_estimates = [(raw[: len(draft.tokens)], fitted[: len(draft.tokens)])
                              for (raw, fitted), draft in zip(estimates, main)]
        for b, state in enumerate(states):
            state.hindsight.propose(int(num_tokens[b]), proposed[b], classes[b],
                                    len(main[b].tokens), state.max_draft, first_estimates[b],
                                    kept_estimates[b])
        self._report(plan)

    def _timing_baseline(self, main: list[Draft], fitted: list[np.ndarray],
                         plan: StepPlan) -> bool:
        """Whether the step drops its kept drafts to time its requests' baseline (the
        planner offers it while none was timed lately): only where they raise its
        expected tokens a second by less than ``BASELINE_DOUBT``, which a verification
        cost the curve cannot see may undo; a step drafting copies keeps them. Counted."""
        kept = [estimate[: len(draft.tokens)] for draft, estimate in zip(main, fitted)]
        if not any(len(estimate) for estimate in kept) or (
                expected_rate_gain(kept, plan.step_cost) >= 1 + BASELINE_DOUBT):
            return False
        self._stats.baseline_steps += 1
        return True

    def _report(self, plan: StepPlan) -> None:
        """The step's free tokens into the counters; the debug line when one is due."""
        self._stats.free_tokens = math.inf if plan.free_tokens is None else plan.free_tokens
        self._log.maybe_log(self._stats, self._cost_model)

    def _exposure(self, main: list[Draft], plan: StepPlan) -> int:
        """The most draft tokens the step may keep, by the evidence its estimates rest
        on: the kept tokens checked lately, of every sampling class (each rank counts
        the same, from the same text; the free tokens are the first rank's)."""
        checked = sum(float(calibration.tokens.sum()) for calibration in self._calibrations)
        longest = max((len(draft.tokens) for draft in main), default=0)
        free = int(min(plan.free_tokens or 0.0, 1 << 30))
        return max(MIN_EXPOSURE, longest, free, int(EXPOSURE_PER_CHECKED_TOKEN * checked))

    def _estimates(self, classes: list[np.ndarray], first_estimates: list[float],
                   states: list[RequestState]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each draft token's acceptance, by calibration class (its source and support
        bin): the first token's by the worker's ``first_estimates`` scaled by its
        request's own record, the later ones by the acceptance by depth of tokens of the
        same classes, among requests of the same sampling class; before and after
        ``calibration.py`` corrects the product."""
        by_class = {c: (self._depth_acceptance[c].conditional_rates(),
                        self._calibrations[c].factors())
                    for c in {state.sampling_class for state in states}}
        return [_draft_estimates(token_classes, state.first_token_rate(estimate),
                                 *by_class[state.sampling_class])
                if len(token_classes) else (np.zeros(0), np.zeros(0))
                for state, token_classes, estimate in zip(states, classes, first_estimates)]


def expected_rate_gain(kept: list[np.ndarray], step_cost: CostCurve) -> float:
    """The step's expected tokens a second with the kept draft tokens (each request's
    estimates) over without any, by ``step_cost`` and ``ACCEPTED_TOKEN_WORTH``."""
    requests, tokens = len(kept), sum(len(estimate) for estimate in kept)
    expected = requests + ACCEPTED_TOKEN_WORTH * sum(float(np.sum(e)) for e in kept)
    seconds = step_cost(np.array([requests, requests + tokens], dtype=np.float64))
    return expected * seconds[0] / (requests * seconds[1]) if seconds[1] > 0 else math.inf


@numba.njit(cache=True, nogil=True)
def _draft_estimates(classes, first_rate, rates, factors):
    """``first_rate`` times the survival along the draft's token classes by the
    conditional ``rates`` (``budget.survival_along``), before and after ``calibrated``
    by ``factors`` (compiled: every draft of every step)."""
    raw = np.empty(len(classes))
    survival = 1.0
    for j in range(len(classes)):
        survival *= rates[classes[j], j]
        raw[j] = first_rate * survival
    return raw, calibrated(raw, factors)


class CutLog:
    """A debug line every ``CUT_LOG_INTERVAL_S`` explaining the cost-aware cut: the
    fitted step cost, the tokens it makes free, and what was proposed, cut, and cut
    although the generated text then matched it."""

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._last: tuple[int, int, int] = (0, 0, 0)

    def maybe_log(self, stats: ProposerStats, cost_model: StepCostModel) -> None:
        now = time.monotonic()
        if now - self._last_time < CUT_LOG_INTERVAL_S or not logger.isEnabledFor(logging.DEBUG):
            return
        totals = (stats.draft_tokens + stats.cut_tokens, stats.cut_tokens,
                  stats.cut_tokens_confirmed)
        proposed, cut, confirmed = (a - b for a, b in zip(totals, self._last))
        elapsed, self._last_time, self._last = now - self._last_time, now, totals
        logger.debug(
            "vllm-lookahead cut: step = %.3f ms + %.4f ms/token (free tokens %.1f); "
            "last %.0f s: %d draft tokens proposed, %d cut, %d of those matched later",
            cost_model.fixed_seconds * 1e3, cost_model.token_seconds * 1e3,
            stats.free_tokens, elapsed, proposed, cut, confirmed)
