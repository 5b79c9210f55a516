"""The runner side of tree verification, for any attention backend: give tree nodes
their depth as position, plan each step's branches and scratch blocks, build the
backends' metadata from the branch-split batch (``tree_attention.py``), run steps with
trees without CUDA graphs, and refuse trees where the target's attention cannot take
them. Mechanism only: what runs it at start-up (its self-check, ``tree_check.py``, and
the cost measurement, ``start_cost.py``) sits above it, in ``start_up.py``.

A backend's own part (writing the branches' keys and values before its kernel) lives
beside this module, on top of the step it reads (``attention_backends.py``).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``runner._prepare_inputs`` (instance attribute, drafters with ``draft_tree`` only) | wrapped | after vLLM has computed the step's KV slots from linear positions, gives each tree node the position of its depth and plans the step's branches and their scratch blocks | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``builder.build`` of each ``runner.attn_groups[0][i].metadata_builders`` (instance attribute), ``.kernel_block_size`` | wrapped, read | in a step with trees, builds the backend's metadata from ``CommonAttentionMetadata`` split into branch sequences, without cascade attention | 0.32.0, 0.26.0 (CPU_ATTN); 0.33.0 read |
| ``runner._determine_batch_execution_and_padding`` (instance attribute, once the tree self-check has passed) | wrapped | a step with trees runs without CUDA graphs (``force_eager``) | 0.32.0, 0.26.0 read (called after ``_prepare_inputs``, has ``force_eager``); never run on CUDA |
| ``runner.input_batch`` (``req_ids``, ``num_computed_tokens_cpu``, ``block_table[0].slot_mapping.gpu``, ``block_table[0].block_table.np``), ``runner.query_start_loc.np``, ``SchedulerOutput.scheduled_spec_decode_tokens`` | read | each tree's row, prefix, first token and KV slots | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner.positions`` | written | a tree node's position is its depth | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner.kv_caches``, ``runner.attn_groups[0][0].backend`` | read | the layers' caches for the root-block copies, and their block dimension | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.model_executor.layers.attention.Attention`` layers of the target (``vllm.config.get_layers_from_vllm_config``: vLLM 0.26's Transformers modeling backend keeps them outside ``runner.model.modules()``), their ``impl`` (``attn_type``, ``sliding_window``, ``alibi_slopes``, ``sinks``, ``logits_soft_cap``, ``kv_cache_dtype``) and ``kv_cache_update_bypass`` (0.33); ``runner.uses_mrope`` | read | whether the target's attention can take trees | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lookahead import _patching
from vllm_lookahead.tree import depths_of, is_chain
from vllm_lookahead.worker import tree_attention
from vllm_lookahead.worker.hooks import DrafterHooks
from vllm_lookahead.worker.scratch import kv_block_size, runner_scratch

#: Attention implementations (by class name) the backend-neutral step runs on, each
#: with its ``forward`` wrapped (``attention_backends``); the start-up self-check still
#: has to pass on the device in use.
TREE_IMPLS = frozenset({"CPUAttentionBackendImpl", "FlashAttentionImpl", "TritonAttentionImpl",
                        "FlashInferImpl", "FlexAttentionImpl"})

# One model runner per worker process, hence one step's trees at a time.
_step: tree_attention.TreeStep | None = None


def active_step() -> tree_attention.TreeStep | None:
    """The trees of the step being computed, if it has any."""
    return _step


def finish_step() -> tree_attention.TreeStep | None:
    """The step's trees, for verification; later (dummy) runs see none."""
    global _step
    step, _step = _step, None
    return step


def place_tree_nodes(runner: Any, source: DrafterHooks) -> None:
    """Wrap ``runner._prepare_inputs`` (instance attribute): vLLM computes positions and
    KV slots as if the draft were linear; tree nodes keep those slots but get their
    depth as position, and the step's branches get scratch blocks."""
    original = runner._prepare_inputs

    def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        global _step
        result = original(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        _step = _trees_of_step(runner, source, scheduler_output)
        return result

    runner._prepare_inputs = _prepare_inputs


def run_tree_steps_eagerly(runner: Any) -> None:
    """Wrap ``runner._determine_batch_execution_and_padding`` (instance attribute; vLLM
    calls it after ``_prepare_inputs``): a step with trees runs without CUDA graphs. A
    tree of K nodes looks like a uniform K-token draft, so a graph captured with linear
    metadata could be replayed for it, without the tree's metadata and scratch writes.
    Other steps keep their graphs. Installed only once the self-check (which calls the
    model directly, without graph dispatch) has passed: a runner without trees keeps
    vLLM's own method."""
    original = getattr(runner, "_determine_batch_execution_and_padding", None)
    if original is None:  # no CUDA graph dispatch in this runner
        return

    def _determine_batch_execution_and_padding(*args, **kwargs):
        if _step is not None and _step.branches:
            kwargs["force_eager"] = True
        return original(*args, **kwargs)

    runner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding


def begin_step(step: tree_attention.TreeStep) -> None:
    """The step about to be computed has these trees (the self-check's own steps)."""
    global _step
    _step = step


def _trees_of_step(runner: Any, source: DrafterHooks, scheduler_output: Any
                   ) -> tree_attention.TreeStep | None:
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    if not spec_tokens:
        return None
    batch = runner.input_batch
    query_starts = runner.query_start_loc.np
    slot_mapping = batch.block_table[0].slot_mapping.gpu
    block_size = kv_block_size(runner)
    free_blocks = list(runner_scratch(runner).trees)
    rows, branches, prefixes = {}, [], {}
    for row, req_id in enumerate(batch.req_ids):
        scheduled = spec_tokens.get(req_id)
        if not scheduled:
            continue
        parents = source.draft_tree(req_id, list(scheduled))
        if parents is None or is_chain(parents):
            continue
        start, size = int(query_starts[row]), len(parents)
        prefix = int(batch.num_computed_tokens_cpu[row])
        planned = tree_attention.plan_branches(row, parents, start, prefix, block_size,
                                               free_blocks)
        source.on_tree_planned(req_id, None if planned is None else len(planned))
        if planned is None:  # out of scratch blocks: verified as a linear draft
            continue
        runner.positions[start : start + size] = torch.from_numpy(
            prefix + depths_of(parents)).to(runner.positions.device)
        rows[row] = tree_attention.TreeRow(
            parents=parents, first_token=start,
            slots=slot_mapping[start : start + size].cpu().numpy().astype(np.int64))
        branches.extend(planned)
        prefixes[row] = prefix
    if not rows:
        return None
    return start_step(runner, rows, branches, batch.block_table[0].block_table.np, prefixes)


def start_step(runner: Any, rows: dict[int, tree_attention.TreeRow],
               branches: list[tree_attention.Branch], block_tables: np.ndarray,
               prefixes: dict[int, int]) -> tree_attention.TreeStep:
    """The step's tensors, with each branch's root block copied into its first scratch
    block in every layer (before the forward)."""
    caches, dim = layer_caches(runner)
    step = tree_attention.make_step(rows, branches, block_tables, prefixes,
                                    kv_block_size(runner), caches[0].device)
    tree_attention.copy_root_blocks(caches, dim, step)
    return step


_stacked_caches: dict[int, tuple[list[torch.Tensor], int]] = {}


def layer_caches(runner: Any) -> tuple[list[torch.Tensor], int]:
    """The runner's KV caches for ``copy_root_blocks`` (stacked once per allocation)
    and the block dimension of one layer's cache."""
    first = runner.kv_caches[0]
    found = _stacked_caches.get(first.data_ptr())
    if found is None:
        _stacked_caches.clear()
        backend = runner.attn_groups[0][0].backend
        found = _stacked_caches[first.data_ptr()] = (
            tree_attention.stacked(runner.kv_caches), tree_attention.block_dim(backend, first))
    return found


def wrap_metadata_builders(runner: Any) -> None:
    """Wrap each attention metadata builder's ``build`` (instance attribute): in a step
    with tree branches it builds from the branch-split common metadata."""
    if len(runner.attn_groups) != 1:
        raise ValueError("lookahead: tree_candidates and tree_window need a model with one "
                         f"KV cache group (this one has {len(runner.attn_groups)}); set both "
                         "to 0 (linear drafts) for this model")
    for group in runner.attn_groups[0]:
        if getattr(group, "kernel_block_size", None) not in (None, kv_block_size(runner)):
            raise ValueError("lookahead: tree_candidates and tree_window need the attention "
                             "kernel's block size to equal the KV cache's; set both to 0")
        for builder in group.metadata_builders:
            _patching.wrap(builder, "build", _branch_aware_build)


def _branch_aware_build(original):
    def build(common_prefix_len, common_attn_metadata, *args, **kwargs):
        step = _step
        if step is not None and step.branches:
            common_attn_metadata = tree_attention.split_metadata(common_attn_metadata, step)
            common_prefix_len = 0  # no cascade attention over the split batch
            step.metadata_rewritten = True
        return original(common_prefix_len, common_attn_metadata, *args, **kwargs)

    return build


def check_tree_attention(runner: Any) -> None:
    """Raise unless every attention layer of the target can take trees here."""
    problems = tree_attention_problems(runner)
    if problems:
        raise ValueError(
            "lookahead: tree_candidates and tree_window need tree attention, which this "
            f"model cannot take here: {'; '.join(problems)}. Set both to 0 (linear "
            "drafts) for this model.")


def tree_attention_problems(runner: Any) -> list[str]:
    """Why the target's attention cannot take trees here (empty if it can): a tested
    backend, decoder self-attention without sliding window, ALiBi, soft-capping or
    sinks, an unquantized KV cache and plain (not multimodal) rotary positions."""
    problems = set()
    groups = getattr(runner, "attn_groups", None)  # known once the KV cache exists
    if groups and len(groups) != 1:
        problems.add(f"{len(groups)} KV cache groups")
    if getattr(runner, "uses_mrope", False):
        problems.add("multimodal rotary positions (M-RoPE)")
    for module in attention_layers(runner):
        impl = module.impl
        if type(impl).__name__ not in TREE_IMPLS:
            problems.add(f"attention implementation {type(impl).__name__} (trees run on "
                         f"{', '.join(sorted(TREE_IMPLS))})")
            continue
        if getattr(impl, "attn_type", "decoder") != "decoder":
            problems.add(f"{impl.attn_type} attention")
        if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)) \
                or any(getattr(impl, name, None) is not None
                       for name in ("alibi_slopes", "sinks")) \
                or getattr(impl, "logits_soft_cap", None):
            problems.add("sliding window, ALiBi, attention sinks or soft-capping")
        if impl.kv_cache_dtype != "auto":
            problems.add(f"kv_cache_dtype {impl.kv_cache_dtype!r}")
        if getattr(module, "kv_cache_update_bypass", False):  # vLLM 0.33: no K/V to write
            problems.add("attention without its own key/value (kv_cache_update_bypass)")
    return sorted(problems)


def attention_layers(runner: Any) -> list[Any]:
    """The target's attention layers (vLLM's ``Attention`` modules), as each registers
    itself under its prefix: not ``runner.model.modules()``, where vLLM 0.26's
    Transformers modeling backend (OLMo 2, StarCoder2) does not list them, so their
    forwards went unwrapped and the tree self-check failed. MTAD's auxiliary model's
    layers are not the target's."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from vllm_lookahead.worker.auxiliary_model import PREFIX

    return [layer for name, layer in
            get_layers_from_vllm_config(runner.vllm_config, Attention).items()
            if not name.startswith(PREFIX)]
