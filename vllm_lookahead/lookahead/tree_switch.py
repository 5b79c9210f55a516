"""Whether this worker grows tree drafts, and in which steps: the tree options say so
until the worker's start-up findings (the target's attention, the tree step's
self-check) say otherwise, and drafts are linear from then on (recycling ``auto``,
which pays only with trees, ends with them); while trees are on, ``on`` grows them
in every step that may have them and ``auto`` where they were measured to pay
(``tree_choice.py``)."""

from __future__ import annotations

from typing import Any

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.drafts import DraftSources
from vllm_lookahead.lookahead.tree_choice import TreeChoice
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker import tree_step

logger = get_logger(__name__)


class TreeSwitch:
    """Decides whether trees are on (``on``) and whether a step grows them
    (``wanted``)."""

    def __init__(self, options: LookaheadOptions, sources: DraftSources):
        self.options = options
        self._sources = sources
        self.on = options.tree_drafts
        self.choice = TreeChoice() if options.trees == "auto" else None

    def wanted(self, num_requests: int) -> bool:
        """Grow trees in the next step of ``num_requests`` decoding requests."""
        if not self.on:
            return False
        return self.choice is None or self.choice.wanted(num_requests)

    def timed(self, num_requests: int, tree: bool, seconds: float, tokens: int,
              main_tokens: int, linear_seconds: float | None) -> None:
        """A decode step's shape, time and tokens (``TreeChoice.add``), for trees
        ``auto``."""
        if self.on and self.choice is not None:
            self.choice.add(num_requests, tree, seconds, tokens, main_tokens, linear_seconds)

    def check_attention(self, runner: Any) -> None:
        """With trees on, the target's attention must mask trees (trees ``on``: an
        error; ``auto``: linear drafts, logged)."""
        if not self.on:
            return
        if self.options.trees == "on":
            tree_step.check_tree_attention(runner)
            return
        problems = tree_step.tree_attention_problems(runner)
        if problems:
            if runner_state.is_first_tp_rank():
                logger.info("vllm-lookahead: trees auto: off, drafts are linear: this model's "
                            "attention cannot take them here: %s", "; ".join(problems))
            self.turn_off()

    def read_tree_check(self, check: Any) -> None:
        """The tree step's self-check on this device: a failure turns trees ``auto``
        off (logged by the check) and refuses trees ``on``, which the user asked for."""
        if check.passed:
            return
        if self.options.trees == "on":
            raise RuntimeError(
                f"lookahead: trees is 'on', but the {check.describe()}. Set trees to "
                "'auto' (linear drafts where the check fails) or 'off'.")
        self.turn_off()

    def turn_off(self) -> None:
        self.on = False
        if self.options.recycle_top_k == "auto":  # recycled top-k pays only with trees
            self._sources.recycled = None
