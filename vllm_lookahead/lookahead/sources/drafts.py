"""A step's main drafts from the sources (``draft.Draft`` records where their tokens
came from).

Other responses (the corpus, finished and live) are searched for the context's suffix
from two tokens, and from its last token alone where the request's own pool has no
continuation of it: sampled text often ends in a token the request has not written
before, and the responses before it tell what tends to follow (what vLLM's `suffix`
drafts from its global tree; replayed at T 1.0 this took lookahead's drafted passes
from 0.41 to 0.50, run (eq)). Where the context matches too, another response drafts
only if its match is ``CORPUS_MATCH_MARGIN`` tokens longer. The corpus's measured
per-token acceptance bounds how far its continuation goes, never its first token: that
one is the cost-aware cut's to judge, by its class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.context import batch_suffix_match, warm_up_suffix_match
from vllm_lookahead.lookahead.sources.corpus import (
    LiveResponses,
    ResponseCorpus,
    warm_up_corpus,
)
from vllm_lookahead.lookahead.sources.draft import Draft
from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.sources.rescoring import Lattice, rescored
from vllm_lookahead.lookahead.sources.support import SEEN_ONCE, support_bin

#: How much longer another response's match must be than the context's own (of two
#: tokens or more) to draft instead of it: a request's own text predicts it better than
#: other responses matching as long. Replayed over seven traces (run (ez)), 4 against 1
#: took simulated tokens/s from -0.2 % to +2.2 % (+0.6 % on average); never using
#: them where the context matches lost 2.9-5.8 % on requests asked twice.
CORPUS_MATCH_MARGIN = 4


class DraftingRequest(Protocol):
    """What drafting reads of a request: the sources sit below the request state
    (``state.RequestState``), which holds their pool."""

    pool: NgramPool
    pending_token: int  # the draft continues it
    lattice: Lattice | None  # the last pass's Jacobi lattice (draft rescoring)


@dataclass
class TokenAcceptance:
    """A source's per-token acceptance: of its draft tokens that verification reached
    (every token before them accepted), the share accepted. Counts decay by ``DECAY``
    per verified draft, so the rate follows the text; the start is a prior of
    ``accepted / reached``."""

    DECAY = 0.98

    accepted: float = 3.0
    reached: float = 4.0

    @property
    def rate(self) -> float:
        return self.accepted / self.reached

    def add(self, reached: int, accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.reached = self.reached * self.DECAY + reached

    def tokens_above(self, min_prob: float) -> int:
        """How many of the source's tokens a draft holds before its probability
        estimate (the rate per token) falls below ``min_prob``."""
        if min_prob <= 0 or self.rate >= 1:
            return 1 << 30
        if self.rate <= 0:
            return 0
        return int(math.log(min_prob) / math.log(self.rate) + 1e-9)


class DraftSources:
    """Builds each step's main drafts; holds the corpus and the batch's match buffers."""

    def __init__(self, options: LookaheadOptions, max_draft: int, max_rows: int,
                 vocab_size: int, recycle_top_k: int):
        self.options = options
        self.corpus = ResponseCorpus(options.corpus_tokens)
        #: the responses being generated, for the other requests (the corpus's source)
        self.live = LiveResponses(options.live_corpus_tokens if options.corpus_tokens else 0,
                                  max_rows)
        self.corpus_acceptance = TokenAcceptance()
        #: Token Recycling's table (None: off; the proposer drops it where trees end off
        #: and ``recycle_top_k`` is ``auto``)
        self.recycled = RecycledTopK(vocab_size, recycle_top_k) if recycle_top_k else None
        self._match_out = np.zeros((max_rows, max_draft), dtype=np.int32)
        self._match_bins = np.zeros((max_rows, max_draft), dtype=np.int8)
        self._match_count = np.zeros(max_rows, dtype=np.int64)
        self._match_len = np.zeros(max_rows, dtype=np.int64)
        self._match_prob = np.zeros(max_rows, dtype=np.float64)
        warm_up_suffix_match()
        warm_up_corpus()
        support_bin(1, 1, 1)  # as the pool calls it: compiled before the first request

    def draft(self, rows: list[int], req_ids: list[str], states: list[DraftingRequest],
              token_ids_cpu: np.ndarray, num_tokens: np.ndarray, limits: np.ndarray,
              min_prob: np.ndarray) -> list[Draft]:
        """One draft per row (of at most its limit), in order; each stops where its
        probability estimate would fall below its ``min_prob`` (the request's
        ``draft_min_prob``, or 0 where every slot up to the limit is computed anyway)."""
        opts = self.options
        batch_suffix_match(
            token_ids_cpu, np.asarray(rows, dtype=np.int64), num_tokens, limits,
            opts.suffix_match_min, opts.suffix_match_max, min_prob, self._match_out,
            self._match_bins, self._match_count, self._match_len, self._match_prob,
        )
        drafts = []
        for b, (row, req_id, state) in enumerate(zip(rows, req_ids, states)):
            limit, least = int(limits[b]), float(min_prob[b])
            draft = self._matched_continuation(b, req_id, state, token_ids_cpu[row],
                                               int(num_tokens[b]), limit, least)
            draft.from_lattice, prob = self._fill_from_pool(state, draft, limit, least,
                                                            self._match_estimate(b, draft))
            draft.from_pool = len(draft.tokens) - draft.matched
            if self.recycled is not None and len(draft.tokens) < limit:
                recycled, _ = self.recycled.chain(
                    draft.tokens[-1] if draft.tokens else state.pending_token,
                    limit - len(draft.tokens), prob, least)
                draft.tokens.extend(recycled)
                draft.bins.extend([SEEN_ONCE] * len(recycled))
            drafts.append(draft)
        return drafts

    def _matched_continuation(self, b: int, req_id: str, state: DraftingRequest,
                              tokens: np.ndarray, num_tokens: int, limit: int,
                              min_prob: float) -> Draft:
        """The context's own match (batch slot ``b``) or one ``CORPUS_MATCH_MARGIN``
        tokens longer in the corpus of finished responses or in the other requests' live
        ones (any, where the context has none; of the last token alone where the
        request's pool would not continue it either), as long as the corpus's measured
        acceptance keeps its tokens after the first above ``min_prob``."""
        opts = self.options
        count = self._match_count[b]
        own, own_bins = self._match_out[b, :count].tolist(), self._match_bins[b, :count].tolist()
        own_length = int(self._match_len[b])
        needed = own_length + CORPUS_MATCH_MARGIN if own_length else 1
        if needed <= opts.suffix_match_max and (len(self.corpus) or len(self.live)):
            suffix = tokens[max(0, num_tokens - opts.suffix_match_max) : num_tokens].tolist()
            pool_continues = bool(state.pool.candidates(state.pending_token,
                                                        opts.guess_set_size))
            shortest = max(opts.suffix_match_min, 2) if pool_continues else 1
            bounds = (shortest, opts.suffix_match_max,
                      min(limit, max(1, self.corpus_acceptance.tokens_above(min_prob))),
                      min_prob)
            length, continuation, bins = max(  # ties: one with a continuation, then finished
                self.corpus.match(suffix, *bounds), self.live.match(req_id, suffix, *bounds),
                key=lambda found: (found[0], bool(found[1])))
            if length >= needed and continuation:
                return Draft(continuation, "corpus", len(continuation), bins=bins)
        return Draft(own, "context", len(own), bins=own_bins)

    def _match_estimate(self, b: int, draft: Draft) -> float:
        """Probability estimate of the match: the context's continuation frequencies,
        the corpus's measured acceptance per token."""
        if not draft.tokens:
            return 1.0
        if draft.match_source == "corpus":
            return self.corpus_acceptance.rate ** len(draft.tokens)
        return float(self._match_prob[b])

    def learn(self, draft: Draft, accepted: int) -> None:
        """Verification accepted the first ``accepted`` tokens of ``draft``."""
        if draft.match_source != "corpus":
            return
        reached = draft.tokens_by_source(accepted + 1)["corpus"]
        if reached:
            self.corpus_acceptance.add(reached, draft.tokens_by_source(accepted)["corpus"])

    def _fill_from_pool(self, state: DraftingRequest, draft: Draft, limit: int, min_prob: float,
                        prob: float) -> tuple[int, float]:
        """Extend ``draft`` towards ``limit`` tokens by chained lookups in the request's
        pool while the draft's probability estimate stays at or above ``min_prob``.
        Returns how many of the added tokens are the lattice's path (draft rescoring),
        and the draft's probability estimate."""
        opts = self.options
        from_lattice = 0
        tokens = draft.tokens
        key = tokens[-1] if tokens else state.pending_token
        while len(tokens) < limit:
            if not tokens and state.lattice is not None:
                best, is_lattice_path = rescored(state.pool, state.lattice, key,
                                                 opts.guess_set_size, opts.ngram_size)
            else:
                best, is_lattice_path = state.pool.best(key, opts.guess_set_size), False
            if best is None or prob * best[1] < min_prob:
                break
            continuation, share, support = best
            prob *= share
            tokens.extend(continuation)
            draft.bins.extend([SEEN_ONCE if is_lattice_path else support] * len(continuation))
            key = continuation[-1]
            if is_lattice_path:
                from_lattice = len(continuation)
        del tokens[limit:], draft.bins[limit:]
        return from_lattice, prob
