"""``{"method": "mtad"}``: vLLM ``custom_class`` drafter and its acceptance rule.

Each step, every decoding request's beams are sampled by the auxiliary model, and the
auxiliary log-probability of each draft token is kept by request id until vLLM
verifies the draft. The auxiliary model runs on vLLM's kernels and paged KV cache
(``paged_drafter.py``), or on transformers where vLLM cannot run it
(``transformers_drafter.py``; the reason is logged).

What is verified (``candidates``): the best beam as a linear draft, or every distinct
beam as one token tree (a trie: beams sharing a prefix share its nodes), which the
worker verifies in the same target pass (``worker/tree_step.py``). With
``acceptance="joint"``, ``worker/sampler.py`` hands verification to ``accept`` (MTAD's
joint rule, ``acceptance.py``, path by path on a tree); with ``"lossless"``, vLLM's
rejection sampler verifies a linear draft as a point mass, and a tree is walked by
the target's own samples (multi-candidate rejection sampling with point-mass
drafts), both of which keep the target's distribution exactly whatever the drafts'
distribution.

Under tensor (or pipeline) parallelism only the first rank runs the auxiliary model,
on transformers; drafts, trees and log-probabilities are broadcast, so every rank
takes the same decisions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_lookahead.log import get_logger
from vllm_lookahead.metrics import ProposerStats, SnapshotWriter
from vllm_lookahead.mtad.acceptance import joint_accept
from vllm_lookahead.mtad.beams import AuxiliaryState, Beams, BeamSampler, DraftJob
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.options import method_options
from vllm_lookahead.tree import TreeBuilder, first_chain, is_chain
from vllm_lookahead.worker import request_support, runner_state, sampler, tree_step

logger = get_logger(__name__)


@dataclass
class Draft:
    """A request's draft until vLLM verifies it."""

    tokens: list[int]
    logq: list[float]  # log q of each token given its beam's earlier tokens
    parents: np.ndarray | None = None  # a tree's parents (root first); None: linear


class MTADProposer:
    """vLLM ``custom_class`` drafter for ``{"method": "mtad"}``."""

    def __init__(self, vllm_config: Any):
        #: what vLLM schedules a request for (the tree's node budget with all beams)
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.options = method_options(vllm_config, MTADOptions)
        self.draft_length = self.options.draft_length(self.num_speculative_tokens)
        self._vllm_config = vllm_config
        self._dtype = vllm_config.model_config.dtype
        self._seed = vllm_config.model_config.seed or 0
        self._stats = ProposerStats()
        self._snapshots = SnapshotWriter(vllm_config, runner_state.worker_rank())
        self._runner: Any = None
        self._drafter: Any = None  # PagedDrafter or TransformersDrafter, None on other ranks
        # None until the first draft, when the KV cache (and its groups) exists
        self._trees_on: bool | None = False if self.options.candidates == "best" else None
        self._states: dict[str, AuxiliaryState] = {}
        self._drafts: dict[str, Draft] = {}
        self._undrafted: set[str] = set()  # requests served without drafts

    @property
    def stats(self) -> ProposerStats:
        return dataclasses.replace(self._stats, active_requests=len(self._drafts))

    @property
    def acceptance_rule(self):
        """Called by ``worker/sampler.py`` in place of vLLM's ``rejection_sample`` (joint mode)."""
        return self.accept if self.options.acceptance == "joint" else None

    # -- hooks called by vLLM and worker/ ------------------------------------------

    def bind_model_runner(self, runner: Any) -> None:
        self._runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        runner_state.check_bound(self._runner)
        if self._trees_on is None and not self._trees_possible():
            self._trees_on = False
        opts = self.options
        beam_sampler = BeamSampler(opts.beam_width, opts.draft_temperature, opts.draft_top_k,
                                   opts.draft_top_p, self._seed,
                                   runner_state.device(self._runner))
        reason = self._why_not_vllm()
        if reason is None:
            from vllm_lookahead.mtad.paged_drafter import PagedDrafter
            from vllm_lookahead.worker import auxiliary_model

            try:
                model, aux_config = auxiliary_model.load(self._vllm_config, opts.model)
            except Exception as exc:  # noqa: BLE001 - any failure: transformers may load it
                reason = f"vLLM cannot load it ({type(exc).__name__}: {exc})"
            else:
                self._drafter = PagedDrafter(
                    auxiliary_model.PagedModel(model, aux_config, self._runner), beam_sampler)
                return
        if opts.auxiliary_runner == "vllm":
            logger.warning("vllm-lookahead mtad: the auxiliary model %r runs on transformers: "
                           "%s", opts.model, reason)
        if runner_state.is_first_tp_rank():
            from vllm_lookahead.mtad.transformers_drafter import (
                TransformersDrafter,
                load_auxiliary_model,
            )

            model = load_auxiliary_model(opts.model, self._dtype,
                                         runner_state.device(self._runner))
            self._drafter = TransformersDrafter(model, beam_sampler)

    def _why_not_vllm(self) -> str | None:
        if self.options.auxiliary_runner == "transformers":
            return "auxiliary_runner is 'transformers'"
        if runner_state.model_parallel_size() > 1:
            return ("tensor or pipeline parallelism (vLLM would shard it over the ranks; "
                    "MTAD drafts on the first rank)")
        return None

    def _trees_possible(self) -> bool:
        """Whether beams can be verified as trees; asked at load time (the target's
        attention is known) and again at the first draft (its KV cache groups are)."""
        problems = tree_step.tree_attention_problems(self._runner)
        if not problems:
            return True
        if self.options.candidates == "all":
            raise ValueError(
                "mtad: candidates='all' verifies all beams as a token tree, which this model "
                f"cannot take here: {'; '.join(problems)}. Set candidates to 'best' or 'auto'.")
        logger.warning("vllm-lookahead mtad: candidates='auto' verifies the best beam only: "
                       "%s", "; ".join(problems))
        return False

    @property
    def trees_on(self) -> bool:
        """Beams may be verified as trees (``candidates`` other than ``"best"``, and
        the target's attention can take trees)."""
        return self._trees_on is not False

    def on_tree_check(self, check: Any) -> None:
        """The worker's self-check of the tree step: if it failed, ``candidates='all'``
        cannot be served; ``'auto'`` verifies the best beam only."""
        self._stats.tree_check = int(check.passed)
        if check.passed:
            return
        if self.options.candidates == "all":
            raise ValueError(f"mtad: candidates='all' verifies all beams as a token tree, "
                             f"and the {check.describe()}. Set candidates to 'best' or "
                             "'auto'.")
        self._trees_on = False

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        for req_id in finished | preempted:
            self._states.pop(req_id, None)
            self._drafts.pop(req_id, None)
            self._undrafted.discard(req_id)
        if self._snapshots.due() or not self._drafts:
            self._snapshots.write(self.stats)

    def draft_tree(self, req_id: str, scheduled: list[int]) -> np.ndarray | None:
        """Parents of the request's tree as vLLM scheduled it, or None (linear)."""
        draft = self._drafts.get(req_id)
        if draft is None or draft.parents is None or draft.tokens[:len(scheduled)] != scheduled:
            return None
        return draft.parents[:len(scheduled) + 1]

    def on_tree_planned(self, req_id: str, branches: int | None) -> None:
        """The tree became ``branches`` extra attention sequences, or (None) is verified
        linearly for want of scratch blocks: then only its first chain is judged."""
        if branches is not None:
            self._stats.tree_branches += branches
            return
        self._stats.tree_fallbacks += 1
        draft = self._drafts.get(req_id)
        if draft is not None and draft.parents is not None:
            draft.parents = first_chain(draft.parents)

    # -- the step ------------------------------------------------------------------

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        start = time.perf_counter()
        if self._trees_on is None:
            self._trees_on = self._trees_possible()
        req_ids = runner_state.request_ids(self._runner)
        jobs = []  # (row, request id, context length, draft length)
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # partial prefill chunk: nothing to draft yet
                continue
            self._stats.generated_tokens += len(sampled)
            self._stats.request_passes += 1
            num_tokens = int(num_tokens_no_spec[row])
            # never past max_model_len: the token after the draft needs a slot too, nor
            # where vLLM would not verify the draft exactly (``request_support``)
            length = min(self.draft_length, self.max_model_len - num_tokens - 1,
                         self._exact_draft_bound(req_ids[row], row, num_tokens))
            if length > 0:
                jobs.append((row, req_ids[row], num_tokens, length))

        results = None
        if self._drafter is not None and jobs:
            beams = self._drafter.draft([
                DraftJob(self._states.setdefault(req_id, AuxiliaryState()),
                         token_ids_cpu[row, :num_tokens], length,
                         runner_state.is_greedy(self._runner, req_id), row)
                for row, req_id, num_tokens, length in jobs])
            results = [self._draft_of(req_id, b) for (_, req_id, _, _), b in zip(jobs, beams)]
        results = runner_state.broadcast_from_first_tp_rank(results) if jobs else []

        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for (row, req_id, _, _), draft in zip(jobs, results):
            if draft is None:
                continue
            drafts[row] = draft.tokens
            self._drafts[req_id] = draft
            self._stats.drafts += 1
            self._stats.draft_tokens += len(draft.tokens)
            if draft.parents is not None:
                self._stats.tree_nodes += len(draft.tokens) - (len(first_chain(draft.parents)) - 1)
        self._stats.steps += 1
        self._stats.seconds += time.perf_counter() - start
        if self._snapshots.due():
            self._snapshots.write(self.stats)
        return drafts

    def _exact_draft_bound(self, req_id: str, row: int, num_tokens: int) -> int:
        """0 for a request served without drafts (counted once), else the draft length
        that min_tokens allows (``request_support``)."""
        params = runner_state.sampling_params(self._runner, req_id)
        if request_support.undrafted_parameter(params) is not None:
            if req_id not in self._undrafted:
                self._undrafted.add(req_id)
                self._stats.requests_without_drafts += 1
            return 0
        end = request_support.min_tokens_end(params, runner_state.num_prompt_tokens(
            self._runner, row))
        return int(min(request_support.min_tokens_bound(end, num_tokens), self.draft_length))

    def _draft_of(self, req_id: str, beams: Beams | None) -> Draft | None:
        """The best beam, or all distinct beams as a trie, best first."""
        if beams is None:
            return None
        if not self._trees_on or beams.count == 1 or not runner_state.allows_trees(
                runner_state.sampling_params(self._runner, req_id)):
            return Draft(*beams.best())
        tree = TreeBuilder(-1, self.num_speculative_tokens)
        node_logq = {}
        for tokens, logq in beams.ranked():
            for node, value in zip(tree.add_chain(tokens), logq):
                node_logq[node] = value
        parents = np.asarray(tree.parents)
        logq = [node_logq[node] for node in range(1, len(parents))]
        return Draft(tree.draft, logq, None if is_chain(parents) else parents)

    # -- verification (joint mode) ---------------------------------------------------

    def accept(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        max_spec_len: int,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling_metadata: Any,
        trees: dict[int, Any],
    ) -> torch.Tensor | None:
        """MTAD's decisions for one verification pass; None for vLLM's warm-up runs."""
        req_ids = runner_state.request_ids(self._runner)
        if len(req_ids) != len(num_draft_tokens):
            return None
        drafted = draft_token_ids.tolist()
        logq: list[float] = []
        parents: list[np.ndarray | None] = []
        start = 0
        for row, (req_id, count) in enumerate(zip(req_ids, num_draft_tokens)):
            draft = self._drafts.get(req_id, Draft([], []))
            if draft.tokens[:count] != drafted[start:start + count]:
                raise RuntimeError(
                    f"vllm-lookahead mtad: request {req_id}: the verified draft is not the "
                    "one this worker proposed (no auxiliary log-probabilities for it)"
                )
            logq.extend(draft.logq[:count])
            if row in trees:
                parents.append(trees[row].parents)
            elif draft.parents is not None:  # a tree verified linearly: its first chain
                parents.append(first_chain(draft.parents)[:count + 1])
            else:
                parents.append(None)
            start += count
        return joint_accept(
            draft_token_ids, num_draft_tokens, max_spec_len, target_logits,
            bonus_token_ids, torch.tensor(logq, dtype=torch.float32),
            sampler.greedy_rows(sampling_metadata, len(req_ids)),
            self.options.acceptance_threshold, sampler.row_generators(sampling_metadata),
            parents,
        )
