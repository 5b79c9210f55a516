"""The lookahead proposer: linear drafts from context matches and a Jacobi-fed n-gram
pool, optionally grown into trees, verified by vLLM.

Each step, for every decoding request: read what the last verification pass told
(accepted tokens, the target's predictions at every draft position, harvested as one
Jacobi iteration into the request's pool), read the new context and check the
request's earlier drafts against it (``hindsight.py``), then draft: the longest context
or corpus match filled from the pool (``sources/``), cut to what the step affords
(``budget.py``), grown into a tree where trees pay (``trees.py``), or filled to K where
that makes the step replay a full CUDA graph (``uniform_drafts.py``).

vLLM calls ``propose`` with batch rows, not requests; per-request state is keyed by
request id through the model runner bound by ``worker/`` (``state.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np
import torch

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead import feedback, trees
from vllm_lookahead.lookahead.budget import (
    NUM_SAMPLING_CLASSES,
    AcceptanceByDepth,
    TreeYield,
    cut_to_budget,
    survival_along,
)
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.drafts import NUM_TOKEN_CLASSES, Draft, DraftSources
from vllm_lookahead.lookahead.sources.support import SUPPORT_BINS
from vllm_lookahead.lookahead.state import RequestState, RequestStates
from vllm_lookahead.lookahead.step_cost import CostCurve, StepCostModel
from vllm_lookahead.lookahead.uniform_drafts import UniformDrafts, fill_draft
from vllm_lookahead.metrics import (
    ACCEPTED_SOURCES,
    DRAFT_SOURCES,
    ProposerStats,
    SnapshotWriter,
)
from vllm_lookahead.options import method_options
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker import tree_step
from vllm_lookahead.worker.hooks import VerificationCapture

logger = get_logger(__name__)

#: Seconds between two debug lines explaining the cost-aware cut.
CUT_LOG_INTERVAL_S = 10.0


class LookaheadProposer:
    """vLLM ``custom_class`` drafter for ``{"method": "lookahead"}`` (hooks:
    ``worker.hooks.DrafterHooks``)."""

    def __init__(self, vllm_config: Any):
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.options = method_options(vllm_config, LookaheadOptions)
        #: trees until the worker's start-up decision and self-check say otherwise
        self._trees_on = self.options.tree_drafts
        self._stats = ProposerStats()
        self._snapshots = SnapshotWriter(vllm_config, runner_state.worker_rank())
        self._runner: Any = None
        self._states = RequestStates(self.options, self.num_speculative_tokens)
        self._sources = DraftSources(self.options, self.num_speculative_tokens,
                                     vllm_config.scheduler_config.max_num_seqs,
                                     vllm_config.model_config.get_vocab_size(),
                                     self.options.recycled_top_k(self._trees_on))
        self._capture: VerificationCapture | None = None
        self._last_top_k: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cost_model = StepCostModel()
        self._uniform = UniformDrafts(self.options.uniform_drafts, self.num_speculative_tokens)
        #: the last step's drafts were filled to K: it grows no trees (``_draft``)
        self._filled = False
        #: the worker's start-up measurement (trees ``auto``), kept for reports
        self.start_cost: Any = None
        #: worker-wide estimates, by sampling class (``budget.sampling_class``)
        self._depth_acceptance = [AcceptanceByDepth(self.num_speculative_tokens,
                                                    NUM_TOKEN_CLASSES,
                                                    group_size=SUPPORT_BINS)
                                  for _ in range(NUM_SAMPLING_CLASSES)]
        self._depth_acceptance[0].conditional_rates()  # compiled before the first request
        self._tree_yields = [TreeYield() for _ in range(NUM_SAMPLING_CLASSES)]
        #: times decode steps for the cost model (replaced by a simulated clock in
        #: benchmarks/replay.py and the tests)
        self.clock = time.perf_counter
        self._step_start: tuple[float, int] | None = None
        self._cut_log = CutLog()

    @property
    def stats(self) -> ProposerStats:
        return dataclasses.replace(
            self._stats,
            active_requests=len(self._states),
            pool_ngrams=self._states.pool_entries(),
            corpus_size=len(self._sources.corpus),
            step_fixed_seconds=self.cost_model.fixed_seconds,
            step_token_seconds=self.cost_model.token_seconds,
        )

    @property
    def states(self) -> RequestStates:
        return self._states

    @property
    def trees_on(self) -> bool:
        """Tree options on, and the worker's start-up decision (trees ``auto``) and
        self-check of the tree step (if they have run) said yes."""
        return self._trees_on

    @property
    def capture_last_top_k(self) -> int:
        """The target's top-k wanted at each row's last position, every pass (recycling).

        0 while ``recycle_top_k`` is ``auto`` (recycling for trees) and the pass
        verifies filled drafts: those steps grow no trees, and on an H100 the capture
        and its copies took the proposer from 0.52 to 0.94 ms a step (run (bq)) where
        filling won nearly every step. The table keeps its rows, and takes new ones
        again from the first pass that verifies unfilled drafts."""
        recycled = self._sources.recycled
        if recycled is None or (self._filled and self.options.recycle_top_k == "auto"):
            return 0
        return recycled.top_k

    @property
    def capture_top_k(self) -> int:
        """... and at draft positions (rescoring's lattice, recycling)."""
        return max(self.options.rescoring_top_k, self.capture_last_top_k)

    @property
    def trees_need_free_tokens(self) -> int | None:
        """Trees ``auto``: the free tokens the worker's start-up measurement must find
        (``on_start_cost``); None: trees do not depend on it."""
        return self.options.tree_free_tokens if self.options.trees == "auto" else None

    # -- hooks called by vLLM and worker/ ------------------------------------------------

    def bind_model_runner(self, runner: Any) -> None:
        self._runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model; called by vLLM once the target is loaded, so check binding
        and, with tree drafts on, that the target's attention can mask trees (trees
        ``on``: an error; ``auto``: linear drafts, logged)."""
        runner_state.check_bound(self._runner)
        if not self.trees_on:
            return
        if self.options.trees == "on":
            tree_step.check_tree_attention(self._runner)
            return
        problems = tree_step.tree_attention_problems(self._runner)
        if problems:
            if runner_state.is_first_tp_rank():
                logger.info("vllm-lookahead: trees auto: off, drafts are linear: this model's "
                            "attention cannot take them here: %s", "; ".join(problems))
            self._trees_off()

    def on_start_cost(self, cost: Any) -> None:
        """Trees ``auto``: the worker measured what an extra token costs the target
        (``worker.start_cost.StartCost``, the first tensor-parallel rank's); trees stay
        on only where enough tokens are free, and the cost-aware cut starts from it."""
        self.start_cost, free = cost, cost.free_tokens
        if not cost.reason and cost.token_seconds > 0:
            self.cost_model.set_prior(cost.fixed_seconds, cost.token_seconds, cost.sizes,
                                      cost.size_seconds)
        self._stats.start_free_tokens = free
        wanted = self.options.tree_free_tokens
        verdict = "on, if the self-check passes" if free >= wanted else "off, drafts are linear"
        if runner_state.is_first_tp_rank():
            logger.info("vllm-lookahead: trees auto: %s: %s; trees need %d (tree_free_tokens; "
                        "trees on / off skips the measurement)", verdict, cost.describe(), wanted)
        if free < wanted:
            self._trees_off()

    def on_tree_check(self, check: Any) -> None:
        """The worker's self-check of the tree step: if it failed, drafts stay linear."""
        self._stats.tree_check = int(check.passed)
        if not check.passed:
            self._trees_off()

    def _trees_off(self) -> None:
        self._trees_on = False
        if self.options.recycle_top_k == "auto":  # recycled top-k pays only with trees
            self._sources.recycled = None

    def on_verification(self, capture: VerificationCapture) -> None:
        self._capture = capture

    def on_last_top_k(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        self._last_top_k = (top_ids, top_logprobs)

    def on_step_start(self, num_scheduled_tokens: int, decode_only: bool,
                      num_requests: int = 0) -> None:
        """The runner starts a step (of ``num_requests``; 0: not told): the time since
        the last step started is that step's cost, for the cost model (and, by shape,
        for ``uniform_drafts``).

        The whole period counts, not only the forward pass: the sampler, this proposer,
        the scheduler and the engine's output processing are paid once per step too,
        and a step saved by an accepted token saves them all. Only periods from a
        decode step to the next are timed: a prompt token costs more than a draft token
        (attention over the whole prompt), and a period ending in a prefill may include
        time the engine sat idle waiting for a request.
        """
        now = self.clock()
        if self._step_start is not None and decode_only:
            step_start, num_scheduled, requests = self._step_start
            if self._uniform.timed(requests, num_scheduled, now - step_start):
                self.cost_model.add(num_scheduled, now - step_start)
        self._step_start = (now, num_scheduled_tokens, num_requests) if decode_only else None

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        """Free state; a finished (or aborted) request's output joins the corpus."""
        for output in self._states.remove(finished, preempted):
            self._sources.corpus.add(output)
        self._sources.live.release(finished | preempted)
        if self._snapshots.due() or not len(self._states):
            self._snapshots.write(self.stats)

    def draft_tree(self, req_id: str, scheduled: list[int]) -> np.ndarray | None:
        """Parents of the request's tree as vLLM scheduled it, or None (linear)."""
        return trees.tree_of(self._states.get(req_id), scheduled)

    def on_tree_planned(self, req_id: str, branches: int | None) -> None:
        """The worker split the request's tree into ``branches`` extra attention
        sequences, or (None) found no scratch blocks left and verifies its nodes, in
        order, as a linear draft: then they are one for the proposer too (its harvest
        reads the predictions along them; accepted nodes past the main draft count by no
        source)."""
        if branches is not None:
            self._stats.tree_branches += branches
            return
        self._stats.tree_fallbacks += 1
        state = self._states.get(req_id)
        if state is not None and state.tree is not None:
            state.draft = state.tree[0][1:]
            state.drop_tree()

    # -- the step --------------------------------------------------------------------------

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        start = time.perf_counter()
        rows, row_req_ids, states = self._read_verification(
            sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        drafts = self._draft(rows, row_req_ids, states, num_tokens_no_spec, token_ids_cpu,
                             len(sampled_token_ids))
        self._stats.steps += 1
        self._stats.seconds += time.perf_counter() - start
        if self._snapshots.due():
            self._snapshots.write(self.stats)
        return drafts

    def _read_verification(self, sampled_token_ids: list[list[int]],
                           num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray
                           ) -> tuple[list[int], list[str], list[RequestState]]:
        """Learn from the last pass, row by row; the decoding rows, their request ids and
        their states."""
        req_ids = runner_state.request_ids(self._runner)
        live = runner_state.live_request_ids(self._runner)
        self._states.drop_forgotten(live)
        self._sources.live.keep_only(live)
        capture = None if self._capture is None else feedback.HostCapture(self._capture)
        self._capture = None
        last_top_k, self._last_top_k = self._last_top_k, None
        if self._sources.recycled is not None:
            self._stats.recycled_rows += feedback.recycle(
                self._sources.recycled, capture, last_top_k, sampled_token_ids,
                num_tokens_no_spec, token_ids_cpu)
        wanted = (self.options.harvest_jacobi or self.options.rescoring_top_k
                  or self.options.tree_window)
        verified = (feedback.verified_rows(capture, len(sampled_token_ids),
                                           with_top_k=bool(self.options.rescoring_top_k))
                    if wanted else {})
        if self.options.cost_aware_drafts:
            for depth_acceptance in self._depth_acceptance:
                depth_acceptance.decay()
        rows, row_req_ids, states = [], [], []
        for row, emitted in enumerate(sampled_token_ids):
            if not emitted:  # partial prefill chunk: nothing to draft yet
                continue
            state = self._states.state_for(self._runner, req_ids[row], row)
            self._learn(state, emitted, verified.get(row))
            num_tokens = int(num_tokens_no_spec[row])
            state.read_context(token_ids_cpu[row], num_tokens, self.options.ngram_size)
            self._sources.live.extend(req_ids[row], state.output)
            if self.options.cost_aware_drafts:
                self._check_in_hindsight(state, token_ids_cpu[row], num_tokens)
            rows.append(row)
            row_req_ids.append(req_ids[row])
            states.append(state)
        return rows, row_req_ids, states

    def _check_in_hindsight(self, state: RequestState, context: np.ndarray,
                            num_tokens: int) -> None:
        """Compare the request's earlier drafts, kept or cut, with the tokens it then
        generated: the evidence behind its first-token rate and the worker's acceptance
        by depth, which therefore keeps coming when the cut drops every draft."""
        depth_acceptance = self._depth_acceptance[state.sampling_class]
        for outcome in state.hindsight.settle(context, num_tokens):
            if outcome.first == 0:
                state.count_first_token(outcome.confirmed > 0, outcome.first_estimate)
            depth_acceptance.add(outcome.first, outcome.compared, outcome.confirmed,
                                 outcome.classes)
            self._stats.cut_tokens_confirmed += outcome.cut_confirmed

    def _learn(self, state: RequestState, emitted: list[int],
               verified: feedback.Verified | None) -> None:
        """Count the request's pass, harvest the target's predictions, adapt its draft
        limit."""
        accepted = len(emitted) - 1
        self._stats.generated_tokens += accepted + 1
        self._stats.request_passes += 1
        state.lattice = None
        main_accepted, off_main = feedback.accepted_on_and_off_main(state, emitted)
        self._stats.tree_accepted += off_main
        if state.draft_origin is not None:
            self._count_by_source(state.draft_origin, main_accepted, ACCEPTED_SOURCES)
            self._sources.learn(state.draft_origin, main_accepted)
        tree_nodes = len(state.tree[0]) - 1 - len(state.draft) if state.tree else 0
        self._tree_yields[state.sampling_class].add_pass(accepted + 1, tree_nodes,
                                                        accepted - main_accepted)
        if verified is not None and feedback.is_our_draft(state, verified.draft):
            if self.options.harvest_jacobi:
                self._stats.harvested_ngrams += feedback.harvest(
                    state, verified, main_accepted, self.options.ngram_size,
                    self.options.window_size)
            if self.options.rescoring_top_k:
                state.lattice = verified.lattice_after(accepted, self.options.rescoring_top_k)
            if state.window_columns:
                self._stats.harvested_ngrams += trees.slide_window(state, verified.predictions)
        # by all accepted tokens: a branch that won says the text is predictable now,
        # and must not shrink the next main draft to its own few accepted tokens
        if self.options.adaptive_draft_length and state.draft:
            state.adapt_draft_limit(accepted)

    def _draft(self, rows: list[int], row_req_ids: list[str], states: list[RequestState],
               num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
               num_rows: int) -> list[list[int]]:
        """Main drafts from the sources, cut to the step's budget, grown into trees or
        filled to K."""
        drafts: list[list[int]] = [[] for _ in range(num_rows)]
        self._filled = False
        if not rows:
            return drafts
        num_tokens = num_tokens_no_spec[np.asarray(rows, dtype=np.int64)].astype(np.int64)
        bounds = self._draft_bounds(states, num_tokens)
        if self._uniform.graph_requests is None:  # the runner's graphs exist by now
            self._uniform.set_graph_requests(runner_state.uniform_graph_requests(self._runner))
        free_tokens, step_cost, fill = self._step_plan(
            self._uniform.wanted(num_rows, len(rows), bounds))
        main = self._main_drafts(rows, row_req_ids, states, token_ids_cpu, num_tokens, bounds,
                                 fill)
        if self.options.cost_aware_drafts:
            self._budget(main, states, num_tokens, step_cost, fill)
            self._stats.free_tokens = math.inf if free_tokens is None else free_tokens
            self._cut_log.maybe_log(self._stats, self.cost_model)
        for row, draft, state in zip(rows, main, states):
            drafts[row] = list(draft.tokens)
            state.drop_tree()  # linear unless grown below
        # a step with trees runs eagerly: where filling won, its graph beat them too
        # (the tree steps were among the other steps it was timed against)
        if self.trees_on and not fill:
            nodes = trees.grow_trees(
                rows, states, drafts, token_ids_cpu, num_tokens, free_tokens,
                self._tree_yields, self.options, self.max_model_len, self._sources.recycled)
            self._stats.tree_nodes += nodes
            self._stats.tree_steps += nodes > 0
        if fill:
            self._fill(rows, main, states, bounds, drafts)
        self._remember(main, states)
        return drafts

    def _draft_bounds(self, states: list[RequestState], num_tokens: np.ndarray) -> np.ndarray:
        """Each request's longest draft: K, or its own lower bound, never past
        max_model_len (the bonus token needs a slot too)."""
        bounds = np.clip(self.max_model_len - num_tokens - 1, 0, self.num_speculative_tokens)
        np.minimum(bounds, [state.max_draft for state in states], out=bounds)
        return bounds

    def _main_drafts(self, rows: list[int], row_req_ids: list[str], states: list[RequestState],
                     token_ids_cpu: np.ndarray, num_tokens: np.ndarray, bounds: np.ndarray,
                     fill: bool) -> list[Draft]:
        """The sources' drafts, each up to its request's adaptive limit and minimum
        probability; up to K in a filled step, whose every slot is computed anyway (past
        the probability that saves compute elsewhere)."""
        if fill:
            limits, min_prob = bounds, np.zeros(len(states))
        else:
            limits = np.minimum(bounds, [state.draft_limit for state in states])
            min_prob = np.array([state.draft_min_prob for state in states])
        return self._sources.draft(rows, row_req_ids, states, token_ids_cpu, num_tokens,
                                   limits, min_prob)

    def _budget(self, main: list[Draft], states: list[RequestState], num_tokens: np.ndarray,
                step_cost: CostCurve | None, fill: bool) -> None:
        """Estimate each draft's first token by its calibration class, cut the drafts to
        the step's budget (not in a filled step) and keep them, as proposed, to check in
        hindsight."""
        classes = [draft.token_classes() for draft in main]
        proposed = [np.array(draft.tokens, dtype=np.int64) for draft in main]
        first_rates = {c: self._depth_acceptance[c].first_token_rates()
                       for c in {state.sampling_class for state in states}}
        first_estimates = [  # an empty draft has no first token to estimate
            float(first_rates[state.sampling_class][token_classes[0]])
            if len(token_classes) else 0.0
            for state, token_classes in zip(states, classes)]
        if not fill:
            self._stats.cut_tokens += self._cut(main, classes, first_estimates, states,
                                                step_cost)
        for b, state in enumerate(states):
            state.hindsight.propose(int(num_tokens[b]), proposed[b], classes[b],
                                    len(main[b].tokens), state.max_draft, first_estimates[b])

    def _fill(self, rows: list[int], main: list[Draft], states: list[RequestState],
              bounds: np.ndarray, drafts: list[list[int]]) -> None:
        """Pad every draft to its bound (``uniform_drafts``)."""
        for row, draft, state, bound in zip(rows, main, states, bounds.tolist()):
            draft.padded = fill_draft(draft.tokens, state.pending_token, bound, state.pool,
                                      self.options.guess_set_size, self._sources.recycled)
            drafts[row] = list(draft.tokens)
        self._stats.filled_steps += 1
        self._filled = True

    def _remember(self, main: list[Draft], states: list[RequestState]) -> None:
        """Keep each main draft and its origin for the next pass's feedback; count it."""
        for state, draft in zip(states, main):
            state.draft, state.draft_origin = draft.tokens, draft
            if draft.tokens:
                self._stats.drafts += 1
                self._stats.draft_tokens += len(draft.tokens)
                self._count_by_source(draft, len(draft.tokens), DRAFT_SOURCES)

    def _cut(self, main: list[Draft], classes: list[np.ndarray], first_estimates: list[float],
             states: list[RequestState], step_cost: CostCurve | None) -> int:
        """Cut the main drafts to the step's budget. Each token's acceptance is
        estimated by calibration class (its source and support bin): the first token's
        by the worker's ``first_estimates`` scaled by its request's own record, the
        later ones by the acceptance by depth of tokens of the same classes, among
        requests of the same sampling class."""
        sampling = [state.sampling_class for state in states]
        rates = {c: self._depth_acceptance[c].conditional_rates() for c in set(sampling)}
        survival = np.ones((len(main), self.num_speculative_tokens))
        for b, c in enumerate(sampling):
            if len(classes[b]):
                survival[b, : len(classes[b])] = survival_along(rates[c], classes[b])
        first_rates = [state.first_token_rate(estimate)
                       for state, estimate in zip(states, first_estimates)]
        return cut_to_budget([draft.tokens for draft in main], first_rates, survival,
                             step_cost)

    def _step_plan(self, fill: bool) -> tuple[float | None, CostCurve | None, bool]:
        """Tokens the step affords for free, by the line (for trees), the step's cost
        curve (for the cut) and whether to ``fill`` the drafts to K, as the first
        tensor-parallel rank timed them: every rank then drafts the same tokens and
        trees, and its attention splits the same branches. Without
        ``cost_aware_drafts``: infinite, no curve; before the cost model has samples:
        None, no curve."""
        if not self.options.cost_aware_drafts:
            plan = (math.inf, None, fill)
        elif self.cost_model.has_estimate:
            plan = (self.cost_model.free_tokens(), self.cost_model.curve(), fill)
        else:
            plan = (None, None, fill)
        if not self.options.cost_aware_drafts and not self._uniform.may_fill:
            return plan
        return runner_state.broadcast_from_first_tp_rank(plan)

    def _count_by_source(self, draft: Draft, count: int, fields: dict[str, str]) -> None:
        """Add the draft's first ``count`` tokens to the stats ``fields`` of their sources."""
        for source, tokens in draft.tokens_by_source(count).items():
            field = fields[source]
            setattr(self._stats, field, getattr(self._stats, field) + tokens)


class CutLog:
    """A debug line every ``CUT_LOG_INTERVAL_S`` explaining the cost-aware cut: the
    fitted step cost, the tokens it makes free, and what was proposed, cut, and cut
    although the generated text then matched it."""

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._last: tuple[int, int, int] = (0, 0, 0)

    def maybe_log(self, stats: ProposerStats, cost_model: StepCostModel) -> None:
        now = time.monotonic()
        if now - self._last_time < CUT_LOG_INTERVAL_S or not logger.isEnabledFor(logging.DEBUG):
            return
        totals = (stats.draft_tokens + stats.cut_tokens, stats.cut_tokens,
                  stats.cut_tokens_confirmed)
        proposed, cut, confirmed = (a - b for a, b in zip(totals, self._last))
        elapsed, self._last_time, self._last = now - self._last_time, now, totals
        logger.debug(
            "vllm-lookahead cut: step = %.3f ms + %.4f ms/token (free tokens %.1f); "
            "last %.0f s: %d draft tokens proposed, %d cut, %d of those matched later",
            cost_model.fixed_seconds * 1e3, cost_model.token_seconds * 1e3,
            stats.free_tokens, elapsed, proposed, cut, confirmed)
