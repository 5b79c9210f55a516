"""Draft acceptance learned in hindsight, from the text that followed each draft.

The cost-aware cut keeps a draft token only while its estimated acceptance pays for
its compute. If those estimates learned only from verified tokens, a cut would stop
its own evidence: a request cut to no draft is never verified again, its estimates
stay where the cut left them, and a copied span that begins later is never drafted.
So every draft the sources proposed, kept or cut, is compared with the tokens the
request then generated. Under greedy decoding a draft token is accepted exactly when
it equals the generated token; under sampling, a point-mass draft token is accepted
with the target's probability of that token, which is also the chance that the
generated token equals it. The comparison therefore measures acceptance without
verifying anything, and costs no forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np


@dataclass
class ProposedDraft:
    """A draft as the sources proposed it (before the cut), awaiting the text after it."""

    start: int  # context position of its first token
    tokens: np.ndarray
    classes: np.ndarray  # each token's calibration class (``Draft.token_classes``)
    kept: int  # leading tokens the cut left to be verified
    first_estimate: float  # the worker's acceptance estimate of its first token's class
    #: the cut's estimates of the acceptance of each token it kept, before and after
    #: calibration (None: the step was not cut)
    kept_estimates: tuple[np.ndarray, np.ndarray] | None = None
    matched: int = 0  # leading tokens the generated text has confirmed so far

    def hits(self) -> np.ndarray:
        """Which tokens the text matched (once settled: a prefix)."""
        return np.arange(len(self.tokens)) < self.matched


@dataclass
class Outcome:
    """What the new tokens told about one proposed draft: draft positions
    ``[first, first + compared)`` were compared with generated tokens, and the first
    ``confirmed`` of those matched (all of them, unless the last compared one differed)."""

    first: int
    compared: int
    confirmed: int
    cut_confirmed: int  # matched tokens among those the cut had dropped
    classes: np.ndarray  # the calibration class of each of the draft's tokens
    first_estimate: float  # what the worker expected of its first token when proposed
    settled: ProposedDraft | None = None  # the draft, if this settled all its tokens


@dataclass
class Hindsight:
    """One request's proposed drafts that the generated text has not settled yet.

    Each pass generates at least one token, so a draft of up to K tokens is settled
    within K passes and at most K are pending; ``propose`` enforces that bound.
    """

    pending: list[ProposedDraft] = field(default_factory=list)

    def propose(self, start: int, tokens: np.ndarray, classes: np.ndarray, kept: int,
                max_pending: int, first_estimate: float,
                kept_estimates: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        if not len(tokens):
            return
        if len(self.pending) >= max_pending:
            del self.pending[: len(self.pending) - max_pending + 1]
        self.pending.append(ProposedDraft(start, tokens, classes, kept, first_estimate,
                                          kept_estimates))

    def settle(self, context: np.ndarray, num_tokens: int) -> list[Outcome]:
        """Compare the pending drafts with the context's tokens up to ``num_tokens``;
        drafts that met a mismatch or were confirmed whole leave the pending list."""
        outcomes, still_pending = [], []
        for draft in self.pending:
            first = draft.matched
            end = min(len(draft.tokens), num_tokens - draft.start)
            if end <= first:
                still_pending.append(draft)
                continue
            draft.matched = _matching_prefix(context, draft.start, draft.tokens, first, end)
            confirmed, differs = draft.matched - first, draft.matched < end
            cut_confirmed = max(0, draft.matched - max(first, draft.kept))
            compared = confirmed + (1 if differs else 0)
            settled = differs or draft.matched == len(draft.tokens)
            outcomes.append(Outcome(first, compared, confirmed, cut_confirmed, draft.classes,
                                    draft.first_estimate, draft if settled else None))
            if not settled:
                still_pending.append(draft)
        self.pending = still_pending
        return outcomes


@numba.njit(cache=True, nogil=True)
def _matching_prefix(context, start, tokens, first, end):
    """The end of the run of ``tokens[first:end]`` equal to the context from
    ``start + first`` (compiled: every pending draft of every request, every step)."""
    for j in range(first, end):
        if context[start + j] != tokens[j]:
            return j
    return end


def warm_up() -> None:
    """Compile ``settle``'s comparison for the contexts vLLM (int32) and the replay
    (int64) hand over, before the first request."""
    for dtype in (np.int32, np.int64):
        _matching_prefix(np.zeros(1, dtype=dtype), 0, np.zeros(1, dtype=np.int64), 0, 1)
