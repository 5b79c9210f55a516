"""A main draft and where each of its tokens came from: the record that the drafts'
sources write, the request state keeps for the next pass, the cut calibrates by and
the counters count by (``metrics.DRAFT_SOURCES``, ``ACCEPTED_SOURCES``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_lookahead.lookahead.sources.support import SUPPORT_BINS

#: Where a main draft's tokens come from, in the order of ``Draft.token_sources``.
TOKEN_SOURCES = ("context", "corpus", "lattice", "pool", "recycled")
#: Calibration classes, the rows of ``budget.AcceptanceByDepth``: each source's tokens
#: by their support bin (``support.py``), ``Draft.token_classes``.
NUM_TOKEN_CLASSES = len(TOKEN_SOURCES) * SUPPORT_BINS


@dataclass
class Draft:
    """A request's main draft and the origin of its tokens: first ``matched`` tokens
    from ``match_source`` ("context" or "corpus"), then ``from_pool`` pool tokens, of
    which ``from_lattice`` were the lattice's top path, then recycled tokens, then
    ``padded`` tokens that only fill it to K (``uniform_drafts.py``)."""

    tokens: list[int]
    match_source: str = "context"
    matched: int = 0
    from_pool: int = 0
    from_lattice: int = 0
    padded: int = 0
    #: each token's support bin (``support.py``), as drafted (the cut shortens ``tokens``)
    bins: list[int] = field(default_factory=list)

    def tokens_by_source(self, count: int | None = None) -> dict[str, int]:
        """Tokens per source among the draft's first ``count`` tokens (all that is left
        of it, by default: it may have been cut); ``count`` accepted tokens, after
        verification."""
        count = len(self.tokens) if count is None else min(count, len(self.tokens))
        matched = min(self.matched, count)
        from_pool = min(self.from_pool, count - matched)
        from_lattice = min(self.from_lattice, from_pool)
        recycled = min(count, len(self.tokens) - self.padded) - matched - from_pool
        return {self.match_source: matched, "lattice": from_lattice,
                "pool": from_pool - from_lattice, "recycled": recycled,
                "padding": count - matched - from_pool - recycled}

    def token_sources(self) -> np.ndarray:
        """Each token's source, as an index into ``TOKEN_SOURCES`` (a draft holds them
        in that order: a match, then the pool's tokens, the lattice's first, then
        recycled ones)."""
        counts = self.tokens_by_source()
        return np.repeat(np.arange(len(TOKEN_SOURCES)),
                         [counts.get(source, 0) for source in TOKEN_SOURCES])

    def token_classes(self) -> np.ndarray:
        """Each token's calibration class: its source and its support bin, an index into
        the rows of ``budget.AcceptanceByDepth`` (``NUM_TOKEN_CLASSES``)."""
        bins = np.asarray(self.bins[: len(self.tokens)], dtype=np.int64)
        return self.token_sources() * SUPPORT_BINS + bins
