"""Planning a step's drafts: each decoding request's bound, what the step affords
(``budget.StepPlan``), the sources' main drafts (``sources/``) of the requests not
resting (``rests.py``), the cost-aware cut (``cut.py``), then trees (``trees.py``) or
drafts filled to K (``uniform_drafts.py``).
Each main draft is kept, with where its tokens came from, for the next pass's
feedback."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vllm_lookahead.lookahead.budget import StepPlan, WorkerEstimates
from vllm_lookahead.lookahead.cut import CostAwareCut
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.rests import DraftRests
from vllm_lookahead.lookahead.sources.draft import Draft
from vllm_lookahead.lookahead.sources.drafts import DraftSources
from vllm_lookahead.lookahead.state import DecodingRows, RequestState
from vllm_lookahead.lookahead.step_cost import StepCostModel
from vllm_lookahead.lookahead.tree_switch import TreeSwitch
from vllm_lookahead.lookahead.trees import grow_trees
from vllm_lookahead.lookahead.uniform_drafts import UniformDrafts, fill_draft
from vllm_lookahead.metrics import DRAFT_SOURCES, ProposerStats
from vllm_lookahead.worker import request_support, runner_state


class DraftPlanner:
    """Decides the tokens (and trees) each decoding request proposes this step."""

    def __init__(self, options: LookaheadOptions, num_speculative_tokens: int,
                 max_model_len: int, sources: DraftSources, uniform: UniformDrafts,
                 cost_model: StepCostModel, estimates: WorkerEstimates, stats: ProposerStats):
        self.options = options
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self._sources = sources
        self._uniform = uniform
        self._cost_model = cost_model
        self._stats = stats
        self._cut = CostAwareCut(estimates, cost_model, stats)
        self._rests = DraftRests()
        #: the last step's drafts were filled to K: it grew no trees
        self.filled = False
        #: the last step grew trees (True), or was a linear step (False), or neither
        #: (None: filled, or every draft dropped): the shape ``tree_choice`` compares
        self.shape: bool | None = None
        #: tokens the last step would have computed with its main drafts alone
        self.main_tokens = 0

    def plan(self, runner: Any, decoding: DecodingRows, num_tokens_no_spec: np.ndarray,
             token_ids_cpu: np.ndarray, num_rows: int, trees: TreeSwitch) -> list[list[int]]:
        """Main drafts from the sources, cut to the step's budget, grown into trees where
        ``trees`` want them or filled to K: one per input-batch row (``num_rows``), empty
        where none decodes, and every one empty where the load leaves no token that
        could pay."""
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        self.filled, self.shape = False, None
        rows, states = decoding.rows, decoding.states
        if not rows:
            return drafts
        num_tokens = num_tokens_no_spec[np.asarray(rows, dtype=np.int64)].astype(np.int64)
        bounds = self._draft_bounds(states, num_tokens)
        if self._uniform.graph_requests is None:  # the runner's graphs exist by now
            self._uniform.set_graph_requests(runner_state.uniform_graph_requests(runner))
        fill = self._uniform.wanted(num_rows, len(rows), bounds)
        plan = self.step_plan(fill, len(rows), not fill and trees.wanted(len(rows)),
                              trees.choice is not None)
        if self.options.cost_aware_drafts and not self._cut.may_keep_any(bounds, plan):
            for state in states:
                state.draft, state.draft_origin = [], None
                state.drop_tree()
            return drafts
        cut = self.options.cost_aware_drafts and not plan.fill and plan.step_cost is not None
        resting = self._rests.take(states) if cut else np.zeros(len(states), dtype=bool)
        self._stats.resting_drafts += int(resting.sum())
        main = self._main_drafts(decoding, token_ids_cpu, num_tokens, bounds, plan.fill,
                                 resting)
        proposed = [len(draft.tokens) for draft in main]
        if self.options.cost_aware_drafts:
            self._cut.apply(main, states, num_tokens, plan)
        if cut:
            self._rests.settle(states, proposed, [len(draft.tokens) for draft in main], resting)
        for row, draft, state in zip(rows, main, states):
            drafts[row] = list(draft.tokens)
            state.drop_tree()  # linear unless grown below
        self.main_tokens = len(rows) + sum(map(len, drafts))
        # a step with trees runs eagerly: where filling won, its graph beat them too
        # (the tree steps were among the other steps it was timed against)
        nodes = 0
        if plan.trees:
            nodes = grow_trees(rows, states, drafts, token_ids_cpu, num_tokens,
                               plan.free_tokens, self.options, self.max_model_len,
                               self._sources.recycled)
            self._stats.tree_nodes += nodes
            self._stats.tree_steps += nodes > 0
        if plan.fill:
            self._fill(rows, main, states, bounds, drafts)
        self.shape = None if plan.fill else nodes > 0
        self._remember(main, states)
        return drafts

    def step_plan(self, fill: bool, num_requests: int, trees: bool = False,
                  measured_trees: bool = False) -> StepPlan:
        """What a step of ``num_requests`` affords (``budget.StepPlan``), with ``fill``
        and ``trees`` as this rank wants them (``measured_trees``: ``trees`` is this
        rank's measurement): without ``cost_aware_drafts`` infinite free tokens and no
        curve; before the cost model has an estimate, none of either."""
        if not self.options.cost_aware_drafts:
            plan = StepPlan(math.inf, None, fill, trees=trees)
        elif self._cost_model.has_estimate:
            cost = self._cost_model
            plan = StepPlan(cost.free_tokens(), cost.step_curve(num_requests), fill,
                            not fill and cost.wants_baseline(num_requests), trees)
        else:
            plan = StepPlan(None, None, fill, trees=trees)
        if not (self.options.cost_aware_drafts or self._uniform.may_fill or measured_trees):
            return plan
        return runner_state.broadcast_from_first_tp_rank(plan)

    def _draft_bounds(self, states: list[RequestState], num_tokens: np.ndarray) -> np.ndarray:
        """Each request's longest draft: K, or its own lower bound (0 where vLLM could
        not verify drafts exactly), never past max_model_len (the bonus token needs a
        slot too) nor across min_tokens (``request_support.min_tokens_bound``)."""
        # np.clip's dispatch cost 0.05 ms here, a step (one request, 2-core CPU)
        bounds = np.minimum(np.maximum(self.max_model_len - num_tokens - 1, 0),
                            self.num_speculative_tokens)
        np.minimum(bounds, [state.max_draft for state in states], out=bounds)
        ends = [state.min_tokens_end for state in states]
        if any(ends):
            np.minimum(bounds, request_support.min_tokens_bound(ends, num_tokens), out=bounds)
        return bounds

    def _main_drafts(self, decoding: DecodingRows, token_ids_cpu: np.ndarray,
                     num_tokens: np.ndarray, bounds: np.ndarray, fill: bool,
                     resting: np.ndarray) -> list[Draft]:
        """The sources' drafts, each up to its request's adaptive limit and minimum
        probability; up to K in a filled step, whose every slot is computed anyway (past
        the probability that saves compute elsewhere); empty for the ``resting``."""
        states = decoding.states
        if fill:
            limits, min_prob = bounds, np.zeros(len(states))
        else:
            limits = np.minimum(bounds, [state.draft_limit for state in states])
            min_prob = np.array([state.draft_min_prob for state in states])
        if not resting.any():  # the common case: subsetting costs 7 us a step at batch 1
            return self._sources.draft(decoding.rows, decoding.req_ids, states,
                                       token_ids_cpu, num_tokens, limits, min_prob)
        main = [Draft([]) for _ in states]
        drafting = np.flatnonzero(~resting)
        if len(drafting):
            picked = drafting.tolist()
            drafted = self._sources.draft(
                [decoding.rows[b] for b in picked], [decoding.req_ids[b] for b in picked],
                [states[b] for b in picked], token_ids_cpu, num_tokens[drafting],
                limits[drafting], min_prob[drafting])
            for b, draft in zip(picked, drafted):
                main[b] = draft
        return main

    def _fill(self, rows: list[int], main: list[Draft], states: list[RequestState],
              bounds: np.ndarray, drafts: list[list[int]]) -> None:
        """Pad every draft to its bound (``uniform_drafts``)."""
        for row, draft, state, bound in zip(rows, main, states, bounds.tolist()):
            draft.padded = fill_draft(draft.tokens, state.pending_token, bound, state.pool,
                                      self.options.guess_set_size, self._sources.recycled)
            drafts[row] = list(draft.tokens)
        self._stats.filled_steps += 1
        self.filled = True

    def _remember(self, main: list[Draft], states: list[RequestState]) -> None:
        """Keep each main draft and its origin (none for an empty one: nothing to
        learn from) for the next pass's feedback; count it."""
        for state, draft in zip(states, main):
            state.draft, state.draft_origin = draft.tokens, draft if draft.tokens else None
            if draft.tokens:
                self._stats.drafts += 1
                self._stats.draft_tokens += len(draft.tokens)
                self._stats.count_by_source(draft.tokens_by_source(), DRAFT_SOURCES)
