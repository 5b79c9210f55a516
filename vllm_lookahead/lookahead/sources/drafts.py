"""A step's main drafts from the sources, and where their tokens came from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.context import batch_suffix_match, warm_up_suffix_match
from vllm_lookahead.lookahead.sources.corpus import ResponseCorpus
from vllm_lookahead.lookahead.sources.rescoring import rescored
from vllm_lookahead.lookahead.state import RequestState


@dataclass
class Draft:
    """A request's main draft and the origin of its tokens: first ``matched`` tokens
    from ``match_source`` ("context" or "corpus"), then pool tokens, of which
    ``from_lattice`` were the lattice's top path."""

    tokens: list[int]
    match_source: str = "context"
    matched: int = 0
    from_lattice: int = 0

    def tokens_by_source(self, count: int | None = None) -> dict[str, int]:
        """Tokens per source among the draft's first ``count`` tokens (all that is left
        of it, by default: it may have been cut); ``count`` accepted tokens, after
        verification."""
        count = len(self.tokens) if count is None else min(count, len(self.tokens))
        matched = min(self.matched, count)
        from_lattice = min(self.from_lattice, count - matched)
        return {self.match_source: matched, "lattice": from_lattice,
                "pool": count - matched - from_lattice}


class DraftSources:
    """Builds each step's main drafts; holds the corpus and the batch's match buffers."""

    def __init__(self, options: LookaheadOptions, max_draft: int, max_rows: int):
        self.options = options
        self.corpus = ResponseCorpus(options.corpus_tokens)
        self._match_out = np.zeros((max_rows, max_draft), dtype=np.int32)
        self._match_count = np.zeros(max_rows, dtype=np.int64)
        self._match_len = np.zeros(max_rows, dtype=np.int64)
        self._match_prob = np.zeros(max_rows, dtype=np.float64)
        warm_up_suffix_match()

    def draft(self, rows: list[int], states: list[RequestState], token_ids_cpu: np.ndarray,
              num_tokens: np.ndarray, limits: np.ndarray) -> list[Draft]:
        """One draft per row (of at most its limit), in order."""
        opts = self.options
        min_prob = np.array([state.draft_min_prob for state in states])
        batch_suffix_match(
            token_ids_cpu, np.asarray(rows, dtype=np.int64), num_tokens, limits,
            opts.suffix_match_min, opts.suffix_match_max, min_prob, self._match_out,
            self._match_count, self._match_len, self._match_prob,
        )
        drafts = []
        for b, (row, state) in enumerate(zip(rows, states)):
            limit = int(limits[b])
            draft = self._matched_continuation(b, token_ids_cpu[row], int(num_tokens[b]), limit)
            draft.from_lattice = self._fill_from_pool(state, draft.tokens, limit,
                                                      self._match_estimate(b, draft))
            drafts.append(draft)
        return drafts

    def _matched_continuation(self, b: int, tokens: np.ndarray, num_tokens: int,
                              limit: int) -> Draft:
        """The context's own match (batch slot ``b``) or a longer one in the corpus."""
        opts = self.options
        own = self._match_out[b, : self._match_count[b]].tolist()
        own_length = self._match_len[b]
        if own_length < opts.suffix_match_max and len(self.corpus):
            suffix = tokens[max(0, num_tokens - opts.suffix_match_max) : num_tokens].tolist()
            length, continuation = self.corpus.match(
                suffix, max(opts.suffix_match_min, 2), opts.suffix_match_max, limit)
            if length > own_length:
                return Draft(continuation, "corpus", len(continuation))
        return Draft(own, "context", len(own))

    def _match_estimate(self, b: int, draft: Draft) -> float:
        """Probability estimate of the match (a corpus match counts as certain)."""
        if draft.match_source == "corpus" or not draft.tokens:
            return 1.0
        return float(self._match_prob[b])

    def _fill_from_pool(self, state: RequestState, draft: list[int], limit: int,
                        prob: float) -> int:
        """Extend ``draft`` towards ``limit`` tokens by chained lookups in the request's
        pool while the draft's probability estimate stays at or above ``draft_min_prob``.
        Returns how many of the added tokens are the lattice's path (draft rescoring)."""
        opts = self.options
        from_lattice = 0
        key = draft[-1] if draft else state.pending_token
        while len(draft) < limit:
            if not draft and state.lattice is not None:
                best, is_lattice_path = rescored(state.pool, state.lattice, key,
                                                 opts.guess_set_size, opts.ngram_size)
            else:
                best, is_lattice_path = state.pool.best(key, opts.guess_set_size), False
            if best is None or prob * best[1] < state.draft_min_prob:
                break
            continuation, share = best
            prob *= share
            draft.extend(continuation)
            key = continuation[-1]
            if is_lattice_path:
                from_lattice = len(continuation)
        del draft[limit:]
        return from_lattice
