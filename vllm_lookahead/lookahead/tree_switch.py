"""Whether this worker grows tree drafts: the tree options say so until the worker's
start-up findings (the target's attention, trees ``auto``'s cost measurement, the
tree step's self-check) say otherwise; drafts are linear from then on, and recycling
``auto`` (which pays only with trees) ends with them."""

from __future__ import annotations

from typing import Any

from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.drafts import DraftSources
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker import tree_step

logger = get_logger(__name__)


class TreeSwitch:
    """Decides whether trees are on (``on``)."""

    def __init__(self, options: LookaheadOptions, sources: DraftSources):
        self.options = options
        self._sources = sources
        self.on = options.tree_drafts

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

    def read_start_cost(self, cost: Any) -> None:
        """Trees ``auto``: on only where the worker's start-up measurement
        (``worker.start_cost.StartCost``) found ``tree_free_tokens`` free; logged."""
        free, wanted = cost.free_tokens, self.options.tree_free_tokens
        verdict = "on, if the self-check passes" if free >= wanted else "off, drafts are linear"
        if runner_state.is_first_tp_rank():
            logger.info("vllm-lookahead: trees auto: %s: %s; trees need %d (tree_free_tokens; "
                        "trees on / off skips the measurement)", verdict, cost.describe(), wanted)
        if free < wanted:
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
