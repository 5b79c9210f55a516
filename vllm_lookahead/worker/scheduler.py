"""The engine core's part of tree verification: with tree drafts on, the branches'
scratch blocks (the pool's last ids; workers compute the same ids) are taken out of
vLLM's KV block pool for good."""

from __future__ import annotations

import logging

from vllm_lookahead import _patching
from vllm_lookahead.options import method_config
from vllm_lookahead.worker import tree_attention

logger = logging.getLogger(__name__)


def install() -> None:
    from vllm.v1.core.sched import scheduler

    _patching.wrap(scheduler.Scheduler, "__init__", hold_back_scratch_blocks)


def hold_back_scratch_blocks(original):
    """Wrap ``Scheduler.__init__``: take the scratch blocks out with ``BlockPool.touch``."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        options = method_config(self.vllm_config)
        if options.get("method") != "lookahead" or not (
                options.get("tree_candidates") or options.get("tree_window")):
            return
        pool = self.kv_cache_manager.block_pool
        config = self.kv_cache_config
        count = tree_attention.scratch_block_count(
            config.num_blocks, config.kv_cache_groups[0].kv_cache_spec.block_size,
            self.vllm_config.speculative_config.num_speculative_tokens)
        blocks = [pool.blocks[i] for i in tree_attention.scratch_block_ids(config.num_blocks,
                                                                           count)]
        pool.touch(blocks)
        logger.info("vllm-lookahead: %d KV blocks held back for tree branches", count)

    return __init__
