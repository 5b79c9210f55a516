"""The lookahead proposer: linear drafts from context matches and a Jacobi-fed n-gram
pool, optionally grown into trees, verified by vLLM.

Each step, for every decoding request: read what the last verification pass told and
learn from it (``learning.py``: acceptance, the Jacobi harvest, earlier drafts checked
in hindsight), then plan the next drafts (``planning.py``): the longest context or
corpus match filled from the pool (``sources/``), cut to what the step affords
(``cut.py``, ``budget.py``), grown into a tree where trees are on and were measured
to pay (``trees.py``, ``tree_switch.py``, ``tree_choice.py``), or filled to K where
that makes the step replay a full CUDA graph (``uniform_drafts.py``).

This module is the face vLLM and ``worker/`` call: the step, and the hooks that bind
the runner, time steps, hand over verifications and report start-up findings. vLLM
calls ``propose`` with batch rows, not requests; per-request state is keyed by request
id through the model runner bound by ``worker/`` (``state.py``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from vllm_lookahead.lookahead import trees
from vllm_lookahead.lookahead.budget import WorkerEstimates
from vllm_lookahead.lookahead.calibration import AcceptanceCalibration
from vllm_lookahead.lookahead.learning import PassLearner
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.planning import DraftPlanner
from vllm_lookahead.lookahead.sources.draft import NUM_TOKEN_CLASSES
from vllm_lookahead.lookahead.sources.drafts import DraftSources
from vllm_lookahead.lookahead.sources.support import SUPPORT_BINS
from vllm_lookahead.lookahead.state import RequestStates
from vllm_lookahead.lookahead.step_cost import StepCostModel
from vllm_lookahead.lookahead.tree_switch import TreeSwitch
from vllm_lookahead.lookahead.uniform_drafts import UniformDrafts
from vllm_lookahead.metrics import ProposerStats, SnapshotWriter
from vllm_lookahead.options import method_options
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker.hooks import VerificationCapture


class LookaheadProposer:
    """vLLM ``custom_class`` drafter for ``{"method": "lookahead"}`` (hooks:
    ``worker.hooks.DrafterHooks``)."""

    def __init__(self, vllm_config: Any, options: LookaheadOptions | None = None):
        """``options``: as the runner can serve them (Model Runner V2's adapter); by
        default the engine's."""
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.options = options or method_options(vllm_config, LookaheadOptions)
        self._stats = ProposerStats()
        self._snapshots = SnapshotWriter(vllm_config, runner_state.worker_rank())
        self._runner: Any = None
        self._states = RequestStates(self.options, self.num_speculative_tokens)
        self._sources = DraftSources(self.options, self.num_speculative_tokens,
                                     vllm_config.scheduler_config.max_num_seqs,
                                     vllm_config.model_config.get_vocab_size(),
                                     self.options.recycled_top_k(self.options.tree_drafts))
        self._trees = TreeSwitch(self.options, self._sources)
        self.cost_model = StepCostModel()
        self._uniform = UniformDrafts(self.options.uniform_drafts, self.num_speculative_tokens)
        #: the worker's start-up measurement (trees ``auto``), kept for reports
        self.start_cost: Any = None
        self._estimates = WorkerEstimates(self.num_speculative_tokens, NUM_TOKEN_CLASSES,
                                          SUPPORT_BINS)
        #: the cut's estimates against the text that followed (for reports)
        self.calibration = AcceptanceCalibration()
        self._learner = PassLearner(self.options, self._states, self._sources,
                                    self._estimates, self._stats, self.calibration)
        self._planner = DraftPlanner(self.options, self.num_speculative_tokens,
                                     self.max_model_len, self._sources, self._uniform,
                                     self.cost_model, self._estimates, self._stats)
        #: times decode steps for the cost model (replaced by a simulated clock in
        #: benchmarks/replay/ and the tests)
        self.clock = time.perf_counter
        self._step_start: tuple[float, int, int] | None = None
        #: the pass read last: whether its step grew trees (None: neither shape), its
        #: tokens, those its main drafts alone earned, and the tokens those drafts
        #: alone would have computed (for ``tree_choice``)
        self._last_pass: tuple[bool | None, int, int, int] = (None, 0, 0, 0)

    @property
    def stats(self) -> ProposerStats:
        return dataclasses.replace(
            self._stats,
            active_requests=len(self._states),
            requests_without_drafts=self._states.undrafted,
            pool_ngrams=self._states.pool_entries(),
            live_responses=self._sources.live.holders,
            corpus_size=len(self._sources.corpus),
            step_fixed_seconds=self.cost_model.fixed_seconds,
            step_token_seconds=self.cost_model.token_seconds,
        )

    @property
    def states(self) -> RequestStates:
        return self._states

    @property
    def trees_on(self) -> bool:
        """Tree options on, and the target's attention and the worker's self-check of
        the tree step (if it has run) said yes: some steps may grow trees."""
        return self._trees.on

    @property
    def capture_last_top_k(self) -> int:
        """The target's top-k wanted at each row's last position, every pass (recycling).

        0 while ``recycle_top_k`` is ``auto`` (recycling for trees) and the pass
        verifies no tree: on an H100 the capture and its copies took the proposer from
        0.52 to 0.94 ms a step (run (bq)) where filled drafts won nearly every step, and
        on 2 AVX2 cores 3.2 ms of SmolLM2-135M's linear steps, 11 ms of
        Qwen2.5-Coder-1.5B's (runs (gt), (gu)). The table keeps its rows, and takes new
        ones again from the next tree step."""
        recycled = self._sources.recycled
        if recycled is None or (not self._planner.shape and self.options.recycle_top_k == "auto"):
            return 0
        return recycled.top_k

    @property
    def capture_top_k(self) -> int:
        """... and at draft positions (rescoring's lattice, recycling)."""
        return max(self.options.rescoring_top_k, self.capture_last_top_k)

    @property
    def measures_start_cost(self) -> bool:
        """Trees ``auto``: the worker measures the target's pass by token count before
        the first request (``on_start_cost``), the cost-aware cut's first estimate."""
        return self.options.trees == "auto"

    # -- hooks called by vLLM and worker/ ------------------------------------------------

    def bind_model_runner(self, runner: Any) -> None:
        self._runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model; called by vLLM once the target is loaded, so check binding
        and, with tree drafts on, that the target's attention can mask trees."""
        runner_state.check_bound(self._runner)
        self._trees.check_attention(self._runner)

    def on_start_cost(self, cost: Any) -> None:
        """The worker measured what an extra token costs the target
        (``worker.start_cost.StartCost``, the first tensor-parallel rank's): the
        cost-aware cut starts from it."""
        self.start_cost = cost
        if not cost.reason and cost.token_seconds > 0:
            self.cost_model.set_prior(cost.fixed_seconds, cost.token_seconds, cost.sizes,
                                      cost.size_seconds)
        self._stats.start_free_tokens = cost.free_tokens

    def on_tree_check(self, check: Any) -> None:
        """The worker's self-check of the tree step: if it failed, drafts stay linear
        (trees ``auto``) or the engine does not start (``on``)."""
        self._stats.tree_check = int(check.passed)
        self._trees.read_tree_check(check)

    def on_verification(self, capture: VerificationCapture) -> None:
        self._learner.keep_capture(capture)

    def on_last_top_k(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        self._learner.keep_last_top_k(top_ids, top_logprobs)

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
                self.cost_model.add(num_scheduled, now - step_start, requests)
            tree, tokens, main_tokens, main_scheduled = self._last_pass
            if tree is not None:
                curve = self.cost_model.curve() if tree else None
                linear_seconds = None if curve is None else float(curve(main_scheduled))
                self._trees.timed(requests, tree, now - step_start, tokens, main_tokens,
                                  linear_seconds)
        self._step_start = (now, num_scheduled_tokens, num_requests) if decode_only else None

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        """Free state; a finished (or aborted) request's output joins the corpus. In the
        ids' order: a set of strings iterates in an order each process hashes its own
        way, and tensor-parallel ranks must fill their corpora (and free live slots)
        alike to draft alike."""
        finished, preempted = sorted(finished), sorted(preempted)
        for output in self._states.remove(finished, preempted):
            self._sources.corpus.add(output)
        self._sources.live.release(sorted(finished + preempted))
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
        """Learn from the last pass, then plan each decoding request's next draft (by
        batch row; empty for prompt chunks)."""
        start = time.perf_counter()
        # the step whose pass is read now
        shape, main_scheduled = self._planner.shape, self._planner.main_tokens
        decoding = self._learner.read_pass(self._runner, sampled_token_ids,
                                           num_tokens_no_spec, token_ids_cpu)
        self._last_pass = (shape, self._learner.pass_tokens, self._learner.pass_main_tokens,
                           main_scheduled)
        drafts = self._planner.plan(self._runner, decoding, num_tokens_no_spec, token_ids_cpu,
                                    len(sampled_token_ids), self._trees)
        self._count_step(start)
        return drafts

    def _count_step(self, start: float) -> None:
        """Count the step and the proposer's time in it; a snapshot when one is due."""
        self._stats.steps += 1
        self._stats.seconds += time.perf_counter() - start
        if self._snapshots.due():
            self._snapshots.write(self.stats)
