"""KV blocks held back from vLLM's pool for tree branches and MTAD beams. Every worker
computes the same ids from the same numbers: the pool's last blocks, beams' before
trees'. The engine core's scheduler takes out those the workers use (``scheduler.py``):
tree branches' only where trees are on after the start-up decisions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.options import method_config, method_options
from vllm_lookahead.worker import tree_attention
from vllm_lookahead.worker.hooks import hook

#: Never more than this share of the pool for MTAD's beams; a request that finds
#: none left drafts one beam.
BEAM_SHARE = 8


@dataclass(frozen=True)
class ScratchBlocks:
    trees: list[int]
    beams: list[int]

    @property
    def all(self) -> list[int]:
        return self.beams + self.trees


def scratch_blocks(vllm_config: Any, num_blocks: int, block_size: int) -> ScratchBlocks:
    options = method_config(vllm_config)
    method = options.get("method")
    trees = beams = 0
    if method == "lookahead" and method_options(vllm_config, LookaheadOptions).tree_drafts:
        trees = tree_attention.scratch_block_count(
            num_blocks, block_size, vllm_config.speculative_config.num_speculative_tokens)
    if method == "mtad":
        mtad = method_options(vllm_config, MTADOptions)
        # a beam, and a path of the beams' trie, is γ tokens long: not vLLM's γ × B
        draft_length = mtad.draft_length(vllm_config.speculative_config.num_speculative_tokens)
        if mtad.candidates != "best":
            trees = tree_attention.scratch_block_count(num_blocks, block_size, draft_length)
        if mtad.auxiliary_runner == "vllm":
            beams = min(vllm_config.scheduler_config.max_num_seqs * (mtad.beam_width - 1)
                        * tree_attention.blocks_per_branch(block_size, draft_length),
                        num_blocks // BEAM_SHARE)
    first = num_blocks - trees - beams
    return ScratchBlocks(trees=list(range(first + beams, num_blocks)),
                         beams=list(range(first, first + beams)))


def kv_block_size(runner: Any) -> int:
    return runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def runner_scratch(runner: Any) -> ScratchBlocks:
    """The scratch blocks of ``runner``'s KV cache (whether its drafter uses them or not)."""
    return scratch_blocks(runner.vllm_config, runner.kv_cache_config.num_blocks,
                          kv_block_size(runner))


def blocks_in_use(worker: Any) -> list[int]:
    """The scratch blocks ``worker``'s drafter uses, once the KV cache exists and the
    drafter has decided on trees (the engine core asks through ``collective_rpc``)."""
    runner = worker.model_runner
    blocks = runner_scratch(runner)
    trees_on = bool(hook(getattr(runner, "drafter", None), "trees_on"))
    return blocks.beams + (blocks.trees if trees_on else [])
