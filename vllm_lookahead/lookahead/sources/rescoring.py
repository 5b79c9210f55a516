"""Draft rescoring (blockwise parallel decoding): rank the pool's continuations of the
bonus token, and the lattice's top path, by their n-gram frequency times the
probability the target's Jacobi lattice gives their tokens."""

from __future__ import annotations

import math

from vllm_lookahead.lookahead.sources.pool import Continuation, NgramPool
from vllm_lookahead.lookahead.sources.support import support_bin

Lattice = tuple[list[list[int]], list[list[float]]]


def rescored(pool: NgramPool, lattice: Lattice, key: int, guess_set_size: int,
             ngram_size: int) -> tuple[tuple[Continuation, float, int] | None, bool]:
    """The best continuation of ``key`` (the bonus token) by draft rescoring.

    Candidates: the pool's entries for ``key`` and the lattice's top path. Each is
    scored by its n-gram frequency in the pool (add-one smoothed) times the
    probability the lattice gives its tokens (a token outside a column's top-k
    gets that column's lowest listed probability); the estimate passed on is the
    candidate's share of the scores. Returns ((candidate, estimate, its support bin in
    the pool), from the lattice).
    """
    ids, logprobs = lattice
    counts = dict(pool.candidates(key, guess_set_size))
    top_path = tuple(column[0] for column in ids[: ngram_size - 1])
    from_pool = top_path in counts
    counts.setdefault(top_path, 0)
    scores = {}
    for continuation, count in counts.items():
        score = math.log(count + 1)
        for column, column_logprobs, token in zip(ids, logprobs, continuation):
            score += (column_logprobs[column.index(token)] if token in column
                      else column_logprobs[-1])
        scores[continuation] = score
    best = max(scores, key=scores.__getitem__)  # ties: the pool's newest first
    top = scores[best]
    share = 1.0 / sum(math.exp(score - top) for score in scores.values())
    support = support_bin(counts[best], sum(counts.values()), 1)
    return (best, share, support), best == top_path and not from_pool
