"""What a step costs by its token count, timed online.

The proposer times each decode step against the tokens it scheduled. The time is not
a line in the token count: kernels pick tile sizes and code paths by the number of rows
(on a 2-core AVX2 CPU a step with 4 draft tokens cost 15 % more than one without, with
8 tokens 44 %; CUDA graphs pad a batch to the next captured size), so the cut reads a
curve through each token count's quiet time (``CostCurve``). A line fitted to the same
points summarizes it (``StepCostModel.free_tokens``) for the tree budget and the
metrics.

A step that verifies drafts also pays for the verification (vLLM's rejection sampler
and its metadata, the proposer's bookkeeping), so the curve is drawn through drafted
steps, and not drafting is priced by steps timed without drafts at the same request
count (``StepCostModel.baseline``). With both on one curve by token count, 16 sampled
requests on a 2-core CPU (SmolLM2-135M, T 0.7, top-p 0.95) drafted in every step: no
step of 16 tokens was ever timed and the curve took one draft token as free, while a
step verifying one cost 73 ms at its lower quartile and one without drafts 68 ms (the
same load with drafting off; vLLM's verification took 2.5-3.5 ms of it, a further draft
token 1.7 ms: run (fu)). Where a request count has no recent baseline, a step now and then whose drafts
gain little drops them to time one (``cut.py``).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

#: Passes timed before the fit is trusted; until then no draft is cut.
MIN_SAMPLES = 32
#: Recent passes the fit uses (older ones are overwritten).
WINDOW = 512
#: Passes between two fits.
REFIT_INTERVAL = 16
#: The quantile of a token count's pass times that the fit uses (the quiet passes).
QUIET_QUANTILE = 0.25
#: A request count's baseline (its steps without drafts): the quiet time of its last
#: ``BASELINE_MEMORY`` such steps, once ``MIN_BASELINE_TIMES`` of them are among the last
#: ``BASELINE_WINDOW`` timed steps (contexts grow, the machine's load changes) ...
BASELINE_MEMORY = 16
MIN_BASELINE_TIMES = 4
BASELINE_WINDOW = 2048
#: ... and until then, at most every ``BASELINE_INTERVAL``-th step may drop its drafts.
BASELINE_INTERVAL = 8


@dataclass(frozen=True)
class CostCurve:
    """A step's seconds by its token count: straight between the ``tokens`` knots,
    ``slope`` a token beyond them (a line's: under load the fewest tokens timed may be
    well above the step's own decode tokens, which must not look free)."""

    tokens: np.ndarray  # increasing token counts
    seconds: np.ndarray  # not decreasing
    slope: float

    @classmethod
    def linear(cls, fixed_seconds: float, token_seconds: float) -> CostCurve:
        """t = fixed_seconds + token_seconds n."""
        return cls(np.zeros(1), np.array([max(fixed_seconds, 0.0)]), max(token_seconds, 0.0))

    def __call__(self, num_tokens: np.ndarray) -> np.ndarray:
        n = np.asarray(num_tokens, dtype=np.float64)
        inside = np.interp(n, self.tokens, self.seconds)
        outside = np.minimum(n - self.tokens[0], 0) + np.maximum(n - self.tokens[-1], 0)
        return np.maximum(inside + outside * self.slope, 0.0)

    def extended_by(self, shape: CostCurve) -> CostCurve:
        """This curve, continued past its last knot by the rises of ``shape`` (the
        start-up measurement's, where the online passes never went), and beyond both by
        ``shape``'s slope (an average over more tokens than a batch of one times)."""
        last = self.tokens[-1]
        beyond = shape.tokens > last
        tokens = np.concatenate((self.tokens, shape.tokens[beyond]))
        rise = shape(shape.tokens[beyond]) - shape(np.array([last]))
        return CostCurve(tokens, np.concatenate((self.seconds, self.seconds[-1] + rise)),
                         shape.slope)

    def from_baseline(self, num_requests: int, baseline: float) -> CostCurve:
        """This (drafted steps') curve for a step of ``num_requests``, whose step without
        drafts costs ``baseline`` (timed; a draft token never taken as saving time)."""
        first = float(self(np.array([num_requests + 1]))[0])
        later = self.tokens > num_requests + 1
        return CostCurve(np.concatenate(([num_requests, num_requests + 1], self.tokens[later])),
                         np.concatenate(([min(baseline, first), first], self.seconds[later])),
                         self.slope)


class StepCostModel:
    """A step's seconds by its scheduled tokens (a curve, and a line fitted to the
    same points), robust to passes that something else on the machine slowed down."""

    def __init__(self, window: int = WINDOW):
        self._tokens = np.zeros(window)
        self._seconds = np.zeros(window)
        self._drafted = np.zeros(window, dtype=bool)
        self._count = 0
        # request count -> its last undrafted steps' (timed step's index, seconds)
        self._baselines: dict[int, collections.deque] = {}
        self._baseline_asked = 0
        self._step_curve: tuple[tuple, CostCurve | None] = ((None, 0, None), None)
        self._fitted_at = 0
        self._prior = (math.nan, math.nan)  # (fixed, per token) measured at start-up
        self._prior_curve: CostCurve | None = None
        #: the last fit, t = fixed_seconds + token_seconds * n, or where there is none
        #: (yet) the start-up measurement (nan: neither)
        self.fixed_seconds = math.nan
        self.token_seconds = math.nan
        self._curve: CostCurve | None = None

    def add(self, num_tokens: int, seconds: float, num_requests: int = 0) -> None:
        """A decode step's time; one of ``num_requests`` computing no more tokens is a
        baseline (0: not told, taken as drafted)."""
        slot = self._count % len(self._tokens)
        self._tokens[slot] = num_tokens
        self._seconds[slot] = seconds
        self._drafted[slot] = not 0 < num_tokens <= num_requests
        if not self._drafted[slot]:
            self._baselines.setdefault(num_tokens, collections.deque(
                maxlen=BASELINE_MEMORY)).append((self._count, seconds))
        self._count += 1

    def baseline(self, num_requests: int) -> float | None:
        """The quiet time of a step of ``num_requests`` without drafts, timed lately
        (None: too few such steps)."""
        recent = [seconds for index, seconds in self._baselines.get(num_requests, ())
                  if index >= self._count - BASELINE_WINDOW]
        if len(recent) < MIN_BASELINE_TIMES:
            return None
        return float(np.sort(recent)[int((len(recent) - 1) * QUIET_QUANTILE)])

    def wants_baseline(self, num_requests: int) -> bool:
        """Whether this step of ``num_requests`` may drop its drafts to time their
        baseline: once the steps are fitted, while it has none, every
        ``BASELINE_INTERVAL`` steps (asking counts as the step's)."""
        if (self._count < MIN_SAMPLES or self._count - self._baseline_asked < BASELINE_INTERVAL
                or self.baseline(num_requests) is not None):
            return False
        self._baseline_asked = self._count
        return True

    def step_curve(self, num_requests: int) -> CostCurve | None:
        """``curve``, for a step of ``num_requests``: from their baseline where it was
        timed (the same object while neither changes)."""
        curve = self.curve()
        baseline = self.baseline(num_requests) if self._count >= MIN_SAMPLES else None
        (last_curve, *last_key), step_curve = self._step_curve
        if last_curve is not curve or last_key != [num_requests, baseline]:
            step_curve = (curve if curve is None or baseline is None
                          else curve.from_baseline(num_requests, baseline))
            self._step_curve = (curve, num_requests, baseline), step_curve
        return step_curve

    def set_prior(self, fixed_seconds: float, token_seconds: float,
                  sizes: tuple[int, ...] = (), size_seconds: tuple[float, ...] = ()) -> None:
        """A measurement taken at start-up (the target's passes alone, so a lower
        fixed cost than a whole step's) stands in for the fit until ``MIN_SAMPLES``
        passes were timed, and wherever the passes' token counts are too alike to fit:
        without it, the first passes of a server that starts under load verify every
        draft token uncut. Its passes of a few ``sizes`` (the line if none) also
        price token counts larger than any step timed so far."""
        self._prior = self.fixed_seconds, self.token_seconds = fixed_seconds, token_seconds
        self._prior_curve = self._curve = (
            CostCurve(np.array(sizes, dtype=np.float64), np.maximum.accumulate(size_seconds),
                      max(token_seconds, 0.0))
            if sizes else CostCurve.linear(fixed_seconds, token_seconds))

    @property
    def has_estimate(self) -> bool:
        """Enough passes were timed for a fit, or a start-up measurement stands in
        (``free_tokens`` may still be infinite)."""
        return self._count >= MIN_SAMPLES or not math.isnan(self._prior[1])

    def free_tokens(self) -> float:
        """a / b: the pass's fixed cost in units of one token's marginal cost, by the
        line.

        Infinite (no cut) until ``MIN_SAMPLES`` passes were timed (unless a start-up
        measurement stands in), when the token counts did not vary, or when the fitted
        marginal cost is not positive. Refitted every ``REFIT_INTERVAL`` passes.
        """
        self._refit_if_due()
        if not self.token_seconds > 0:  # nan or not positive
            return math.inf
        return max(self.fixed_seconds, 0.0) / self.token_seconds

    def curve(self) -> CostCurve | None:
        """The step's seconds by token count (None: nothing timed or measured yet)."""
        self._refit_if_due()
        return self._curve

    def by_token_count(self) -> list[dict]:
        """For reports: each token count among the recent passes, how many were timed,
        their mean and quiet times, and what the curve prices it at (seconds)."""
        values, passes, quiet, mean = self._times_by_count()
        curve = self.curve()
        priced = [None] * len(values) if curve is None else curve(values).tolist()
        return [{"tokens": int(n), "passes": int(k), "mean": float(m), "quiet": float(q),
                 "curve": c} for n, k, q, m, c in zip(values, passes, quiet, mean, priced)]

    def _times_by_count(self, drafted_only: bool = False
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The recent passes (``drafted_only``: those that verified drafts) by token
        count: the counts, passes per count, and each count's quiet (``QUIET_QUANTILE``)
        and mean time."""
        n = self._tokens[: self._count]
        t = self._seconds[: self._count]
        if drafted_only:
            n, t = n[self._drafted[: self._count]], t[self._drafted[: self._count]]
        order = np.lexsort((t, n))
        values, first, passes = np.unique(n[order], return_index=True, return_counts=True)
        quiet = t[order][first + ((passes - 1) * QUIET_QUANTILE).astype(np.int64)]
        mean = np.add.reduceat(t[order], first) / passes
        return values, passes, quiet, mean

    def _refit_if_due(self) -> None:
        crossed_minimum = self._fitted_at < MIN_SAMPLES <= self._count
        due = crossed_minimum or self._count - self._fitted_at >= REFIT_INTERVAL
        if self._count >= MIN_SAMPLES and due:
            self._refit()
            self._fitted_at = self._count

    def _refit(self) -> None:
        """The curve and the line through each token count's lower quartile of times.

        Another process on the machine only ever slows a pass down, and a few slow
        passes at a rare, long token count would tilt a plain fit; a low quantile per
        count ignores them, and scaling every time alike leaves a / b unchanged. The
        curve is made non-decreasing (weighted by passes per count: a count timed
        rarely yields to its neighbours), as more tokens never take less compute. The
        curve is drawn through the drafted passes where ``MIN_SAMPLES`` were timed (the
        baselines price not drafting), the line through all.
        """
        self.fixed_seconds, self.token_seconds = self._prior
        values, weights, quantile, _ = self._times_by_count()
        mean_n = np.average(values, weights=weights)
        variance = np.average((values - mean_n) ** 2, weights=weights)
        if variance >= 1e-9:
            mean_t = np.average(quantile, weights=weights)
            slope = np.average((values - mean_n) * (quantile - mean_t),
                               weights=weights) / variance
            # plain floats: they travel in ProposerStats through vLLM's RPC encoder,
            # whose decoder does not rebuild numpy scalars
            self.token_seconds = float(slope)
            self.fixed_seconds = float(mean_t - slope * mean_n)
        beyond_slope = self.token_seconds if self.token_seconds > 0 else 0.0  # nan: not > 0
        if self._drafted[: self._count].sum() >= MIN_SAMPLES:
            values, weights, quantile, _ = self._times_by_count(drafted_only=True)
        curve = CostCurve(values, _non_decreasing(quantile, weights), beyond_slope)
        self._curve = curve if self._prior_curve is None else curve.extended_by(
            self._prior_curve)


def _non_decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-decreasing fit to ``values`` (pool adjacent
    violators; a few hundred token counts at most, every ``REFIT_INTERVAL`` passes)."""
    means: list[float] = []
    totals: list[float] = []
    sizes: list[int] = []
    for value, weight in zip(values.tolist(), weights.tolist()):
        means.append(value)
        totals.append(weight)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            mean, total, size = means.pop(), totals.pop(), sizes.pop()
            merged = totals[-1] + total
            means[-1] = (means[-1] * totals[-1] + mean * total) / merged
            totals[-1] = merged
            sizes[-1] += size
    return np.repeat(means, sizes)
