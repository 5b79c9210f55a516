"""Tree verification through the attention backend's own kernel, on any backend.

vLLM verifies a request's draft as one causal sequence. A tree draft is laid out as
vLLM scheduled it (node 0, the root, is the request's first scheduled token) and cut
into *runs*: maximal stretches of nodes each the child of the node before it. The
first run (root and first chain) stays the request's own sequence. Every other run
becomes a *branch*: an extra sequence in the step's attention metadata whose queries
are the run's nodes and whose context is the request's prefix, then the run's
ancestors, then the run, each at the position of its depth. A branch's block table is
the request's, except that the block holding the root and the blocks after it are
scratch blocks held back from vLLM's block pool: before each layer's attention, the
root block is copied into the branch's first scratch block and the keys and values of
the branch's path (root, ancestors, run) are written there through the backend's own
KV-cache writer. The kernel's causal mask over each sequence is then exactly the tree
mask, and each node is computed once by the model's linear layers.

After verification the accepted nodes' keys and values (kept per layer during the
forward) are written, again through the backend's writer, to the slots vLLM assigned
to the positions after the root, so the next step sees a linear history.

Nothing here reads a backend's KV layout: the only backend facts used are
``do_kv_cache_update`` and which dimension of the cache indexes blocks (from the
backend's ``get_kv_cache_shape``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_lookahead.tree import depths_of

#: Branches (tree runs off the first chain) whose scratch blocks a worker holds back,
#: for all requests of a step together; a tree that does not fit is verified as a
#: linear draft (lossless, fewer tokens accepted).
MAX_STEP_BRANCHES = 32


def blocks_per_branch(block_size: int, max_draft: int) -> int:
    """Blocks a branch (or an MTAD beam) can span: the root's block and at most
    ``ceil(K / block_size)`` more."""
    return 1 + math.ceil(max_draft / block_size)


def scratch_block_count(num_blocks: int, block_size: int, max_draft: int) -> int:
    """Blocks held back from vLLM's pool for branches, never more than an eighth of the
    pool (``scratch.py`` places them)."""
    return min(MAX_STEP_BRANCHES * blocks_per_branch(block_size, max_draft), num_blocks // 8)


@dataclass
class Branch:
    """One run off a tree's first chain, as its own attention sequence."""

    row: int  # the request's input-batch row
    first_token: int  # step token index of the run's first node
    num_tokens: int  # the run's nodes (the sequence's queries)
    seq_len: int  # prefix + root + depth of the run's last node
    path_tokens: np.ndarray  # step token indices of root, ancestors and run
    path_slots: np.ndarray  # their slots in the scratch blocks
    root_block: int  # block table index of the block holding the root
    scratch: list[int]  # scratch block ids replacing block table entries from root_block


@dataclass
class TreeRow:
    """One request's tree in this step."""

    parents: np.ndarray
    first_token: int  # step token index of the root
    slots: np.ndarray  # the KV slot vLLM assigned to each node (linear positions)


@dataclass
class TreeStep:
    rows: dict[int, TreeRow]  # input-batch row -> tree
    branches: list[Branch]
    copy_from: torch.Tensor  # root blocks to copy into ...
    copy_to: torch.Tensor  # ... each branch's first scratch block
    # on the model's device: every layer writes the same paths
    write_tokens: torch.Tensor  # step token indices written to scratch ...
    write_slots: torch.Tensor  # ... at these slots
    # step token index of each node off the first chains -> its index in write_tokens
    kept_index: dict[int, int]
    metadata_rewritten: bool = False
    # per layer: (impl, layer, kv cache, keys and values of write_tokens)
    kept_kv: list[tuple[Any, Any, torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=list)


def runs_of(parents: np.ndarray) -> list[tuple[int, int]]:
    """``[first, end)`` node ranges of the runs: each node's parent is the node before
    it, except for a run's first node. The first run starts at the root."""
    starts = [0, *(i for i in range(1, len(parents)) if parents[i] != i - 1)]
    return list(zip(starts, [*starts[1:], len(parents)]))


def ancestors_of(parents: np.ndarray, node: int) -> list[int]:
    """Root-first path to ``node``, ``node`` included."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def plan_branches(row: int, parents: np.ndarray, first_token: int, prefix: int,
                  block_size: int, free_blocks: list[int]) -> list[Branch] | None:
    """The branches of one request's tree, taking scratch blocks from ``free_blocks``
    (consumed); None, with ``free_blocks`` untouched, if they do not fit."""
    depths = depths_of(parents)
    root_block = prefix // block_size
    branches, taken = [], 0
    for first, end in runs_of(parents)[1:]:
        path = ancestors_of(parents, end - 1)
        positions = prefix + depths[path]
        count = int(positions[-1]) // block_size - root_block + 1
        if taken + count > len(free_blocks):
            return None
        scratch = free_blocks[taken : taken + count]
        taken += count
        blocks = np.asarray(scratch)[positions // block_size - root_block]
        branches.append(Branch(
            row=row, first_token=first_token + first, num_tokens=end - first,
            seq_len=int(positions[-1]) + 1,
            path_tokens=first_token + np.asarray(path, dtype=np.int64),
            path_slots=blocks * block_size + positions % block_size,
            root_block=root_block, scratch=scratch))
    del free_blocks[:taken]
    return branches


def make_step(rows: dict[int, TreeRow], branches: list[Branch], block_tables: np.ndarray,
              prefixes: dict[int, int], block_size: int, device: torch.device) -> TreeStep:
    """The per-step tensors. ``block_tables[row]``: the request's block ids;
    ``prefixes[row]``: its tokens before the root; ``device``: the model's, where the
    path writes go (copied once a step, not once a layer)."""
    copies = [(int(block_tables[b.row, b.root_block]), b.scratch[0]) for b in branches
              if prefixes[b.row] % block_size]  # a root opening its block: nothing before it
    copy_from, copy_to = (np.array(pair, dtype=np.int64) for pair in zip(*copies)) if copies \
        else (np.zeros(0, dtype=np.int64),) * 2
    kept_index, offset = {}, 0
    for b in branches:  # a branch's run is the end of its path
        run_start = offset + len(b.path_tokens) - b.num_tokens
        for i in range(b.num_tokens):
            kept_index[b.first_token + i] = run_start + i
        offset += len(b.path_tokens)
    empty = np.zeros(0, dtype=np.int64)
    return TreeStep(
        rows=rows, branches=branches,
        copy_from=torch.from_numpy(copy_from), copy_to=torch.from_numpy(copy_to),
        write_tokens=torch.from_numpy(
            np.concatenate([b.path_tokens for b in branches] or [empty])).to(device),
        write_slots=torch.from_numpy(
            np.concatenate([b.path_slots for b in branches] or [empty])).to(device),
        kept_index=kept_index,
    )


#: ``CommonAttentionMetadata`` fields indexed by token, not by request.
PER_TOKEN_FIELDS = ("slot_mapping", "positions", "logits_indices_padded")


def split_metadata(common: Any, step: TreeStep) -> Any:
    """``CommonAttentionMetadata`` with each branch as a sequence of its own, right
    after its request's (shortened) sequence. Per-request fields this module does not
    know are repeated from the branch's request; cached derived fields are dropped."""
    num_reqs = common.num_reqs
    query_starts = common.query_start_loc_cpu.numpy().astype(np.int64)
    seq_lens = common.seq_lens.cpu().numpy().astype(np.int64)
    by_row: dict[int, list[Branch]] = {}
    for branch in step.branches:
        by_row.setdefault(branch.row, []).append(branch)
    sources, starts, lengths, tables = [], [], [], []
    block_table = common.block_table_tensor
    for row in range(num_reqs):
        branches = by_row.get(row, [])
        end = branches[0].first_token if branches else query_starts[row + 1]
        sources.append(row)
        starts.append(query_starts[row])
        lengths.append(seq_lens[row] - (query_starts[row + 1] - end))
        for branch in branches:
            sources.append(row)
            starts.append(branch.first_token)
            lengths.append(branch.seq_len)
            tables.append((len(sources) - 1, branch))
    starts.append(query_starts[num_reqs])
    source_rows = torch.tensor(sources, dtype=torch.long)
    new_starts = torch.tensor(starts, dtype=common.query_start_loc_cpu.dtype)
    new_lens = torch.tensor(lengths, dtype=common.seq_lens.dtype)
    new_table = block_table[source_rows.to(block_table.device)].clone()
    for index, branch in tables:
        new_table[index, branch.root_block : branch.root_block + len(branch.scratch)] = \
            torch.tensor(branch.scratch, dtype=new_table.dtype)
    query_lens = new_starts[1:] - new_starts[:-1]
    known = {
        "query_start_loc": new_starts.to(common.query_start_loc.device),
        "query_start_loc_cpu": new_starts,
        "seq_lens": new_lens.to(common.seq_lens.device),
        "seq_lens_cpu": new_lens,
        "seq_lens_cpu_upper_bound": new_lens,
        "num_computed_tokens_cpu": new_lens - query_lens,
        "block_table_tensor": new_table,
        "num_reqs": len(sources),
        "max_query_len": int(query_lens.max()),
        "max_seq_len": max(int(new_lens.max()), common.max_seq_len),
    }
    changes = {}
    for f in dataclasses.fields(common):
        value = getattr(common, f.name)
        if f.name in known:
            if value is not None or f.name not in ("seq_lens_cpu", "seq_lens_cpu_upper_bound",
                                                   "num_computed_tokens_cpu"):
                changes[f.name] = known[f.name]
        elif f.name.startswith("_"):
            changes[f.name] = None
        elif f.name in PER_TOKEN_FIELDS:
            continue
        elif isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == num_reqs:
            changes[f.name] = value[source_rows.to(value.device)]
        elif isinstance(value, np.ndarray) and value.ndim and value.shape[0] == num_reqs:
            changes[f.name] = value[np.asarray(sources)]
    return dataclasses.replace(common, **changes)


def block_dim(backend: type, kv_cache: torch.Tensor) -> int:
    """The dimension of ``kv_cache`` that indexes blocks. Backends that declare
    ``get_kv_cache_shape`` (vLLM 0.26) say it when asked for a block count no other
    dimension has; without it the per-layer view is ``[blocks, heads, tokens, content]``
    (vLLM's logical KV layout, RFC 42082)."""
    if not hasattr(backend, "get_kv_cache_shape"):
        return 0
    marker = 7919  # prime: no head count, block size or head size equals it
    shape = backend.get_kv_cache_shape(marker, 16, 1, kv_cache.shape[-1])
    dims = [i for i, size in enumerate(shape) if size == marker]
    if len(dims) != 1 or len(shape) != kv_cache.dim():
        raise RuntimeError(
            f"vllm-lookahead: cannot tell the block dimension of {backend.get_name()}'s "
            f"KV cache (shape {tuple(shape)}); set tree_candidates=0 and tree_window=0")
    return dims[0]


def stacked(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The layers' caches as few tensors as possible: one ``[layers, ...]`` view when
    they are equally spaced views of one buffer (vLLM 0.32 allocates them so), so a
    block copy is one operation for all layers; else the caches themselves."""
    first = caches[0]
    if len(caches) > 1:
        spacing = caches[1].storage_offset() - first.storage_offset()
        uniform = spacing > 0 and all(
            cache.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and cache.shape == first.shape and cache.stride() == first.stride()
            and cache.dtype == first.dtype
            and cache.storage_offset() == first.storage_offset() + layer * spacing
            for layer, cache in enumerate(caches))
        if uniform:
            return [first.as_strided((len(caches), *first.shape),
                                     (spacing, *first.stride()), first.storage_offset())]
    return [cache[None] for cache in caches]


def copy_root_blocks(layer_caches: list[torch.Tensor], dim: int, step: TreeStep) -> None:
    """Once per step, before the forward: each branch's first scratch block becomes a
    copy of its root's block, in every layer (``layer_caches`` from ``stacked``; ``dim``
    is a layer cache's block dimension). Positions before the root are final; those
    from the root on are overwritten by each layer's path writes."""
    for source, target in zip(step.copy_from.tolist(), step.copy_to.tolist()):
        for caches in layer_caches:  # no temporary: one strided copy per block
            caches.select(dim + 1, target).copy_(caches.select(dim + 1, source))


def prepare_layer(impl: Any, layer: Any, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, step: TreeStep) -> None:
    """Before one layer's attention: write the branches' paths (root, ancestors, run)
    into their scratch blocks, and keep those keys and values for the move after
    verification (every node off a first chain is in its branch's path)."""
    if not step.metadata_rewritten:
        raise RuntimeError("vllm-lookahead: a tree step reached attention without its "
                           "branch metadata (the metadata builder was not wrapped)")
    # index_select, not ``key[index]``: half the time for a few rows (12 against 23 us
    # the pair on a 2-core AMD EPYC), in each layer of every tree step
    keys, values = key.index_select(0, step.write_tokens), value.index_select(0, step.write_tokens)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, step.write_slots)
    step.kept_kv.append((impl, layer, kv_cache, keys, values))


def move_accepted_kv(step: TreeStep, tokens: list[int], slots: list[int]) -> None:
    """Write the kept keys and values of the nodes at step token indices ``tokens``
    (off the first chain) to ``slots`` in every layer's cache."""
    if not tokens:
        return
    device = step.write_tokens.device  # copied there once, not three times a layer
    index = torch.tensor([step.kept_index[token] for token in tokens]).to(device)
    targets = torch.tensor(slots, dtype=torch.int64).to(device)
    for impl, layer, kv_cache, keys, values in step.kept_kv:
        impl.do_kv_cache_update(layer, keys.index_select(0, index),
                                values.index_select(0, index), kv_cache, targets)
