"""Per-request state of the lookahead proposer, keyed by request id and bounded: it is
created when a request first decodes, freed when the request finishes, is aborted or
is preempted, and rebuilt from the context when a preempted request resumes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.budget import sampling_class
from vllm_lookahead.lookahead.hindsight import Hindsight
from vllm_lookahead.lookahead.options import LookaheadOptions, request_overrides
from vllm_lookahead.lookahead.sources.draft import Draft
from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.worker import request_support, runner_state

logger = get_logger(__name__)

#: Adaptive draft length (``adaptive_draft_length``): growth after a fully accepted
#: draft and slack over the accepted count after a rejection. Chosen by replaying
#: SmolLM2 generations (benchmarks/replay/) for the best compression per draft token.
DRAFT_LIMIT_GROWTH = 8
DRAFT_LIMIT_MARGIN = 3
#: Per-step decay of a request's first-token acceptance counts (``cost_aware_drafts``):
#: about its last 10 proposed drafts, checked in hindsight, estimate its rate.
ACCEPTANCE_DECAY = 0.9
#: Pseudo-drafts at the worker's rate behind a request's first-token rate.
FIRST_TOKEN_PRIOR_WEIGHT = 2.0


@dataclass
class RequestState:
    pool: NgramPool
    prompt_len: int
    next_ngram_start: int  # context positions before this already fed the pool
    num_seen: int = 0  # context tokens read so far
    output: list[int] = field(default_factory=list)  # for the corpus when finished
    pending_token: int = -1  # last context token when the draft below was proposed
    draft: list[int] = field(default_factory=list)
    draft_origin: Draft | None = None  # where ``draft``'s tokens came from
    max_draft: int = 0  # K, the request's own lower bound (extra_args), or 0 (undrafted)
    min_tokens_end: int = 0  # context length where min_tokens is reached (0: none)
    draft_min_prob: float = 0.0  # the option, or the request's own value
    draft_limit: int = 0  # current draft length bound (adaptive), <= max_draft
    sampling_class: int = 0  # which worker-wide acceptance estimates it uses (budget.py)
    # target's top-k (ids, log-probs) per position after the bonus token, from the
    # Jacobi positions past the last rejection (``rescoring_top_k``)
    lattice: tuple[list[list[int]], list[list[float]]] | None = None
    # proposed drafts whose first token the generated text settled (``hindsight.py``,
    # also drafts the cut dropped), decayed: the sum of the worker's estimates of their
    # first tokens when proposed, and how many were confirmed
    first_expected: float = 0.0
    first_confirmed: float = 0.0
    hindsight: Hindsight = field(default_factory=Hindsight)
    # proposed drafts the cut dropped whole in a row, and steps left in the rest from
    # drafting they earned (``rests.py``)
    whole_drops: int = 0
    rest_left: int = 0
    # tree drafts (``tree_candidates``, ``tree_window``): ``draft`` is the main chain,
    # the first nodes of the tree; ``tree`` what vLLM was given: (tokens, parents) of
    # ``[pending_token] + nodes``
    tree_ok: bool = False  # the request's sampling parameters allow trees
    tree_candidates: int = 0  # G and W: the options, or the request's own lower bounds
    tree_window: int = 0
    tree: tuple[list[int], np.ndarray] | None = None
    window: list[list[int]] | None = None  # Jacobi window levels, level 0 first
    # per window column of the last tree: (column, node of its key, its last node)
    window_columns: list[tuple[int, int, int]] = field(default_factory=list)

    def drop_tree(self) -> None:
        """The next pass verifies ``draft`` alone: no tree, no window columns to slide."""
        self.tree, self.window_columns = None, []

    def first_token_rate(self, estimate: float) -> float:
        """Chance that the first draft token is accepted: the worker's ``estimate`` for
        the token's calibration class, scaled by how the request's own first tokens
        fared against the estimates they had when proposed (smoothed by
        ``FIRST_TOKEN_PRIOR_WEIGHT`` pseudo-drafts that met theirs). The class says
        how sure the source was (a long unanimous match, a pool guess seen once); the
        request's record says how predictable its text is, so that a request that is
        rarely right stays below the break-even rate of expensive tokens."""
        weight = FIRST_TOKEN_PRIOR_WEIGHT * estimate
        if weight + self.first_expected <= 0:
            return estimate
        return min(1.0, estimate * (self.first_confirmed + weight)
                   / (self.first_expected + weight))

    def count_first_token(self, confirmed: bool, estimate: float) -> None:
        """A proposed draft's first token, estimated at ``estimate``, was settled."""
        self.first_expected = ACCEPTANCE_DECAY * self.first_expected + estimate
        self.first_confirmed = ACCEPTANCE_DECAY * self.first_confirmed + confirmed

    def adapt_draft_limit(self, accepted: int) -> None:
        """Bound the next draft by the last step's outcome (K stays the maximum).

        A fully accepted draft raises the bound by ``DRAFT_LIMIT_GROWTH``; a rejection
        sets it to the accepted count plus ``DRAFT_LIMIT_MARGIN``, so copied spans get
        long drafts and free text does not pay for tokens that are rarely accepted.
        """
        if accepted >= len(self.draft):
            self.draft_limit = min(self.max_draft, self.draft_limit + DRAFT_LIMIT_GROWTH)
        else:
            self.draft_limit = min(self.max_draft, accepted + DRAFT_LIMIT_MARGIN)

    def read_context(self, tokens: np.ndarray, num_tokens: int, ngram_size: int) -> None:
        """Record the new output tokens and add the n-grams completed since last step."""
        first = min(self.next_ngram_start, self.num_seen)
        chunk = tokens[first:num_tokens].tolist()
        output_start = max(self.num_seen, self.prompt_len)
        self.output.extend(chunk[output_start - first :])
        self.num_seen = num_tokens
        stop = num_tokens - ngram_size + 1
        if stop > self.next_ngram_start:
            skip = self.next_ngram_start - first
            self.pool.add_ngrams(chunk[skip:], stop - self.next_ngram_start)
            self.next_ngram_start = stop
        self.pending_token = int(tokens[num_tokens - 1])


@dataclass
class DecodingRows:
    """A step's decoding requests, in batch-row order (prompt chunks draft nothing): what
    reading the last pass found and what the next drafts are planned for."""

    rows: list[int] = field(default_factory=list)  # input-batch rows
    req_ids: list[str] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)

    def add(self, row: int, req_id: str, state: RequestState) -> None:
        self.rows.append(row)
        self.req_ids.append(req_id)
        self.states.append(state)


class RequestStates:
    """Every active request's state, by request id."""

    def __init__(self, options: LookaheadOptions, num_speculative_tokens: int):
        self.options = options
        self.num_speculative_tokens = num_speculative_tokens
        self._states: dict[str, RequestState] = {}
        #: requests served without drafts for their sampling parameters (counted when
        #: they first decode, again after a preemption)
        self.undrafted = 0

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self):
        return iter(self._states)

    def get(self, req_id: str) -> RequestState | None:
        return self._states.get(req_id)

    def pool_entries(self) -> int:
        return sum(state.pool.num_entries for state in self._states.values())

    def state_for(self, runner: Any, req_id: str, row: int) -> RequestState:
        """The request's state, created with its own overrides on its first decode."""
        state = self._states.get(req_id)
        if state is None:
            opts = self.options
            pool = NgramPool(opts.ngram_size, opts.pool_max_per_key, opts.pool_max_keys)
            prompt_len = runner_state.num_prompt_tokens(runner, row)
            first = 0 if opts.pool_from_prompt else prompt_len
            state = self._states[req_id] = RequestState(pool, prompt_len, first)
            overrides = self._overrides(runner, req_id)
            state.max_draft = overrides.get("num_speculative_tokens",
                                            self.num_speculative_tokens)
            state.draft_min_prob = overrides.get("draft_min_prob", opts.draft_min_prob)
            params = runner_state.sampling_params(runner, req_id)
            if request_support.undrafted_parameter(params) is not None:
                state.max_draft = 0  # vLLM's verifier would not apply it to drafts
                self.undrafted += 1
            state.min_tokens_end = request_support.min_tokens_end(params, prompt_len)
            state.draft_limit = state.max_draft
            state.sampling_class = sampling_class(params)
            if opts.tree_drafts:
                state.tree_ok = runner_state.allows_trees(params)
            state.tree_candidates = overrides.get("tree_candidates", opts.tree_candidates)
            state.tree_window = overrides.get("tree_window", opts.tree_window)
        return state

    def _overrides(self, runner: Any, req_id: str) -> dict[str, Any]:
        """The request's ``extra_args`` overrides; admission already rejected bad ones
        (``engine_config.py``), so a bad one here means that check is missing: it is
        ignored."""
        try:
            return request_overrides(runner_state.extra_args(runner, req_id),
                                     self.num_speculative_tokens, self.options)
        except ValueError as exc:
            logger.warning("vllm-lookahead: request %s: %s; using the server's options",
                           req_id, exc)
            return {}

    def remove(self, finished: Iterable[str], preempted: Iterable[str]) -> list[list[int]]:
        """Free the requests' state; the finished (or aborted) ones' outputs."""
        outputs = []
        for req_id in finished:
            state = self._states.pop(req_id, None)
            if state is not None:
                outputs.append(state.output)
        for req_id in preempted:
            self._states.pop(req_id, None)
        return outputs

    def drop_forgotten(self, live: Any) -> None:
        """Safety net behind ``remove``: nothing outlives the runner's state."""
        for req_id in [r for r in self._states if r not in live]:
            del self._states[req_id]
