"""How well a drafted token is supported by what its source saw: the bin that, with its
source and position, indexes the calibrated acceptance estimates (``budget.py``).

A context or corpus match follows the most frequent continuation of every earlier
occurrence of the matched suffix, and a pool entry is the most frequent of a key's
recent continuations (a match of one token, the key). A continuation that every one
of several occurrences agrees on is nearly certain; a plurality among disagreeing
occurrences is less so; one seen once after a short match is a guess, after a long
match a copy. The raw share (count / occurrences) is not itself a probability: a
single occurrence has share 1. So each token carries the bin of its (count,
occurrences, length of the match it continues), and the acceptance of each (source,
bin) is learned per draft position from what verification (in hindsight) confirmed.
"""

from __future__ import annotations

import numba

#: Bins: 0 seen once after a short match (or no count: the lattice, recycled tokens),
#: 1 seen once after a match of at least ``LONG_MATCH`` tokens, 2 every one of at least
#: two occurrences agrees, 3 more than half of them, 4 at most half (a plurality or a
#: tie).
SUPPORT_BINS = 5
SEEN_ONCE, COPIED, UNANIMOUS, MAJORITY, MINORITY = range(SUPPORT_BINS)
#: Tokens of context (the matched suffix and the draft before) that make a single
#: occurrence a copy rather than a guess.
LONG_MATCH = 8


@numba.njit(cache=True, nogil=True)
def support_bin(count, occurrences, match_len):
    """The bin of a continuation chosen ``count`` times among ``occurrences`` of the
    ``match_len`` tokens before it."""
    if occurrences <= 1:
        return COPIED if match_len >= LONG_MATCH else SEEN_ONCE
    if count >= occurrences:
        return UNANIMOUS
    if 2 * count > occurrences:
        return MAJORITY
    return MINORITY
