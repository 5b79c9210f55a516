"""The lookahead proposer: linear drafts from context matches and a Jacobi-fed n-gram pool.

vLLM verifies one linear draft per request per step. Each draft is built from
(1) the most frequent continuation of the longest repeat of the context's suffix,
in the request's own prompt and output or in the responses of earlier requests
(whichever match is longer), (2) chained lookups in the request's n-gram pool to
fill the remaining slots. A draft ends where its probability estimate falls below
``draft_min_prob`` or at the request's adaptive length bound: every draft token
costs target compute, so tokens unlikely to be accepted are not proposed; under
load, drafts are cut further to what the step's compute affords (``budget.py``).
Each verification pass doubles as one Jacobi iteration: the target's prediction at
every draft position, including those after the first rejection, feeds the pool.

vLLM calls ``propose`` with batch rows, not requests; per-request state is keyed by
request id through the model runner bound by ``worker.py``, freed when the request
finishes, is aborted or is preempted, and rebuilt from the context when a preempted
request resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_lookahead import worker
from vllm_lookahead.budget import (
    AcceptanceByDepth,
    StepCostModel,
    TreeYield,
    affordable_draft_lengths,
)
from vllm_lookahead.metrics import SnapshotWriter
from vllm_lookahead.options import (
    ADDITIONAL_CONFIG_KEY,
    LookaheadOptions,
    request_overrides,
)
from vllm_lookahead.pool import (
    Continuation,
    NgramPool,
    ResponseCorpus,
    batch_suffix_match,
    warm_up_suffix_match,
)
from vllm_lookahead.tree import TreeBuilder, path_by_tokens

logger = logging.getLogger(__name__)


#: Adaptive draft length (``adaptive_draft_length``): growth after a fully accepted
#: draft and slack over the accepted count after a rejection. Chosen by replaying
#: SmolLM2 generations (benchmarks/replay.py) for the best compression per draft token.
DRAFT_LIMIT_GROWTH = 8
DRAFT_LIMIT_MARGIN = 3
#: What a tree costs, in linear draft tokens (``tree_*`` options): each node off the
#: first chain, and each request with a tree (root block copies, path writes, the kernel
#: reading the prefix once more per branch). benchmarks/README.md, runs (v) and (w),
#: SmolLM2-135M on 2 CPU cores: a draft token ~1.1 ms; a tree of 24 nodes 4-9 ms more
#: than a linear draft of 24; in the batch-1 run a tree node cost ~1.7 ms of step time.
TREE_NODE_COST = 2
TREE_ROW_COST = 6
#: A request whose trees do not pay still gets one every this many passes, so that the
#: trees' yield keeps being measured.
TREE_PROBE_INTERVAL = 16
#: Per-step decay of a request's first-token acceptance counts (``cost_aware_drafts``):
#: about its last 10 verified drafts estimate its rate.
ACCEPTANCE_DECAY = 0.9


@dataclass
class _RequestState:
    pool: NgramPool
    prompt_len: int
    next_ngram_start: int  # context positions before this already fed the pool
    num_seen: int = 0  # context tokens read so far
    output: list[int] = field(default_factory=list)  # for the corpus when finished
    pending_token: int = -1  # last context token when the draft below was proposed
    draft: list[int] = field(default_factory=list)
    max_draft: int = 0  # K, or the request's own lower bound (extra_args)
    draft_min_prob: float = 0.0  # the option, or the request's own value
    draft_limit: int = 0  # current draft length bound (adaptive), <= max_draft
    # target's top-k (ids, log-probs) per position after the bonus token, from the
    # Jacobi positions past the last rejection (``rescoring_top_k``)
    lattice: tuple[list[list[int]], list[list[float]]] | None = None
    # decayed counts of verified drafts and of those whose first token was accepted
    verified_drafts: float = 0.0
    first_accepted: float = 0.0
    # tree drafts (``tree_candidates``, ``tree_window``): ``draft`` is the main chain,
    # the first nodes of the tree; ``tree`` what vLLM was given: (tokens, parents) of
    # ``[pending_token] + nodes``
    tree_ok: bool = False  # the request's sampling parameters allow trees
    tree_candidates: int = 0  # G and W: the options, or the request's own lower bounds
    tree_window: int = 0
    tree: tuple[list[int], np.ndarray] | None = None
    passes_without_tree: int = 0  # since the last tree (probing when trees do not pay)
    window: list[list[int]] | None = None  # Jacobi window levels, level 0 first
    # per window column of the last tree: (column, node of its key, its last node)
    window_columns: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def first_token_rate(self) -> float:
        """Chance that the first draft token is accepted (add-one smoothed)."""
        return (self.first_accepted + 1) / (self.verified_drafts + 2)


@dataclass
class ProposerStats:
    """Counters read by benchmarks (through ``LLM.collective_rpc``) and tests."""

    steps: int = 0
    seconds: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    cut_tokens: int = 0  # draft tokens dropped because the step could not afford them
    suffix_tokens: int = 0
    corpus_tokens: int = 0
    pool_tokens: int = 0
    lattice_tokens: int = 0  # from the lattice's top path (draft rescoring chose it)
    tree_nodes: int = 0  # verified beside the main drafts (tree candidates and window)
    tree_accepted: int = 0  # accepted tokens that were tree nodes off the main draft
    tree_branches: int = 0  # runs off the first chain, verified as sequences of their own
    tree_fallbacks: int = 0  # trees verified as linear drafts (scratch blocks ran out)
    harvested_ngrams: int = 0
    generated_tokens: int = 0  # by decoding requests, over
    request_passes: int = 0  # their target forward passes (S = the ratio)
    active_requests: int = 0
    pool_ngrams: int = 0  # held by active requests' pools
    corpus_size: int = 0  # tokens held by the response corpus


@dataclass
class _Verified:
    """One row of a verification pass: the draft, the target's argmax after each input
    position (``[pending] + draft``, the last one the bonus token) and, if captured,
    the target's top-k ids and log-probabilities at those positions but the last."""

    draft: list[int]
    predictions: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None

    def lattice_after(self, accepted: int) -> tuple[list[list[int]], list[list[float]]] | None:
        """Columns for the tokens after the bonus token: the positions past the rejected
        draft token, where the target predicted with the rejected tokens as context
        (Jacobi guesses); None after a full acceptance or without a capture."""
        if self.top_ids is None or accepted + 1 >= len(self.draft):
            return None
        return self.top_ids[accepted + 1 :], self.top_logprobs[accepted + 1 :]


class LookaheadProposer:
    """vLLM ``custom_class`` drafter for ``{"method": "lookahead"}``."""

    def __init__(self, vllm_config: Any):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        extra = dict((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))
        extra.pop("method", None)
        self.options = LookaheadOptions.from_dict(extra)
        self._stats = ProposerStats()
        self._snapshots = SnapshotWriter(vllm_config, worker.worker_rank())
        self._runner: Any = None
        self._states: dict[str, _RequestState] = {}
        self.capture_top_k = self.options.rescoring_top_k  # read by worker.py
        self._capture: worker.VerificationCapture | None = None
        self._corpus = ResponseCorpus(self.options.corpus_tokens)
        self._cost_model = StepCostModel()
        self._depth_acceptance = AcceptanceByDepth(self.num_speculative_tokens)
        self._tree_yield = TreeYield()
        self._step_start: tuple[float, int] | None = None
        max_rows = vllm_config.scheduler_config.max_num_seqs
        self._match_out = np.zeros((max_rows, self.num_speculative_tokens), dtype=np.int32)
        self._match_count = np.zeros(max_rows, dtype=np.int64)
        self._match_len = np.zeros(max_rows, dtype=np.int64)
        self._match_prob = np.zeros(max_rows, dtype=np.float64)
        warm_up_suffix_match()

    @property
    def stats(self) -> ProposerStats:
        return dataclasses.replace(
            self._stats,
            active_requests=len(self._states),
            pool_ngrams=sum(state.pool.num_entries for state in self._states.values()),
            corpus_size=len(self._corpus),
        )

    # -- hooks called by vLLM and worker.py ------------------------------------------

    def bind_model_runner(self, runner: Any) -> None:
        self._runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model; called by vLLM once the target is loaded, so check binding
        and, with tree drafts on, that the target's attention can mask trees."""
        worker.check_bound(self._runner)
        if self.options.tree_candidates or self.options.tree_window:
            worker.check_tree_attention(self._runner)

    def on_verification(self, capture: worker.VerificationCapture) -> None:
        self._capture = capture

    def on_step_start(self, num_scheduled_tokens: int, decode_only: bool) -> None:
        """The runner starts a step: its time until ``propose`` is the pass's cost.

        Only decode steps are timed: a prompt token costs more than a draft token
        (attention over the whole prompt), so prefill steps would overstate a draft
        token's cost.
        """
        self._step_start = (time.perf_counter(), num_scheduled_tokens) if decode_only else None

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        """Free state; a finished (or aborted) request's output joins the corpus."""
        for req_id in finished:
            state = self._states.pop(req_id, None)
            if state is not None:
                self._corpus.add(state.output)
        for req_id in preempted:
            self._states.pop(req_id, None)
        if self._snapshots.due() or not self._states:
            self._snapshots.write(self.stats)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        start = time.perf_counter()
        if self._step_start is not None:
            step_start, num_scheduled = self._step_start
            self._cost_model.add(num_scheduled, start - step_start)
            self._step_start = None
        req_ids = worker.request_ids(self._runner)
        num_rows = len(sampled_token_ids)
        self._drop_forgotten()
        capture, self._capture = self._capture, None
        verified = self._verified_rows(capture, num_rows)

        rows, states = [], []
        verified_lengths, accepted_counts = [], []  # this step's verifications
        for row in range(num_rows):
            if not sampled_token_ids[row]:  # partial prefill chunk: nothing to draft yet
                continue
            state = self._state_for(req_ids[row], row)
            num_tokens = int(num_tokens_no_spec[row])
            accepted = len(sampled_token_ids[row]) - 1
            self._stats.generated_tokens += accepted + 1
            self._stats.request_passes += 1
            state.lattice = None
            main_accepted = self._main_draft_accepted(state, sampled_token_ids[row])
            tree_nodes = len(state.tree[0]) - 1 - len(state.draft) if state.tree else 0
            self._tree_yield.add_pass(accepted + 1, tree_nodes, accepted - main_accepted)
            if row in verified and self._is_our_draft(state, verified[row].draft):
                if self.options.harvest_jacobi:
                    self._harvest(state, verified[row], main_accepted)
                if self.capture_top_k:
                    state.lattice = verified[row].lattice_after(accepted)
                if state.window_columns:
                    self._slide_window(state, verified[row].predictions)
            # by all accepted tokens: a branch that won says the text is predictable now,
            # and must not shrink the next main draft to its own few accepted tokens
            self._adapt_draft_limit(state, accepted)
            if state.draft:
                self._count_acceptance(state, accepted)
                verified_lengths.append(len(state.draft))
                accepted_counts.append(main_accepted)
            self._read_context(state, token_ids_cpu[row], num_tokens)
            state.pending_token = int(token_ids_cpu[row, num_tokens - 1])
            rows.append(row)
            states.append(state)

        if self.options.cost_aware_drafts:
            self._depth_acceptance.add(verified_lengths, accepted_counts)
        drafts = self._draft(rows, states, num_tokens_no_spec, token_ids_cpu, num_rows)
        self._stats.steps += 1
        self._stats.seconds += time.perf_counter() - start
        if self._snapshots.due():
            self._snapshots.write(self.stats)
        return drafts

    # -- per-request state -------------------------------------------------------------

    def _drop_forgotten(self) -> None:
        """Safety net behind ``on_requests_removed``: nothing outlives the runner's state."""
        live = worker.live_request_ids(self._runner)
        for req_id in [r for r in self._states if r not in live]:
            del self._states[req_id]

    def _state_for(self, req_id: str, row: int) -> _RequestState:
        state = self._states.get(req_id)
        if state is None:
            opts = self.options
            pool = NgramPool(opts.ngram_size, opts.pool_max_per_key, opts.pool_max_keys)
            prompt_len = worker.num_prompt_tokens(self._runner, row)
            first = 0 if opts.pool_from_prompt else prompt_len
            state = self._states[req_id] = _RequestState(pool, prompt_len, first)
            overrides = self._request_overrides(req_id)
            state.max_draft = overrides.get("num_speculative_tokens",
                                            self.num_speculative_tokens)
            state.draft_min_prob = overrides.get("draft_min_prob", opts.draft_min_prob)
            state.draft_limit = state.max_draft
            if opts.tree_candidates or opts.tree_window:
                state.tree_ok = _allows_trees(worker.sampling_params(self._runner, req_id))
            state.tree_candidates = overrides.get("tree_candidates", opts.tree_candidates)
            state.tree_window = overrides.get("tree_window", opts.tree_window)
        return state

    def _request_overrides(self, req_id: str) -> dict[str, Any]:
        """The request's ``extra_args`` overrides; admission already rejected bad ones
        (``plugin.py``), so a bad one here means that check is missing: it is ignored."""
        try:
            return request_overrides(worker.extra_args(self._runner, req_id),
                                     self.num_speculative_tokens, self.options)
        except ValueError as exc:
            logger.warning("vllm-lookahead: request %s: %s; using the server's options",
                           req_id, exc)
            return {}

    def _adapt_draft_limit(self, state: _RequestState, accepted: int) -> None:
        """Bound the next draft by the last step's outcome (K stays the maximum).

        A fully accepted draft raises the bound by ``DRAFT_LIMIT_GROWTH``; a rejection
        sets it to the accepted count plus ``DRAFT_LIMIT_MARGIN``, so copied spans get
        long drafts and free text does not pay for tokens that are rarely accepted.
        """
        if not self.options.adaptive_draft_length or not state.draft:
            return
        if accepted >= len(state.draft):
            state.draft_limit = min(state.max_draft, state.draft_limit + DRAFT_LIMIT_GROWTH)
        else:
            state.draft_limit = min(state.max_draft, accepted + DRAFT_LIMIT_MARGIN)

    @staticmethod
    def _count_acceptance(state: _RequestState, accepted: int) -> None:
        state.verified_drafts = ACCEPTANCE_DECAY * state.verified_drafts + 1
        state.first_accepted = ACCEPTANCE_DECAY * state.first_accepted + (accepted > 0)

    def _read_context(self, state: _RequestState, tokens: np.ndarray, num_tokens: int) -> None:
        """Record the new output tokens and add the n-grams completed since last step."""
        first = min(state.next_ngram_start, state.num_seen)
        chunk = tokens[first:num_tokens].tolist()
        output_start = max(state.num_seen, state.prompt_len)
        state.output.extend(chunk[output_start - first :])
        state.num_seen = num_tokens
        stop = num_tokens - self.options.ngram_size + 1
        if stop > state.next_ngram_start:
            skip = state.next_ngram_start - first
            state.pool.add_ngrams(chunk[skip:], stop - state.next_ngram_start)
            state.next_ngram_start = stop

    # -- Jacobi harvest and lattice from the last verification pass ------------------

    def _verified_rows(
        self, capture: worker.VerificationCapture | None, num_rows: int
    ) -> dict[int, _Verified]:
        if capture is None or not (self.options.harvest_jacobi or self.capture_top_k
                                   or self.options.tree_window):
            return {}
        if len(capture.num_draft_tokens) != num_rows:  # e.g. vLLM's warm-up dummy run
            return {}
        drafts = capture.draft_token_ids.tolist()
        argmax = capture.target_argmax.tolist()
        bonus = capture.bonus_token_ids.tolist()
        top_ids = top_logprobs = None
        if capture.target_top_ids is not None:
            top_ids = capture.target_top_ids.tolist()
            top_logprobs = capture.target_top_logprobs.tolist()
        rows, offset = {}, 0
        for row, count in enumerate(capture.num_draft_tokens):
            if count:
                end = offset + count
                rows[row] = _Verified(
                    drafts[offset:end], argmax[offset:end] + [bonus[row]],
                    None if top_ids is None else top_ids[offset:end],
                    None if top_logprobs is None else top_logprobs[offset:end])
            offset += count
        return rows

    @staticmethod
    def _is_our_draft(state: _RequestState, verified: list[int]) -> bool:
        """False for a stale capture (the draft verified is not the one proposed)."""
        proposed = state.tree[0][1:] if state.tree else state.draft
        return proposed[: len(verified)] == verified

    def _main_draft_accepted(self, state: _RequestState, emitted: list[int]) -> int:
        """Accepted tokens of the main draft (all accepted tokens for a linear draft)."""
        if state.tree is None:
            return len(emitted) - 1
        tokens, parents = state.tree
        path = path_by_tokens(parents, tokens, emitted)
        on_main = 0
        while on_main < len(path) and path[on_main] == on_main + 1 <= len(state.draft):
            on_main += 1
        self._stats.tree_accepted += len(path) - on_main
        return on_main

    def draft_tree(self, req_id: str, scheduled: list[int]) -> np.ndarray | None:
        """Parents of ``[root] + scheduled`` if the request's draft is a tree (worker.py
        asks when it prepares the step); None verifies it as a linear draft."""
        state = self._states.get(req_id)
        if state is None or state.tree is None:
            return None
        tokens, parents = state.tree
        if tokens[1 : len(scheduled) + 1] != scheduled:
            return None
        return parents[: len(scheduled) + 1]

    def on_tree_planned(self, req_id: str, branches: int | None) -> None:
        """worker.py split the request's tree into ``branches`` extra attention
        sequences, or (None) found no scratch blocks left and verifies it as a linear
        draft: then it is one for the proposer too."""
        if branches is not None:
            self._stats.tree_branches += branches
            return
        self._stats.tree_fallbacks += 1
        state = self._states.get(req_id)
        if state is not None:
            state.tree, state.window_columns = None, []

    def _harvest(self, state: _RequestState, verified: _Verified, accepted: int) -> None:
        """Add n-grams read off the target's predictions (one Jacobi iteration).

        Input position i holds ``[pending] + draft``; ``predictions[i]`` is the
        target's token after it. Windows lying on the accepted output are skipped:
        the context feeds those.
        """
        main = len(state.draft)  # a tree's other nodes are not a chain after them
        predictions = verified.predictions[: main + 1]
        inputs = [state.pending_token, *verified.draft[:main]]
        span = self.options.ngram_size - 1
        harvested = 0
        for i in range(len(inputs) - span + 1):
            if harvested == self.options.window_size:
                break
            if i + span - 1 <= accepted:
                continue
            state.pool.add(inputs[i], tuple(predictions[i : i + span]))
            harvested += 1
        self._stats.harvested_ngrams += harvested

    # -- drafting ----------------------------------------------------------------------

    def _draft(
        self,
        rows: list[int],
        states: list[_RequestState],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        num_rows: int,
    ) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        if not rows:
            return drafts
        rows_arr = np.asarray(rows, dtype=np.int64)
        num_tokens = num_tokens_no_spec[rows_arr].astype(np.int64)
        # never past max_model_len: the bonus token needs a slot too
        limits = np.clip(self.max_model_len - num_tokens - 1, 0, self.num_speculative_tokens)
        np.minimum(limits, [state.draft_limit for state in states], out=limits)
        min_prob = np.array([state.draft_min_prob for state in states])
        opts = self.options
        batch_suffix_match(
            token_ids_cpu, rows_arr, num_tokens, limits, opts.suffix_match_min,
            opts.suffix_match_max, min_prob, self._match_out, self._match_count,
            self._match_len, self._match_prob,
        )
        # per row: (match from the corpus, matched tokens, lattice tokens after them)
        sources: list[tuple[bool, int, int]] = []
        for b, (row, state) in enumerate(zip(rows, states)):
            limit = int(limits[b])
            draft, prob, from_corpus = self._matched_continuation(
                b, token_ids_cpu[row], int(num_tokens[b]), limit)
            matched = len(draft)
            from_lattice = self._fill_from_pool(state, draft, limit, prob)
            drafts[row] = draft
            sources.append((from_corpus, matched, from_lattice))
        free_tokens = self._step_budget()
        if opts.cost_aware_drafts:
            self._cut_to_budget([drafts[row] for row in rows], states, free_tokens)
        main_drafts = [list(drafts[row]) for row in rows]
        if opts.tree_candidates or opts.tree_window:
            self._grow_trees(rows, states, drafts, token_ids_cpu, num_tokens, free_tokens)
        for row, state, main, (from_corpus, matched, from_lattice) in zip(
                rows, states, main_drafts, sources):
            draft = state.draft = main
            if draft:
                matched = min(matched, len(draft))
                from_lattice = min(from_lattice, len(draft) - matched)
                self._stats.drafts += 1
                self._stats.draft_tokens += len(draft)
                if from_corpus:
                    self._stats.corpus_tokens += matched
                else:
                    self._stats.suffix_tokens += matched
                self._stats.lattice_tokens += from_lattice
                self._stats.pool_tokens += len(draft) - matched - from_lattice
        return drafts

    def _step_budget(self) -> float | None:
        """Tokens the step affords for free (``cost_aware_drafts``; None before the cost
        model has samples), as the first tensor-parallel rank timed it: every rank then
        drafts the same trees, and its attention splits the same branches."""
        if not self.options.cost_aware_drafts:
            return math.inf
        model = self._cost_model
        return worker.broadcast_from_first_tp_rank(
            model.free_tokens() if model.has_samples else None)

    def _grow_trees(self, rows: list[int], states: list[_RequestState],
                    drafts: list[list[int]], token_ids_cpu: np.ndarray,
                    num_tokens: np.ndarray, free_tokens: float | None) -> None:
        """Turn each main draft (in ``drafts``, replaced) into a token tree: the main
        draft first, then the pool's most frequent continuations of the last token
        (``tree_candidates``), then the Jacobi window (``tree_window``). Each request
        gets at most its K nodes. Trees are built only while they pay: a tree node must
        yield (accepted tokens off the main drafts per node, measured on this worker) at
        least what a draft token of its cost earns the step; on a GPU, where the cost
        model finds extra tokens nearly free, that is almost always, on a small CPU only
        for text where trees win often. Requests that do not get trees still probe one
        every ``TREE_PROBE_INTERVAL`` passes. With several requests in the step (and
        ``cost_aware_drafts``), trees also take only the tokens the cost model says are
        nearly free, a tree costing ``TREE_ROW_COST`` plus ``TREE_NODE_COST`` per node
        (none before the model has samples), so under load trees shrink to nothing
        before main drafts are cut."""
        opts = self.options
        step_tokens = sum(len(drafts[row]) + 1 for row in rows)
        if free_tokens is None:  # no fit yet: a lone request's step is latency-bound
            free = math.inf if len(rows) == 1 else 0.0
        else:
            free = free_tokens
        pays = self._tree_yield.pays(len(rows), step_tokens, free, TREE_NODE_COST)
        spare = math.inf if len(rows) == 1 else free - step_tokens  # in linear tokens
        for b, (row, state) in enumerate(zip(rows, states)):
            state.tree, state.window_columns = None, []
            state.passes_without_tree += 1
            if not pays and state.passes_without_tree < TREE_PROBE_INTERVAL:
                continue
            main = drafts[row]
            nodes = (spare - TREE_ROW_COST) / TREE_NODE_COST
            cap = min(state.max_draft, self.max_model_len - int(num_tokens[b]) - 1,
                      len(main) + max(0, int(min(nodes, 1 << 30))))
            if not state.tree_ok or cap <= len(main):
                continue
            builder = TreeBuilder(state.pending_token, cap)
            builder.add_chain(main)
            if state.tree_candidates:
                candidates = state.pool.candidates(
                    state.pending_token, max(opts.guess_set_size, state.tree_candidates))
                candidates.sort(key=lambda item: -item[1])  # stable: newest first on ties
                for continuation, _ in candidates[: state.tree_candidates]:
                    builder.add_chain(list(continuation))
            if state.tree_window:
                self._add_window(state, builder, token_ids_cpu[row], int(num_tokens[b]))
            added = builder.num_drafted - len(main)
            if not added:
                state.window_columns = []
            else:
                spare -= TREE_ROW_COST + added * TREE_NODE_COST
                state.passes_without_tree = 0
                self._stats.tree_nodes += added
                state.tree = (builder.tokens, np.array(builder.parents))
                drafts[row] = builder.draft

    def _add_window(self, state: _RequestState, builder: TreeBuilder, context: np.ndarray,
                    num_tokens: int) -> None:
        """Add Lookahead Decoding's window as tree nodes: level 0 is a trunk from the
        root (columns 1..W-1, column 0 is the root itself) and below the trunk node of
        each column hang that column's levels 1..N-2, one position further each. The
        window starts as tokens picked from the prompt (seeded by the prompt, so every
        tensor-parallel rank picks the same)."""
        width, levels = state.tree_window, self.options.ngram_size - 1
        if state.window is None:
            prompt = context[: state.prompt_len]
            rng = np.random.default_rng(zlib.crc32(prompt.astype(np.int64).tobytes()))
            picks = rng.integers(0, num_tokens, size=(levels, width))
            state.window = [[int(context[i]) for i in level] for level in picks]
        window = state.window
        column_roots = [0, *builder.add_chain(window[0][1:])]
        for column, key_node in enumerate(column_roots):
            nodes = builder.add_chain([window[level][column] for level in range(1, levels)],
                                      parent=key_node)
            if len(nodes) < levels - 1:
                break
            state.window_columns.append((column, key_node, nodes[-1]))

    def _slide_window(self, state: _RequestState, predictions: list[int]) -> None:
        """One Jacobi iteration of the window: the target's token after each column's
        last level is that column's new last level, and completes an n-gram (the column's
        level-0 token, its levels 1..N-2, the new token) for the pool; the levels move
        up one (the window advances one position per step, as in the paper)."""
        tokens = state.tree[0]
        window = state.window
        newest = list(window[-1])
        for column, key_node, last_node in state.window_columns:
            if last_node >= len(predictions):  # vLLM scheduled fewer nodes
                continue
            newest[column] = predictions[last_node]
            continuation = tuple(level[column] for level in window[1:]) + (newest[column],)
            state.pool.add(tokens[key_node], continuation)
            self._stats.harvested_ngrams += 1
        state.window = [*window[1:], newest]

    def _cut_to_budget(self, drafts: list[list[int]], states: list[_RequestState],
                       free_tokens: float | None) -> None:
        """Shorten drafts (in place) to the tokens the step's compute affords."""
        if free_tokens is None or math.isinf(free_tokens):
            return
        lengths = np.array([len(draft) for draft in drafts])
        rates = np.array([state.first_token_rate for state in states])
        kept = affordable_draft_lengths(lengths, rates, self._depth_acceptance.survival(),
                                        free_tokens)
        for draft, keep in zip(drafts, kept.tolist()):
            self._stats.cut_tokens += len(draft) - keep
            del draft[keep:]

    def _matched_continuation(
        self, b: int, tokens: np.ndarray, num_tokens: int, limit: int
    ) -> tuple[list[int], float, bool]:
        """The context's own match (batch slot ``b``) or a longer one in the corpus,
        with the draft's probability estimate."""
        opts = self.options
        draft = self._match_out[b, : self._match_count[b]].tolist()
        own_length = self._match_len[b]
        if own_length < opts.suffix_match_max and len(self._corpus):
            suffix = tokens[max(0, num_tokens - opts.suffix_match_max) : num_tokens].tolist()
            length, continuation = self._corpus.match(
                suffix, max(opts.suffix_match_min, 2), opts.suffix_match_max, limit)
            if length > own_length:
                return continuation, 1.0, True
        return draft, float(self._match_prob[b]) if draft else 1.0, False

    def _fill_from_pool(
        self, state: _RequestState, draft: list[int], limit: int, prob: float
    ) -> int:
        """Extend ``draft`` towards ``limit`` tokens by chained lookups in the request's
        pool while the draft's probability estimate stays at or above ``draft_min_prob``.
        Returns how many of the added tokens are the lattice's path (draft rescoring)."""
        from_lattice = 0
        key = draft[-1] if draft else state.pending_token
        while len(draft) < limit:
            if not draft and state.lattice is not None:
                best, is_lattice_path = self._rescored(state, key)
            else:
                best, is_lattice_path = state.pool.best(key, self.options.guess_set_size), False
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

    def _rescored(self, state: _RequestState, key: int
                  ) -> tuple[tuple[Continuation, float] | None, bool]:
        """The best continuation of ``key`` (the bonus token) by draft rescoring.

        Candidates: the pool's entries for ``key`` and the lattice's top path. Each is
        scored by its n-gram frequency in the pool (add-one smoothed) times the
        probability the lattice gives its tokens (a token outside a column's top-k
        gets that column's lowest listed probability); the estimate passed on is the
        candidate's share of the scores. Returns (candidate, estimate), from the lattice.
        """
        ids, logprobs = state.lattice
        counts = dict(state.pool.candidates(key, self.options.guess_set_size))
        top_path = tuple(column[0] for column in ids[: self.options.ngram_size - 1])
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
        return (best, share), best == top_path and not from_pool


def _allows_trees(params: Any) -> bool:
    """Tree drafts need every node's target distribution to depend on its ancestors
    only: vLLM applies penalties, bad words, min_tokens, structured output and
    logprobs by position in the flat draft, so such requests get linear drafts."""
    if params is None:
        return False
    return (params.logprobs is None and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and not params.bad_words and not params.min_tokens
            and getattr(params, "structured_outputs", None) is None)
