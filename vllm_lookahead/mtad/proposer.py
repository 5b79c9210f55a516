"""``{"method": "mtad"}``: vLLM ``custom_class`` drafter and its acceptance rule.

Each step, every decoding request gets the best of ``beam_width`` beams sampled by
the auxiliary model, with the auxiliary log-probability of each draft token kept by
request id until vLLM verifies the draft. The auxiliary model runs on vLLM's kernels
and paged KV cache (``paged_drafter.py``), or on transformers where vLLM cannot run it
(``transformers_drafter.py``; the reason is logged). With
``acceptance="joint"``, ``worker/sampler.py`` hands verification to ``accept`` (MTAD's
joint rule, ``acceptance.py``); with ``"lossless"``, vLLM's rejection sampler
verifies the draft as a point mass, which keeps the target's distribution exactly
whatever the draft's distribution (picking the best beam changes it, so the
auxiliary q could not be used as the draft distribution).

Under tensor (or pipeline) parallelism only the first rank runs the auxiliary model,
on transformers; drafts and their log-probabilities are broadcast, so every rank takes
the same decisions.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_lookahead.metrics import ProposerStats, SnapshotWriter
from vllm_lookahead.mtad.acceptance import joint_accept
from vllm_lookahead.mtad.beams import AuxiliaryState, BeamSampler, DraftJob
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.options import method_options
from vllm_lookahead.worker import runner as runner_state
from vllm_lookahead.worker import sampler

logger = logging.getLogger(__name__)


class MTADProposer:
    """vLLM ``custom_class`` drafter for ``{"method": "mtad"}``."""

    def __init__(self, vllm_config: Any):
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.options = method_options(vllm_config, MTADOptions)
        self._vllm_config = vllm_config
        self._dtype = vllm_config.model_config.dtype
        self._seed = vllm_config.model_config.seed or 0
        self._stats = ProposerStats()
        self._snapshots = SnapshotWriter(vllm_config, runner_state.worker_rank())
        self._runner: Any = None
        self._drafter: Any = None  # PagedDrafter or TransformersDrafter, None on other ranks
        self._states: dict[str, AuxiliaryState] = {}
        # request id -> (draft tokens, their auxiliary log-probabilities), until verified
        self._drafts: dict[str, tuple[list[int], list[float]]] = {}

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
        opts = self.options
        sampler_ = BeamSampler(opts.beam_width, opts.draft_temperature, opts.draft_top_k,
                               opts.draft_top_p, self._seed, runner_state.device(self._runner))
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
                    auxiliary_model.PagedModel(model, aux_config, self._runner), sampler_)
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
            self._drafter = TransformersDrafter(model, sampler_)

    def _why_not_vllm(self) -> str | None:
        if self.options.auxiliary_runner == "transformers":
            return "auxiliary_runner is 'transformers'"
        if runner_state.model_parallel_size() > 1:
            return ("tensor or pipeline parallelism (vLLM would shard it over the ranks; "
                    "MTAD drafts on the first rank)")
        return None

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        for req_id in finished | preempted:
            self._states.pop(req_id, None)
            self._drafts.pop(req_id, None)
        if self._snapshots.due() or not self._drafts:
            self._snapshots.write(self.stats)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        start = time.perf_counter()
        req_ids = runner_state.request_ids(self._runner)
        jobs = []  # (row, request id, context length, draft length)
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # partial prefill chunk: nothing to draft yet
                continue
            self._stats.generated_tokens += len(sampled)
            self._stats.request_passes += 1
            num_tokens = int(num_tokens_no_spec[row])
            # never past max_model_len: the token after the draft needs a slot too
            length = min(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
            if length > 0:
                jobs.append((row, req_ids[row], num_tokens, length))

        results = None
        if self._drafter is not None and jobs:
            beams = self._drafter.draft([
                DraftJob(self._states.setdefault(req_id, AuxiliaryState()),
                         token_ids_cpu[row, :num_tokens], length,
                         runner_state.is_greedy(self._runner, req_id), row)
                for row, req_id, num_tokens, length in jobs])
            results = [([], []) if b is None else b.best() for b in beams]
        results = runner_state.broadcast_from_first_tp_rank(results) if jobs else []

        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for (row, req_id, _, _), (tokens, logq) in zip(jobs, results):
            if not tokens:
                continue
            drafts[row] = tokens
            self._drafts[req_id] = (tokens, logq)
            self._stats.drafts += 1
            self._stats.draft_tokens += len(tokens)
        self._stats.steps += 1
        self._stats.seconds += time.perf_counter() - start
        if self._snapshots.due():
            self._snapshots.write(self.stats)
        return drafts

    # -- verification (joint mode) ---------------------------------------------------

    def accept(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        max_spec_len: int,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling_metadata: Any,
    ) -> torch.Tensor | None:
        """MTAD's decisions for one verification pass; None for vLLM's warm-up runs."""
        req_ids = runner_state.request_ids(self._runner)
        if len(req_ids) != len(num_draft_tokens):
            return None
        drafted = draft_token_ids.tolist()
        logq: list[float] = []
        start = 0
        for req_id, count in zip(req_ids, num_draft_tokens):
            tokens, values = self._drafts.get(req_id, ([], []))
            if tokens[:count] != drafted[start:start + count]:
                raise RuntimeError(
                    f"vllm-lookahead mtad: request {req_id}: the verified draft is not the "
                    "one this worker proposed (no auxiliary log-probabilities for it)"
                )
            logq.extend(values[:count])
            start += count
        return joint_accept(
            draft_token_ids, num_draft_tokens, max_spec_len, target_logits,
            bonus_token_ids, torch.tensor(logq, dtype=torch.float32),
            sampler.greedy_rows(sampling_metadata, len(req_ids)),
            self.options.acceptance_threshold, sampler.row_generators(sampling_metadata),
        )
