"""Draft sources: per-request n-gram pool, context suffix matcher, response corpus.

The pool maps a key token to continuations of N-1 tokens (least recently used
evicted per key and across keys, so memory per request is bounded by
``max_keys * max_per_key * (N-1)`` tokens). The suffix matcher scans the request's
own context (prompt and output) in compiled code: it is the one loop whose cost
grows with the context, so it must not run in the interpreter. The corpus keeps
finished responses for later requests; an index keeps its lookups independent of
its size.
"""

from __future__ import annotations

import numba
import numpy as np

Continuation = tuple[int, ...]


class NgramPool:
    """Continuations seen after each key token, with how often each was seen."""

    def __init__(self, ngram_size: int, max_per_key: int, max_keys: int):
        self.ngram_size = ngram_size
        self.max_per_key = max_per_key
        self.max_keys = max_keys
        self._table: dict[int, dict[Continuation, int]] = {}
        self.num_entries = 0

    def add(self, key: int, continuation: Continuation) -> None:
        entries = self._table.pop(key, None)  # re-inserted below: most recent key last
        if entries is None:
            entries = {}
            if len(self._table) >= self.max_keys:
                evicted = self._table.pop(next(iter(self._table)))
                self.num_entries -= len(evicted)
        count = entries.pop(continuation, None)
        if count is None:
            self.num_entries += 1
            count = 0
        entries[continuation] = count + 1
        if len(entries) > self.max_per_key:
            del entries[next(iter(entries))]
            self.num_entries -= 1
        self._table[key] = entries

    def add_ngrams(self, tokens: list[int], count: int) -> None:
        """Add the n-grams of ``tokens`` that begin at its first ``count`` positions."""
        n = self.ngram_size
        for i in range(count):
            self.add(tokens[i], tuple(tokens[i + 1 : i + n]))

    def candidates(self, key: int, guess_set_size: int) -> list[tuple[Continuation, int]]:
        """The ``guess_set_size`` most recent continuations of ``key`` with their counts,
        newest first."""
        entries = self._table.get(key)
        if not entries or guess_set_size == 0:
            return []
        return list(entries.items())[: -guess_set_size - 1 : -1]

    def best(self, key: int, guess_set_size: int) -> tuple[Continuation, float] | None:
        """Most frequent of the ``guess_set_size`` most recent continuations of ``key``,
        with its share of their counts (the draft's probability estimate)."""
        recent = self.candidates(key, guess_set_size)
        if not recent:
            return None
        # max keeps the first maximum: newest first, so ties go to the newest
        continuation, count = max(recent, key=lambda item: item[1])
        return continuation, count / sum(c for _, c in recent)


class ResponseCorpus:
    """Finished responses, searched for the longest repeat of a request's context suffix.

    Responses of one deployment repeat each other (boilerplate, code idioms, the same
    questions asked again). At most ``capacity`` tokens are kept (oldest dropped) in
    preallocated arrays: the tokens, and for each position the previous position of
    the same bigram (hash chains, as in LZ77 compressors), so the memory is fixed at
    ``bytes_for(capacity)`` whatever is stored. A lookup visits the
    ``candidates_per_bigram`` most recent occurrences of the suffix's last bigram, so
    it costs the same whatever the corpus size.
    """

    SEPARATOR = -1  # between responses: no match or continuation crosses it

    def __init__(self, capacity: int, candidates_per_bigram: int = 16):
        self.capacity = capacity
        self.candidates_per_bigram = candidates_per_bigram
        self._tokens = np.full(capacity, self.SEPARATOR, dtype=np.int32)
        self._prev = np.full(capacity, -1, dtype=np.int32)  # same bigram, earlier
        self._heads = np.full(_hash_table_size(capacity), -1, dtype=np.int32)
        self._size = 0

    @staticmethod
    def bytes_for(capacity: int) -> int:
        return 8 * capacity + 4 * _hash_table_size(capacity)

    def __len__(self) -> int:
        return self._size

    def add(self, response: list[int]) -> None:
        if not response or self.capacity < 2:
            return
        response = response[-(self.capacity - 1):]
        if self._size + len(response) + 1 > self.capacity:
            self._drop_oldest(self._size + len(response) + 1 - self.capacity)
        self._size = _corpus_append(self._tokens, self._prev, self._heads, self._size,
                                    np.asarray(response, dtype=np.int32))

    def _drop_oldest(self, count: int) -> None:
        """Keep the newest whole responses; at least half goes, so this is rare."""
        cut = max(count, self._size // 2)
        tokens = self._tokens[:self._size]
        separators = np.flatnonzero(tokens[cut - 1:] == self.SEPARATOR)
        start = cut + int(separators[0]) if len(separators) else self._size
        kept = tokens[start:].copy()
        self._tokens.fill(self.SEPARATOR)
        self._heads.fill(-1)
        self._size = _corpus_append(self._tokens, self._prev, self._heads, 0, kept,
                                    separated=False)

    def match(self, suffix: list[int], min_n: int, max_n: int, max_out: int
              ) -> tuple[int, list[int]]:
        """(match length, continuation) of the longest repeat of ``suffix``'s end."""
        if len(suffix) < 2 or max_out <= 0 or self._size == 0:
            return 0, []
        length, end = _corpus_match(self._tokens, self._prev, self._heads,
                                    np.asarray(suffix, dtype=np.int32), max_n,
                                    self.candidates_per_bigram)
        if length < min_n:
            return 0, []
        continuation = self._tokens[end + 1 : min(end + 1 + max_out, self._size)]
        stops = np.flatnonzero(continuation == self.SEPARATOR)
        return length, continuation[: stops[0] if len(stops) else None].tolist()


def _hash_table_size(capacity: int) -> int:
    """The smallest power of two >= capacity: chains of about one bigram each."""
    return 1 << max(4, (int(capacity) - 1).bit_length())


@numba.njit(cache=True, nogil=True, inline="always")
def _bigram_hash(first, second, mask):
    return ((first * 1000003) ^ (second * 19260817)) & mask


@numba.njit(cache=True, nogil=True)
def _corpus_append(tokens, prev, heads, size, new_tokens, separated=True):
    """Append ``new_tokens`` (plus a separator when ``separated``) and index their
    bigrams; ``new_tokens`` may hold separators itself. Returns the new size."""
    mask = heads.shape[0] - 1
    for token in new_tokens:
        tokens[size] = token
        prev[size] = -1
        if size > 0 and token >= 0 and tokens[size - 1] >= 0:
            h = _bigram_hash(tokens[size - 1], token, mask)
            prev[size] = heads[h]
            heads[h] = size
        size += 1
    if separated:
        tokens[size] = -1
        prev[size] = -1
        size += 1
    return size


@numba.njit(cache=True, nogil=True)
def _corpus_match(tokens, prev, heads, suffix, max_n, max_candidates):
    """(length, end position) of the longest earlier occurrence of ``suffix``'s end
    among the most recent occurrences of its last bigram; ties go to the most recent."""
    n = suffix.shape[0]
    first, second = suffix[n - 2], suffix[n - 1]
    position = heads[_bigram_hash(first, second, heads.shape[0] - 1)]
    best_len, best_end, seen, visits = 0, -1, 0, 0
    while position >= 0 and seen < max_candidates and visits < 4 * max_candidates:
        visits += 1
        if tokens[position] == second and tokens[position - 1] == first:
            seen += 1
            length = 2
            while (length < max_n and length < n and position - length >= 0
                   and tokens[position - length] == suffix[n - 1 - length]):
                length += 1
            if length > best_len:
                best_len, best_end = length, position
                if length == max_n:
                    break
        position = prev[position]
    return best_len, best_end


#: Earlier occurrences of the matched suffix kept as candidates (most recent first).
MAX_MATCH_CANDIDATES = 64


@numba.njit(cache=True, nogil=True)
def _suffix_match(tokens, num_tokens, min_n, max_n, max_out, min_prob, out):
    """Most frequent continuation of the longest repeated suffix of ``tokens[:num_tokens]``.

    The earlier occurrences of the longest suffix (``min_n .. max_n`` tokens) are the
    branches of a trie of continuations; the draft follows the most frequent child
    at each depth (ties: the most recent occurrence) while the product of the
    children's frequencies, an estimate of the draft prefix's probability, stays at
    or above ``min_prob``. Writes up to ``max_out`` tokens into ``out``; returns
    (tokens written, match length, probability estimate of the draft).
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
    prob = 1.0
    depth = 0
    while depth < max_out:
        live = 0  # candidates whose continuation reaches this depth, kept in order
        for i in range(num_ends):
            if ends[i] + 1 + depth < num_tokens:
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
        depth += 1
        kept = 0
        for i in range(live):
            if tokens[ends[i] + depth] == best_token:
                ends[kept] = ends[i]
                kept += 1
        num_ends = kept
    return depth, best_len, prob


@numba.njit(cache=True, nogil=True)
def batch_suffix_match(token_ids, rows, num_tokens, max_out, min_n, max_n, min_prob,
                       out, out_count, match_len, out_prob):
    """``_suffix_match`` for each ``rows[b]`` of the runner's token buffer."""
    for b in range(rows.shape[0]):
        out_count[b], match_len[b], out_prob[b] = _suffix_match(
            token_ids[rows[b]], num_tokens[b], min_n, max_n, max_out[b], min_prob[b], out[b]
        )


def warm_up_suffix_match() -> None:
    """Compile (or load from cache) the matcher before the first request is timed."""
    tokens = np.array([[1, 2, 3, 1, 2]], dtype=np.int32)
    out = np.zeros((1, 4), dtype=np.int32)
    counts = np.zeros(1, dtype=np.int64)
    batch_suffix_match(tokens, np.zeros(1, np.int64), np.array([5], np.int64),
                       np.array([4], np.int64), 1, 2, np.array([0.1]), out, counts,
                       counts.copy(), np.zeros(1))
