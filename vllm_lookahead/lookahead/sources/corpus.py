"""The response corpus: responses of other requests, finished (``ResponseCorpus``)
and being generated now (``LiveResponses``), searched for the longest repeat of a
request's context suffix; an index keeps the lookups independent of their size."""

from __future__ import annotations

from collections.abc import Container, Iterable

import numba
import numpy as np

from vllm_lookahead.lookahead.sources.context import follow_most_frequent

#: (match length, continuation, the support bin of each of its tokens)
Match = tuple[int, list[int], list[int]]
NO_MATCH: Match = (0, [], [])


class ResponseCorpus:
    """Finished responses, searched for the longest repeat of a request's context suffix.

    Responses of one deployment repeat each other (boilerplate, code idioms, the same
    questions asked again). At most ``capacity`` tokens are kept (oldest dropped) in
    preallocated arrays: the tokens, and for each position the previous position of
    the same bigram and of the same token (hash chains, as in LZ77 compressors), so the
    memory is fixed at ``bytes_for(capacity)`` whatever is stored. A lookup visits the
    ``candidates_per_bigram`` most recent occurrences of the suffix's last bigram (where
    none repeats, of its last token), so it costs the same whatever the corpus size.
    """

    SEPARATOR = -1  # between responses: no match or continuation crosses it

    def __init__(self, capacity: int, candidates_per_bigram: int = 16):
        self.capacity = capacity
        self.candidates_per_bigram = candidates_per_bigram
        self._tokens = np.full(capacity, self.SEPARATOR, dtype=np.int32)
        # the same bigram (row 0) and token (row 1), earlier; the chains' heads
        self._prev = np.full((2, capacity), -1, dtype=np.int32)
        self._heads = np.full((2, _hash_table_size(capacity)), -1, dtype=np.int32)
        self._size = 0

    @staticmethod
    def bytes_for(capacity: int) -> int:
        return 12 * capacity + 8 * _hash_table_size(capacity)

    def __len__(self) -> int:
        return self._size

    @property
    def storage(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The preallocated arrays (tokens, earlier position of the same bigram and
        token, hash heads), fixed for the corpus's life."""
        return self._tokens, self._prev, self._heads

    def add(self, response: list[int]) -> None:
        if not response or self.capacity < 2:
            return
        response = response[-(self.capacity - 1):]
        if self._size + len(response) + 1 > self.capacity:
            self._drop_oldest(self._size + len(response) + 1 - self.capacity)
        self._size = _corpus_append(self._tokens, self._prev, self._heads, self._size,
                                    np.asarray(response, dtype=np.int32), separated=True)

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

    def match(self, suffix: list[int], min_n: int, max_n: int, max_out: int,
              min_prob: float = 0.0) -> Match:
        """(match length, continuation, its support bins) of the longest repeat of ``suffix``'s end (``_match``)."""
        if not suffix or max_out <= 0 or self._size == 0:
            return NO_MATCH
        return _match(self._tokens, self._prev, self._heads, suffix, min_n, max_n, max_out,
                      min_prob, self.candidates_per_bigram, self._size)


class LiveResponses:
    """The responses of the requests decoding now, as they grow, for the other requests.

    Requests served together often write alike (one application's template, the same
    task asked by many users), and a finished response joins ``ResponseCorpus`` only
    at its end: the live ones are searched too (vLLM's suffix decoding does the same
    with its global tree). Each request holds a slot of ``slot_tokens`` cells (its
    first ``slot_tokens - 1`` output tokens; the last cell stays a separator, so no
    match or continuation crosses into another slot), indexed by bigram hash chains
    like the corpus's. A released slot is cleared to separators: chains through it
    then fail the token check and lose at most some older candidates, never a right
    draft for a wrong one (and drafts are verified anyway). Memory is fixed at
    ``ResponseCorpus.bytes_for(max_requests * slot_tokens)``.
    """

    SEPARATOR = ResponseCorpus.SEPARATOR

    def __init__(self, capacity: int, max_requests: int, candidates_per_bigram: int = 16):
        self.slot_tokens = capacity // max(max_requests, 1)
        size = self.slot_tokens * max_requests
        self.candidates_per_bigram = candidates_per_bigram
        self._tokens = np.full(size, self.SEPARATOR, dtype=np.int32)
        self._prev = np.full((2, size), -1, dtype=np.int32)
        self._heads = np.full((2, _hash_table_size(size)), -1, dtype=np.int32)
        self._slots: dict[str, int] = {}
        self._used = np.zeros(max_requests, dtype=np.int64)
        self._free = list(range(max_requests - 1, -1, -1))
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def holders(self) -> int:
        """Requests holding a slot now."""
        return len(self._slots)

    @property
    def enabled(self) -> bool:
        return self.slot_tokens >= 3  # a bigram and a continuation token

    def extend(self, req_id: str, output: list[int]) -> None:
        """The request's output so far (``output[: already added]`` is not read)."""
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free or not self.enabled:
                return
            slot = self._slots[req_id] = self._free.pop()
        used = int(self._used[slot])
        new = output[used : self.slot_tokens - 1]
        if new:
            start = slot * self.slot_tokens + used
            _corpus_append(self._tokens, self._prev, self._heads, start,
                           np.asarray(new, dtype=np.int32), separated=False)
            self._used[slot] = used + len(new)
            self._size += len(new)

    def release(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            slot = self._slots.pop(req_id, None)
            if slot is not None:
                start = slot * self.slot_tokens
                self._tokens[start : start + self.slot_tokens] = self.SEPARATOR
                self._size -= int(self._used[slot])
                self._used[slot] = 0
                self._free.append(slot)

    def keep_only(self, live: Container[str]) -> None:
        """Release the slots of requests no longer in ``live``."""
        self.release([req_id for req_id in self._slots if req_id not in live])

    def match(self, req_id: str, suffix: list[int], min_n: int, max_n: int, max_out: int,
              min_prob: float = 0.0) -> Match:
        """(match length, continuation, its support bins) of the longest repeat of ``suffix``'s end in the
        other requests' responses (the request's own is its context's; ``_match``)."""
        slot = self._slots.get(req_id, -1)
        if not suffix or max_out <= 0 or len(self._slots) == (slot >= 0):  # no other
            return NO_MATCH
        skip = (slot * self.slot_tokens, (slot + 1) * self.slot_tokens) if slot >= 0 else (0, 0)
        return _match(self._tokens, self._prev, self._heads, suffix, min_n, max_n, max_out,
                      min_prob, self.candidates_per_bigram, len(self._tokens), skip)


def warm_up_corpus() -> None:
    """Compile (or load from cache) the index and its search before the first request
    is timed."""
    live = LiveResponses(capacity=16, max_requests=2)
    live.extend("a", [1, 2, 3])
    live.match("b", [1, 2], 1, 4, 4)
    live.match("b", [7, 1], 1, 4, 4)


def _match(tokens: np.ndarray, prev: np.ndarray, heads: np.ndarray, suffix: list[int],
           min_n: int, max_n: int, max_out: int, min_prob: float, max_candidates: int,
           size: int, skip: tuple[int, int] = (0, 0)) -> Match:
    """(match length, continuation, its support bins) of the longest repeat of ``suffix``'s end outside
    positions ``[skip[0], skip[1])``: the most frequent continuation of its
    occurrences, as for the context's own matches (``context.follow_most_frequent``)."""
    ends = np.empty(max_candidates, dtype=np.int64)
    length, num_ends = _corpus_match(tokens, prev, heads, np.asarray(suffix, dtype=np.int32),
                                     max_n, min_n, skip[0], skip[1], ends)
    if length < min_n:
        return NO_MATCH
    out = np.empty(max(max_out, 0), dtype=np.int32)
    bins = np.empty(max(max_out, 0), dtype=np.int8)
    count, _ = follow_most_frequent(tokens, size, ends, num_ends, length, max_out, min_prob,
                                    out, bins)
    return length, out[:count].tolist(), bins[:count].tolist()


def _hash_table_size(capacity: int) -> int:
    """The smallest power of two >= capacity: chains of about one bigram each."""
    return 1 << max(4, (int(capacity) - 1).bit_length())


@numba.njit(cache=True, nogil=True, inline="always")
def _bigram_hash(first, second, mask):
    return ((first * 1000003) ^ (second * 19260817)) & mask


@numba.njit(cache=True, nogil=True)
def _corpus_append(tokens, prev, heads, size, new_tokens, separated):
    """Append ``new_tokens`` (plus a separator when ``separated``) and index their
    bigrams and tokens; ``new_tokens`` may hold separators itself. Returns the new
    size. (``separated`` has no default: an omitted argument is another compilation,
    paid mid-serving by the first finished request.)"""
    mask = heads.shape[1] - 1
    for token in new_tokens:
        tokens[size] = token
        prev[0, size] = -1
        prev[1, size] = -1
        if token >= 0:
            h = token & mask
            prev[1, size] = heads[1, h]
            heads[1, h] = size
            if size > 0 and tokens[size - 1] >= 0:
                h = _bigram_hash(tokens[size - 1], token, mask)
                prev[0, size] = heads[0, h]
                heads[0, h] = size
        size += 1
    if separated:
        tokens[size] = -1
        prev[0, size] = -1
        prev[1, size] = -1
        size += 1
    return size


@numba.njit(cache=True, nogil=True)
def _corpus_match(tokens, prev, heads, suffix, max_n, min_n, skip_start, skip_end, ends):
    """Length of the longest earlier occurrence of ``suffix``'s end among the
    ``len(ends)`` most recent occurrences of its last bigram outside positions
    ``[skip_start, skip_end)`` (where none repeats and ``min_n`` is 1: of its last
    token), and how many of them have that length: their end positions are written to
    ``ends``, most recent first."""
    n = suffix.shape[0]
    best_len, num_ends = 0, 0
    if n >= 2:
        best_len, num_ends = _chain_match(tokens, prev[0], heads[0], suffix, max_n, 2,
                                          skip_start, skip_end, ends)
    if best_len == 0 and min_n <= 1:
        best_len, num_ends = _chain_match(tokens, prev[1], heads[1], suffix, 1, 1,
                                          skip_start, skip_end, ends)
    return best_len, num_ends


@numba.njit(cache=True, nogil=True)
def _chain_match(tokens, prev, heads, suffix, max_n, chain_n, skip_start, skip_end, ends):
    """``_corpus_match`` along one chain: of the ``chain_n``-token suffix's end (a bigram
    or a token)."""
    n = suffix.shape[0]
    last = suffix[n - 1]
    if chain_n == 2:
        position = heads[_bigram_hash(suffix[n - 2], last, heads.shape[0] - 1)]
    else:
        position = heads[last & (heads.shape[0] - 1)]
    max_candidates = ends.shape[0]
    best_len, num_ends, seen, visits = 0, 0, 0, 0
    while position >= 0 and seen < max_candidates and visits < 4 * max_candidates:
        visits += 1
        if skip_start <= position < skip_end:
            position = prev[position]
            continue
        if tokens[position] == last and (chain_n == 1
                                         or tokens[position - 1] == suffix[n - 2]):
            seen += 1
            length = chain_n
            while (length < max_n and length < n and position - length >= 0
                   and tokens[position - length] == suffix[n - 1 - length]):
                length += 1
            if length > best_len:
                best_len, num_ends = length, 0
            if length == best_len:
                ends[num_ends] = position
                num_ends += 1
        position = prev[position]
    return best_len, num_ends
