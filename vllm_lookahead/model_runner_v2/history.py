"""The host's copy of each request's tokens, and the runner as the proposer core reads it.

vLLM's Model Runner V2 keeps token histories on the device (``RequestState``), where
the core's compiled suffix match cannot read them. After each pass the speculator copies
back what the pass appended (a window of K + 1 tokens a row, one transfer with the
lengths) and, for a request it has not seen, its whole history once.

| vLLM attribute (0.34.0) | use | why |
|---|---|---|
| ``RequestState.all_token_ids.gpu``, ``.total_len.gpu`` | read | each row's tokens after the pass (``post_update`` has appended the sampled ones) |
| ``RequestState.prompt_len.np`` | read | prompt length by slot, for the pool's seeding and ``min_tokens`` |
| ``InputBatch.req_ids``, ``.idx_mapping``, ``.idx_mapping_np``, ``.num_reqs`` | read | request id and slot of each row |
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


class TokenHistory:
    """Tokens by request-state slot, as many as vLLM keeps (``max_model_len``)."""

    def __init__(self, max_num_reqs: int, max_model_len: int):
        self.tokens = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        #: tokens held by slot; -1: the slot's request is new here (copied whole next)
        self.lengths = np.full(max_num_reqs, -1, dtype=np.int64)

    def forget(self, slot: int) -> None:
        self.lengths[slot] = -1

    def update(self, req_states: Any, idx_mapping: torch.Tensor, slots: np.ndarray,
               num_sampled: torch.Tensor, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Bring the rows' histories up to date after a pass; their lengths and the
        tokens each sampled (0 for a prompt chunk), by row. One host synchronisation."""
        all_tokens, total_len = req_states.all_token_ids.gpu, req_states.total_len.gpu
        lengths = total_len[idx_mapping].to(torch.int64)
        columns = (lengths[:, None] - window
                   + torch.arange(window, device=lengths.device)).clamp_(min=0)
        last = all_tokens[idx_mapping[:, None], columns].to(torch.int64)
        packed = torch.cat([lengths[:, None], num_sampled[:, None].to(torch.int64), last],
                           dim=1).cpu().numpy()
        lengths, sampled, last = packed[:, 0], packed[:, 1], packed[:, 2:]
        for row, slot in enumerate(slots):
            length, new = int(lengths[row]), int(sampled[row])
            held = self.lengths[slot]
            if held < 0 or held + new != length or new > window:
                self.tokens[slot, :length] = all_tokens[int(slot), :length].cpu().numpy()
            elif new:
                self.tokens[slot, held:length] = last[row, window - new:]
            self.lengths[slot] = length
        return lengths, sampled

    def rows(self, slots: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The rows' tokens in batch order (as V1's ``token_ids_cpu``), as wide as the
        longest."""
        width = int(lengths.max(initial=0)) + 1
        return self.tokens[slots, :width]


class RunnerView:
    """What ``worker.runner_state`` reads of a V1 runner, from a V2 batch: request ids
    and prompt lengths by row, live requests with their ``SamplingParams``."""

    def __init__(self, device: torch.device):
        self.device = device
        #: live requests (request id -> object with ``sampling_params``), as V1's
        #: ``runner.requests``
        self.requests: dict[str, Any] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(0))

    def add(self, req_id: str, sampling_params: Any) -> None:
        self.requests[req_id] = SimpleNamespace(sampling_params=sampling_params)

    def show_batch(self, req_ids: list[str], prompt_lengths: np.ndarray) -> None:
        self.input_batch.req_ids = req_ids
        self.input_batch.num_prompt_tokens = prompt_lengths
