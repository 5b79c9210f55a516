"""Lookahead as a Model Runner V2 speculator (vLLM 0.34 on): the proposer core behind
V2's ``BaseSpeculator``, as ``proposer.py``'s ``custom_class`` adapter puts it behind V1.

Each ``propose`` synchronises once with the device (``history.TokenHistory.update``),
runs the core on the host and copies its drafts back, ``-1`` past a draft's end (V2's
padding). Under vLLM's asynchronous scheduling that sync keeps the host from preparing
the next step while the device samples: its price is unmeasured (no GPU was lent since
the port), and ``docs/model-runner-v2.md`` plans the device-side drafting that removes it.

What V2 changes for the core (``v2_options``, said once at start-up):

- linear drafts: V2 verifies no trees;
- every draft filled to K (``uniform_drafts`` on) and no cost-aware cut: V2 computes
  all K draft slots of every decoding request whatever the draft's length (the scheduler
  sees K placeholders), so a shorter draft saves nothing;
- no Jacobi harvest, rescoring or Token Recycling: V2 offers a speculator neither the
  target's predictions at draft positions nor its top-k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.proposer import LookaheadProposer
from vllm_lookahead.model_runner_v2.history import RunnerView, TokenHistory
from vllm_lookahead.options import method_options

logger = get_logger(__name__)

#: what V2 cannot serve of the core's options (module docstring), as V2 runs them
V2_OPTIONS = {"trees": "off", "uniform_drafts": "on", "cost_aware_drafts": False,
              "harvest_jacobi": False, "rescoring_top_k": 0, "recycle_top_k": 0}


def v2_options(options: LookaheadOptions) -> LookaheadOptions:
    """The options as V2 runs them; a changed explicit choice of the user's is logged."""
    defaults = LookaheadOptions()
    changed = sorted(name for name, value in V2_OPTIONS.items()
                     if getattr(options, name) != getattr(defaults, name)
                     and getattr(options, name) != value)
    if changed:
        logger.warning("vllm-lookahead: vLLM's Model Runner V2 cannot serve %s as asked; "
                       "running %s", ", ".join(changed),
                       ", ".join(f"{name}={V2_OPTIONS[name]}" for name in changed))
    logger.info("vllm-lookahead: Model Runner V2: linear drafts filled to K, without the "
                "target's predictions at draft positions (no trees, harvest or recycling)")
    return dataclasses.replace(options, **V2_OPTIONS)


class LookaheadSpeculator(BaseSpeculator):
    """``{"method": "lookahead"}`` on Model Runner V2."""

    def __init__(self, vllm_config: Any, device: torch.device, req_states: Any):
        self.vllm_config = vllm_config
        self.device = device
        self.req_states = req_states
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.options = v2_options(method_options(vllm_config, LookaheadOptions))
        self.history = TokenHistory(vllm_config.scheduler_config.max_num_seqs,
                                    vllm_config.model_config.max_model_len)
        self.view = RunnerView(device)
        self.core = self._new_core()

    def _new_core(self) -> LookaheadProposer:
        core = LookaheadProposer(self.vllm_config, self.options)
        core.bind_model_runner(self.view)
        return core

    # -- V2's interface ------------------------------------------------------------------

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        """Nothing to capture: drafting runs on the host."""

    def capture(self) -> None:
        """Nothing to capture: drafting runs on the host."""

    def add_request(self, req_index: int) -> None:
        """A request took slot ``req_index``: its history is copied whole at its first
        decode."""
        self.history.forget(req_index)

    def note_request(self, req_id: str, sampling_params: Any) -> None:
        """A request arrives with its ``SamplingParams`` (``model_runner_v2``'s wrap of
        the runner's ``add_requests``); one known already was preempted and resumes."""
        if req_id in self.view.requests:
            self.core.on_requests_removed(set(), {req_id})
        self.view.add(req_id, sampling_params)

    def on_requests_finished(self, finished_req_ids: set[str]) -> None:
        self.core.on_requests_removed(set(finished_req_ids), set())
        for req_id in finished_req_ids:
            self.view.requests.pop(req_id, None)

    def reset_state(self) -> None:
        """vLLM's warm-up requests are done: forget their outputs (the corpus)."""
        self.core = self._new_core()

    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any,
                last_hidden_states: Any, aux_hidden_states: Any, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, last_sampled: torch.Tensor,
                next_prefill_tokens: torch.Tensor, temperature: torch.Tensor,
                seeds: torch.Tensor, dp_sync_state: Any = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None,
                is_profile: bool = False, num_speculative_tokens: int | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Drafts ``[num_reqs, K]`` on the device for the batch's rows (``-1`` pads)."""
        num_reqs = input_batch.num_reqs
        drafts = np.full((num_reqs, self.num_speculative_tokens), -1, dtype=np.int64)
        if not (dummy_run or is_profile) and num_reqs:
            self._draft(input_batch, num_sampled[:num_reqs], drafts)
        return torch.from_numpy(drafts).to(self.device, non_blocking=True)

    # -- the step --------------------------------------------------------------------------

    def _draft(self, input_batch: Any, num_sampled: torch.Tensor, out: np.ndarray) -> None:
        slots = np.asarray(input_batch.idx_mapping_np[: input_batch.num_reqs], dtype=np.int64)
        lengths, sampled = self.history.update(self.req_states,
                                               input_batch.idx_mapping[: len(slots)], slots,
                                               num_sampled, self.num_speculative_tokens + 1)
        tokens = self.history.rows(slots, lengths)
        emitted = [tokens[row, length - new:length].tolist() if new else []
                   for row, (length, new) in enumerate(zip(lengths, sampled))]
        self.view.show_batch(list(input_batch.req_ids[: len(slots)]),
                             self.req_states.prompt_len.np[slots])
        for row, draft in enumerate(self.core.propose(emitted, lengths, tokens)):
            out[row, : len(draft)] = draft
