"""The engine core's part of tree verification and MTAD drafting: scratch blocks
(``scratch.py``) are taken out of vLLM's KV block pool for good; MTAD's requests get
lookahead slots past their scheduled tokens for the auxiliary model's draft."""

from __future__ import annotations

import logging

from vllm_lookahead import _patching
from vllm_lookahead.options import method_config
from vllm_lookahead.worker.scratch import scratch_blocks

logger = logging.getLogger(__name__)


def install() -> None:
    from vllm.v1.core.sched import scheduler

    _patching.wrap(scheduler.Scheduler, "__init__", hold_back_blocks)


def hold_back_blocks(original):
    """Wrap ``Scheduler.__init__``: take the scratch blocks out with ``BlockPool.touch``;
    for MTAD, reserve ``num_speculative_tokens`` lookahead slots (as vLLM does for
    ``draft_model``)."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        method = method_config(self.vllm_config).get("method")
        if method is None:
            return
        if method == "mtad":
            self.num_lookahead_tokens = max(
                self.num_lookahead_tokens,
                self.vllm_config.speculative_config.num_speculative_tokens)
        config = self.kv_cache_config
        held = scratch_blocks(self.vllm_config, config.num_blocks,
                              config.kv_cache_groups[0].kv_cache_spec.block_size).all
        if held:
            pool = self.kv_cache_manager.block_pool
            pool.touch([pool.blocks[i] for i in held])
            logger.info("vllm-lookahead: %d KV blocks held back for tree branches and "
                        "beams", len(held))

    return __init__
