"""The cost-aware cut's acceptance estimates, recalibrated against the text that
followed, and a report of how well the calibrated ones held.

A draft token's estimate is its request's first-token rate times the worker's
acceptance by depth for the classes of its tokens (``budget.py``). Each factor is
learned, their product is not checked: with 32 HumanEval requests a step (SmolLM2-135M,
2 CPU cores, run (co)), the tokens the cut kept at estimates of 0.9-1 (mean 0.98) were
matched 60 % of the time, where a token paid from about 0.5-0.7. The cut keeps the
tokens with the highest estimates, so the over-estimated ones are exactly those it
verifies (the winner's curse).

``AcceptanceCalibration`` therefore learns, per bin of the estimate, how often the text
matched the tokens the cut kept there (checked in hindsight, ``hindsight.py``), and
scales later estimates in that bin down to it. It learns from the kept tokens, the ones
the cut's decisions live by: learned from every proposal instead (cut ones too), a probe
put the top bin at 0.80 while the kept tokens in it matched 0.51 (a dropped draft is
proposed again, shifted by a token, at the next step, so the proposals weigh spans
differently from what is verified). Under greedy decoding a match is an acceptance;
under sampling it is a draw of one.
"""

from __future__ import annotations

import numba
import numpy as np

#: Bins of the estimated acceptance, [0, 0.1), ..., [0.9, 1].
NUM_BINS = 10
#: Pseudo-tokens per bin that matched as often as estimated (before any evidence).
PRIOR_TOKENS = 20.0


@numba.njit(cache=True, nogil=True)
def _bin(estimate):
    return min(int(estimate * NUM_BINS), NUM_BINS - 1)


@numba.njit(cache=True, nogil=True)
def _count_binned(tokens, expected, matched, estimates, hits):
    """``AcceptanceCalibration.add`` (compiled: it runs for every draft settled in a
    step, where numpy's indexed adds cost microseconds each)."""
    for i in range(len(estimates)):
        b = _bin(estimates[i])
        tokens[b] += 1.0
        expected[b] += estimates[i]
        matched[b] += hits[i]


@numba.njit(cache=True, nogil=True)
def calibrated(estimates, factors):
    """A draft's estimates each scaled by its bin's ``factors``, then made non-increasing
    along the draft: a later token is accepted only with the ones before it."""
    out = np.empty_like(estimates)
    lowest = np.inf
    for i in range(len(estimates)):
        lowest = min(lowest, estimates[i] * factors[_bin(estimates[i])])
        out[i] = lowest
    return out


class AcceptanceCalibration:
    """Tokens by bin of their estimated acceptance: how many, their estimates summed and
    how many the text matched, decayed by ``decay`` a step (1: kept whole). Per sampling
    class, the cut's correction (``factors``, by the uncalibrated estimates, decayed like
    the estimates it corrects); once per worker, the report of the calibrated estimates
    of what the cut kept (``table``)."""

    def __init__(self, decay: float = 1.0):
        self._decay = decay
        self.tokens = np.zeros(NUM_BINS)
        self.expected = np.zeros(NUM_BINS)
        self.matched = np.zeros(NUM_BINS)
        self._empty = True  # nothing counted yet: nothing to decay

    def decay(self) -> None:
        if not self._empty:
            self.tokens *= self._decay
            self.expected *= self._decay
            self.matched *= self._decay

    def add(self, estimates: np.ndarray, matched: np.ndarray) -> None:
        """A settled draft's kept tokens: their estimates, and which the text matched."""
        self._empty = self._empty and not len(estimates)
        _count_binned(self.tokens, self.expected, self.matched, estimates, matched)

    def factors(self) -> np.ndarray:
        """Each bin's correction: its matched over expected tokens where that is below 1
        (smoothed by ``PRIOR_TOKENS`` on the mark), for ``calibrated``.

        Never above 1: a bin pools the tokens of all requests, and where a bin's tokens
        matched more often than estimated, it is some requests' (a copied span after
        free text) that the requests' own records already tell from the others';
        raising the whole bin would draft for the others too."""
        centre = (np.arange(NUM_BINS) + 0.5) / NUM_BINS
        ratio = ((self.matched + PRIOR_TOKENS * centre)
                 / (self.expected + PRIOR_TOKENS * centre))
        return np.minimum(ratio, 1.0)

    def table(self) -> list[dict]:
        """One row per bin with tokens: its range, tokens, mean estimate, matched rate."""
        return [{"estimate_from": b / NUM_BINS, "tokens": int(round(self.tokens[b])),
                 "mean_estimate": float(self.expected[b] / self.tokens[b]),
                 "matched_rate": float(self.matched[b] / self.tokens[b])}
                for b in np.flatnonzero(self.tokens)]
