"""Context matches: the most frequent continuation of the longest repeat of the
context's suffix in the request's own prompt and output.

It scans the whole context in compiled code: it is the one loop whose cost grows with
the context, so it must not run in the interpreter. One call serves the whole batch.
"""

from __future__ import annotations

import numba
import numpy as np

from vllm_lookahead.lookahead.sources.support import support_bin


#: Earlier occurrences of the matched suffix kept as candidates (most recent first).
MAX_MATCH_CANDIDATES = 64


@numba.njit(cache=True, nogil=True)
def suffix_match(tokens, num_tokens, min_n, max_n, max_out, min_prob, out, bins):
    """Most frequent continuation of the longest repeated suffix of ``tokens[:num_tokens]``.

    The earlier occurrences of the longest suffix (``min_n .. max_n`` tokens) are the
    branches of a trie of continuations; the draft follows the most frequent child
    at each depth (ties: the most recent occurrence) while the product of the
    children's frequencies, an estimate of the draft prefix's probability, stays at
    or above ``min_prob``. Writes up to ``max_out`` tokens into ``out`` and their
    support bins into ``bins``; returns (tokens written, match length, probability
    estimate of the draft).
    """
    if num_tokens < min_n + 1 or max_out <= 0:
        return 0, 0, 0.0
    last = tokens[num_tokens - 1]
    ends = np.empty(MAX_MATCH_CANDIDATES, dtype=np.int64)
    num_ends = 0
    best_len = 0
    for end in range(num_tokens - 2, -1, -1):
        if tokens[end] != last:
            continue
        length = 1
        while (length < max_n and end - length >= 0
               and tokens[end - length] == tokens[num_tokens - 1 - length]):
            length += 1
        if length > best_len:
            best_len = length
            num_ends = 0
        if length == best_len and num_ends < MAX_MATCH_CANDIDATES:
            ends[num_ends] = end
            num_ends += 1
            if best_len == max_n and num_ends == MAX_MATCH_CANDIDATES:
                break
    if best_len < min_n:
        return 0, 0, 0.0
    depth, prob = follow_most_frequent(tokens, num_tokens, ends, num_ends, best_len,
                                       max_out, min_prob, out, bins)
    return depth, best_len, prob


@numba.njit(cache=True, nogil=True)
def follow_most_frequent(tokens, size, ends, num_ends, match_len, max_out, min_prob, out,
                         bins):
    """The most frequent continuation of the occurrences ending at ``ends[:num_ends]``
    (most recent first: ties go to it) of a ``match_len``-token suffix, token by token, while the product of the
    chosen tokens' frequencies stays at or above ``min_prob``; a continuation ends at
    ``size`` or at a negative token (a separator). Writes up to ``max_out`` tokens into
    ``out`` and the support bin of each (``support.support_bin``: its count among the
    occurrences still followed) into ``bins`` (``ends`` is overwritten); returns
    (tokens written, their probability estimate)."""
    prob = 1.0
    depth = 0
    while depth < max_out:
        live = 0  # candidates whose continuation reaches this depth, kept in order
        for i in range(num_ends):
            position = ends[i] + 1 + depth
            if position < size and tokens[position] >= 0:
                ends[live] = ends[i]
                live += 1
        num_ends = live
        if live == 0:
            break
        best_token, best_count = -1, 0
        for i in range(live):
            token = tokens[ends[i] + 1 + depth]
            if token == best_token:
                continue
            count = 0
            for j in range(live):
                if tokens[ends[j] + 1 + depth] == token:
                    count += 1
            if count > best_count:
                best_token, best_count = token, count
        if prob * best_count / live < min_prob:
            break
        prob *= best_count / live
        out[depth] = best_token
        bins[depth] = support_bin(best_count, live, match_len + depth)
        depth += 1
        kept = 0
        for i in range(live):
            if tokens[ends[i] + depth] == best_token:
                ends[kept] = ends[i]
                kept += 1
        num_ends = kept
    return depth, prob


@numba.njit(cache=True, nogil=True)
def batch_suffix_match(token_ids, rows, num_tokens, max_out, min_n, max_n, min_prob,
                       out, out_bins, out_count, match_len, out_prob):
    """``suffix_match`` for each ``rows[b]`` of the runner's token buffer."""
    for b in range(rows.shape[0]):
        out_count[b], match_len[b], out_prob[b] = suffix_match(
            token_ids[rows[b]], num_tokens[b], min_n, max_n, max_out[b], min_prob[b], out[b],
            out_bins[b]
        )


def warm_up_suffix_match() -> None:
    """Compile (or load from cache) the matcher before the first request is timed."""
    tokens = np.array([[1, 2, 3, 1, 2]], dtype=np.int32)
    out = np.zeros((1, 4), dtype=np.int32)
    counts = np.zeros(1, dtype=np.int64)
    batch_suffix_match(tokens, np.zeros(1, np.int64), np.array([5], np.int64),
                       np.array([4], np.int64), 1, 2, np.array([0.1]), out,
                       np.zeros((1, 4), dtype=np.int8), counts, counts.copy(), np.zeros(1))
