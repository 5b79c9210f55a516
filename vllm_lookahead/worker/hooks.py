"""What the worker patches call on vLLM's drafter: one Protocol, every hook optional.

vLLM builds the drafter (our proposer) from ``speculative_config`` and knows only its
``propose`` and ``load_model``; everything else reaches it through these hooks, which
``runner.binding_init`` looks up once when the model runner is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class VerificationCapture:
    """The target's view of one verification pass, rows in input-batch order.

    Tensors stay on the device until the proposer reads them, after vLLM's own sync.
    """

    num_draft_tokens: list[int]
    draft_token_ids: torch.Tensor  # [sum(num_draft_tokens)]
    target_argmax: torch.Tensor  # [sum(num_draft_tokens)]
    bonus_token_ids: torch.Tensor  # [rows]
    # the drafter's ``capture_top_k`` most likely tokens at each position, if it asks
    target_top_ids: torch.Tensor | None = None  # [sum(num_draft_tokens), k]
    target_top_logprobs: torch.Tensor | None = None  # [sum(num_draft_tokens), k]


class AcceptanceRule(Protocol):
    """Replaces vLLM's decisions: output tokens ``[rows, max_spec_len + 1]``, or None
    to leave this pass to vLLM (e.g. its warm-up runs). ``trees`` (input-batch row ->
    ``tree_attention.TreeRow``): the rows verified as trees; their output is an
    accepted root-down path and one more token (the worker then moves its KV)."""

    def __call__(self, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                 max_spec_len: int, target_logits: torch.Tensor,
                 bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                 trees: dict[int, Any]) -> torch.Tensor | None: ...


class DrafterHooks(Protocol):
    """Every hook a drafter may have; a drafter without one is not called for it."""

    #: the target's top-k the drafter wants captured at every draft position (0: argmax)
    capture_top_k: int
    #: the target's top-k the drafter wants at each row's last position, the one vLLM
    #: samples the next (bonus) token from, in every pass, drafts or none (0: none)
    capture_last_top_k: int
    #: replaces vLLM's verification (MTAD's joint rule), or None
    acceptance_rule: AcceptanceRule | None
    #: the drafter will build tree drafts (read once the KV cache exists: the worker
    #: then self-checks the tree step and reports with ``on_tree_check``)
    trees_on: bool
    #: the worker measures the target's pass by token count once the KV cache exists
    #: and reports with ``on_start_cost``
    measures_start_cost: bool

    def bind_model_runner(self, runner: Any) -> None:
        """The runner the drafter serves (request ids per row, the KV cache)."""

    def on_step_start(self, num_scheduled_tokens: int, decode_only: bool,
                      num_requests: int) -> None:
        """A step of ``num_requests`` starts with this many tokens; the time until the
        next one starts is its cost."""

    def on_requests_removed(self, finished: set[str], preempted: set[str]) -> None:
        """Requests finished (or aborted) or preempted: free their state."""

    def on_verification(self, capture: VerificationCapture) -> None:
        """The target's predictions at every draft position of the pass just verified."""

    def on_last_top_k(self, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> None:
        """The target's top-k ids and log-probabilities (``[rows, k]``, rows in
        input-batch order) at each row's last position of the pass just run."""

    def draft_tree(self, req_id: str, scheduled: list[int]) -> np.ndarray | None:
        """Parents of ``[root] + scheduled`` (the request's draft as vLLM scheduled
        it), or None to verify it as a linear draft."""

    def on_start_cost(self, cost: Any) -> None:
        """What one more token costs the target here (``start_cost.StartCost``), measured
        before the self-check."""

    def on_tree_check(self, check: Any) -> None:
        """The start-up self-check of the tree step (``tree_check.TreeCheck``): trees
        only if it passed."""

    def on_tree_planned(self, req_id: str, branches: int | None) -> None:
        """The tree became ``branches`` extra attention sequences, or (None) it is
        verified as a linear draft for want of scratch blocks."""


HOOKS = frozenset(DrafterHooks.__annotations__) | {
    name for name in vars(DrafterHooks) if not name.startswith("_")}


def hook(drafter: Any, name: str) -> Any:
    """The drafter's hook ``name`` (one of ``DrafterHooks``), or None if it has none."""
    assert name in HOOKS, name
    return getattr(drafter, name, None)
