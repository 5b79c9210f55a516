"""Reading the last verification pass and learning from it, request by request: what
was accepted, by source (``feedback.py``), the target's predictions harvested as one
Jacobi iteration into the request's pool and recycled into the worker's top-k table,
the new context read, and the request's earlier drafts checked against it
(``hindsight.py``), the evidence behind the cost-aware cut."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lookahead.lookahead import feedback, hindsight, trees
from vllm_lookahead.lookahead.budget import WorkerEstimates
from vllm_lookahead.lookahead.calibration import AcceptanceCalibration
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.drafts import DraftSources
from vllm_lookahead.lookahead.state import DecodingRows, RequestState, RequestStates
from vllm_lookahead.metrics import ACCEPTED_SOURCES, ProposerStats
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker.hooks import VerificationCapture


class PassLearner:
    """Decides what each request's next drafts start from: its state after the pass
    (context, pool, lattice, draft limit) and the worker's ``estimates`` that the cut
    and the trees read."""

    def __init__(self, options: LookaheadOptions, states: RequestStates,
                 sources: DraftSources, estimates: WorkerEstimates, stats: ProposerStats,
                 calibration: AcceptanceCalibration):
        #: what the worker's hooks handed over during the pass, read at the next step
        self._capture: VerificationCapture | None = None
        self._last_top_k: tuple[torch.Tensor, torch.Tensor] | None = None
        self.options = options
        self._states = states
        self._sources = sources
        self._estimates = estimates
        self._stats = stats
        self._calibration = calibration
        #: the last pass's tokens, and those its main drafts alone earned (trees auto)
        self.pass_tokens = 0
        self.pass_main_tokens = 0
        hindsight.warm_up()

    def keep_capture(self, capture: VerificationCapture) -> None:
        """The pass's verification, read at the next step."""
        self._capture = capture

    def keep_last_top_k(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        """The target's top-k at each row's last position, recycled at the next step."""
        self._last_top_k = (top_ids, top_logprobs)

    def read_pass(self, runner: Any, sampled_token_ids: list[list[int]],
                  num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray) -> DecodingRows:
        """Learn from the last pass, row by row; the rows that decode."""
        req_ids = runner_state.request_ids(runner)
        live = runner_state.live_request_ids(runner)
        self._states.drop_forgotten(live)
        self._sources.live.keep_only(live)
        verified = self._verified_rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if self.options.cost_aware_drafts:
            self._estimates.decay()
        decoding = DecodingRows()
        self.pass_tokens = self.pass_main_tokens = 0
        for row, emitted in enumerate(sampled_token_ids):
            if not emitted:  # partial prefill chunk: nothing to draft yet
                continue
            state = self._states.state_for(runner, req_ids[row], row)
            self._learn(state, emitted, verified.get(row))
            num_tokens = int(num_tokens_no_spec[row])
            state.read_context(token_ids_cpu[row], num_tokens, self.options.ngram_size)
            self._sources.live.extend(req_ids[row], state.output)
            if self.options.cost_aware_drafts:
                self._check_in_hindsight(state, token_ids_cpu[row], num_tokens)
            decoding.add(row, req_ids[row], state)
        return decoding

    def _verified_rows(self, sampled_token_ids: list[list[int]],
                       num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray
                       ) -> dict[int, feedback.Verified]:
        """Take the pass's capture and last top-k: recycle them (Token Recycling) and
        return the rows that verified a draft, if the harvest, rescoring or the window
        read them."""
        capture = None if self._capture is None else feedback.HostCapture(self._capture)
        self._capture = None
        last_top_k, self._last_top_k = self._last_top_k, None
        if self._sources.recycled is not None:
            self._stats.recycled_rows += feedback.recycle(
                self._sources.recycled, capture, last_top_k, sampled_token_ids,
                num_tokens_no_spec, token_ids_cpu)
        wanted = (self.options.harvest_jacobi or self.options.rescoring_top_k
                  or self.options.tree_window)
        return (feedback.verified_rows(capture, len(sampled_token_ids),
                                       with_top_k=bool(self.options.rescoring_top_k))
                if wanted else {})

    def _check_in_hindsight(self, state: RequestState, context: np.ndarray,
                            num_tokens: int) -> None:
        """Compare the request's earlier drafts, kept or cut, with the tokens it then
        generated: the evidence behind its first-token rate and the worker's acceptance
        by depth, which therefore keeps coming when the cut drops every draft."""
        depth_acceptance = self._estimates.depth_acceptance[state.sampling_class]
        for outcome in state.hindsight.settle(context, num_tokens):
            if outcome.first == 0:
                state.count_first_token(outcome.confirmed > 0, outcome.first_estimate)
            depth_acceptance.add(outcome.first, outcome.compared, outcome.confirmed,
                                 outcome.classes)
            self._stats.cut_tokens_confirmed += outcome.cut_confirmed
            if outcome.settled is not None:
                self._calibrate(state, outcome.settled)

    def _calibrate(self, state: RequestState, draft: hindsight.ProposedDraft) -> None:
        """A settled draft's kept tokens against the text: into the calibration of its
        sampling class's next estimates (by their uncalibrated estimates) and into the
        report (by the calibrated ones the cut used)."""
        if draft.kept_estimates is None or not len(draft.kept_estimates[0]):
            return
        raw, calibrated = draft.kept_estimates
        hits = draft.hits()[: len(raw)]
        self._estimates.calibrations[state.sampling_class].add(raw, hits)
        self._calibration.add(calibrated, hits)
        self._stats.kept_tokens_expected += float(calibrated.sum())
        self._stats.kept_tokens_matched += int(hits.sum())

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
            self._stats.count_by_source(state.draft_origin.tokens_by_source(main_accepted),
                                        ACCEPTED_SOURCES)
            self._sources.learn(state.draft_origin, main_accepted)
        self.pass_tokens += accepted + 1
        self.pass_main_tokens += main_accepted + 1
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
