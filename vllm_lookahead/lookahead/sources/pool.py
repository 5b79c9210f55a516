"""The request's n-gram pool: continuations of N-1 tokens seen after each key token
(in the prompt, the output and the target's Jacobi predictions).

Least recently used continuations are evicted per key and across keys, so memory per
request is bounded by ``max_keys * max_per_key * (N-1)`` tokens.
"""

from __future__ import annotations

from vllm_lookahead.lookahead.sources.support import support_bin

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

    def best(self, key: int, guess_set_size: int) -> tuple[Continuation, float, int] | None:
        """Most frequent of the ``guess_set_size`` most recent continuations of ``key``,
        with its share of their counts (the draft's probability estimate) and its
        support bin (``support.py``)."""
        recent = self.candidates(key, guess_set_size)
        if not recent:
            return None
        # max keeps the first maximum: newest first, so ties go to the newest
        continuation, count = max(recent, key=lambda item: item[1])
        total = sum(c for _, c in recent)
        return continuation, count / total, support_bin(count, total, 1)
