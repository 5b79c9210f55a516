"""The engine core's part of tree verification and MTAD drafting: scratch blocks
(``scratch.py``) are taken out of vLLM's KV block pool for good (handed back only for
the moment of a prefix-cache reset), only those the workers use once their start-up
decisions are made (lookahead's trees ``auto`` off: none); MTAD's requests get
lookahead slots past their scheduled tokens for the auxiliary model's draft (γ tokens,
not vLLM's ``num_speculative_tokens``, which is γ × B with ``candidates`` other than
``"best"``)."""

from __future__ import annotations

import inspect
from typing import Any

from vllm_lookahead import _patching
from vllm_lookahead.log import get_logger
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.options import method_config, method_options
from vllm_lookahead.worker.scratch import blocks_in_use, scratch_blocks

logger = get_logger(__name__)

#: The scratch blocks the workers use, by ``id`` of the KV cache config the engine core
#: builds its scheduler with; taken by that scheduler's ``__init__``.
_reported: dict[int, list[int]] = {}


def install() -> None:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine.core import EngineCore

    _patching.wrap(EngineCore, "_initialize_kv_caches", ask_workers_for_scratch)
    _patching.wrap(scheduler.Scheduler, "__init__", hold_back_blocks)
    if isinstance(inspect.getattr_static(VllmConfig, "num_lookahead_tokens", None), property):
        _patching.wrap(VllmConfig, "num_lookahead_tokens", count_mtad_lookahead_slots)


def mtad_lookahead_slots(vllm_config: Any) -> int:
    """KV slots past a request's scheduled tokens that MTAD's auxiliary model writes
    its draft to (0 for other methods): the draft length γ."""
    if method_config(vllm_config).get("method") != "mtad":
        return 0
    return method_options(vllm_config, MTADOptions).draft_length(
        vllm_config.speculative_config.num_speculative_tokens)


def count_mtad_lookahead_slots(original):
    """Wrap the ``VllmConfig.num_lookahead_tokens`` property (vLLM 0.32): the scheduler
    reads it in ``__init__`` for its admission estimates (``_spec_decode_step_blocks``)
    as well as for ``allocate_slots``, so MTAD's slots must be in it from the start."""
    def num_lookahead_tokens(self):
        return max(original(self), mtad_lookahead_slots(self))

    return num_lookahead_tokens


def ask_workers_for_scratch(original):
    """Wrap ``EngineCore._initialize_kv_caches`` (called after the engine core loads
    plugins; the scheduler is built from what it returns): the workers have their KV
    cache and have decided on trees (``start_up.check_at_start``); ask every one which
    scratch blocks it uses, so that a pool whose trees ended off holds none back."""
    def _initialize_kv_caches(self, vllm_config, *args, **kwargs):
        config = original(self, vllm_config, *args, **kwargs)
        if method_config(vllm_config):
            used = self.model_executor.collective_rpc(blocks_in_use)
            _reported[id(config)] = sorted(set().union(*used))
        return config

    return _initialize_kv_caches


def hold_back_blocks(original):
    """Wrap ``Scheduler.__init__``: take the scratch blocks the workers reported out
    with ``BlockPool.touch`` (a scheduler built without that report holds every block
    the workers might use); for MTAD, make sure of the lookahead slots (vLLM 0.26 sets
    ``num_lookahead_tokens`` in ``__init__`` from the method, with no ``VllmConfig``
    property and no estimate that reads it early)."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not method_config(self.vllm_config):
            return
        self.num_lookahead_tokens = max(self.num_lookahead_tokens,
                                        mtad_lookahead_slots(self.vllm_config))
        config = self.kv_cache_config
        held = _reported.pop(id(config), None)
        if held is None:
            held = scratch_blocks(self.vllm_config, config.num_blocks,
                                  config.kv_cache_groups[0].kv_cache_spec.block_size).all
        if held:
            pool = self.kv_cache_manager.block_pool
            blocks = [pool.blocks[i] for i in held]
            pool.touch(blocks)
            _release_while_resetting(pool, blocks)
            logger.info("vllm-lookahead: %d KV blocks held back for tree branches and "
                        "beams", len(held))

    return __init__


def _release_while_resetting(pool: Any, held: list[Any]) -> None:
    """Wrap ``pool.reset_prefix_cache`` (instance attribute): vLLM refuses to reset the
    prefix cache while any block is in use, and held blocks always are. They are handed
    back for the reset and taken again at once; the reset allocates nothing, so the
    same blocks come back, and the workers' scratch ids stay right."""
    original = pool.reset_prefix_cache

    def reset_prefix_cache(*args, **kwargs):
        pool.free_blocks(held)
        try:
            return original(*args, **kwargs)
        finally:
            pool.touch(held)

    pool.reset_prefix_cache = reset_prefix_cache
