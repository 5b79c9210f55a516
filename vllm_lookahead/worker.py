"""Every place where the plugin touches vLLM's model runner and sampler.

The ``custom_class`` proposer interface passes neither request ids nor the target's
predictions, and vLLM's CPU fallback corrupts sampling verification. Each patch
below wraps the original (no vLLM method body is copied) and is installed at most
once per process; the runner and sampler patches only in worker processes.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.worker_base.WorkerBase.__init__`` | wrapped | installs the patches below in worker processes only, before the runner exists | 0.32.0 (CPU, mp executor, TP 1 and 2) |
| ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (``CPUModelRunner`` inherits it) | wrapped | hands the runner to a drafter with ``bind_model_runner`` (request ids per batch row) and registers it as verification observer | 0.32.0 (CPU) |
| ``runner._update_states`` (instance attribute of the bound runner) | wrapped | tells the drafter which requests finished, were aborted or preempted, so their state is freed at once; and when a step starts, with its scheduled token count and whether it holds prompt tokens (the drafter times decode passes until ``propose``) | 0.32.0 (CPU) |
| ``runner._prepare_inputs`` (instance attribute of the bound runner, drafters with ``draft_tree`` only) | wrapped | after vLLM has computed the step's KV slots from linear positions, gives each tree node the position of its depth (RoPE) and records the trees of the step | 0.32.0 (CPU) |
| ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` | wrapped | recomputes, for tree nodes off the first chain, attention over the prefix and their ancestors only (the kernel is causal over the flat draft) | 0.32.0 (CPU) |
| ``impl.do_kv_cache_update`` | called on a scratch cache | learns where the backend stores each token's key and value in a block (the CPU layout depends on the ISA), to read the prefix and to move the accepted path's KV | 0.32.0 (CPU, vec and AMX) |
| ``vllm.v1.sample.rejection_sampler.rejection_sample`` | wrapped | captures the target's argmax (and, if the drafter asks, its top-k with log-probabilities) at every draft position, also after the first rejection (the Jacobi iteration the proposer harvests); hands verification to the drafter's ``acceptance_rule`` if it has one (MTAD's joint rule), after vLLM has applied the request's temperature, top-k and top-p; verifies tree drafts (longest path the target's greedy choices or samples follow) and moves the accepted path's KV to the positions vLLM expects | 0.32.0 (CPU) |
| ``vllm.distributed.get_tp_group().broadcast_object`` | called | MTAD drafts on the first tensor-parallel rank only and broadcasts them | 0.32.0 (CPU, TP 2) |
| ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` | replaced, only on CPU without Triton | vLLM's C++ fallback writes float results into a discarded int64 copy, so temperature/top-p reach verification as garbage | 0.32.0 (CPU) |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from vllm_lookahead import _patching
from vllm_lookahead.tree import accepted_path, ancestor_mask, depths_of, is_chain

logger = logging.getLogger(__name__)


@dataclass
class VerificationCapture:
    """The target's view of one verification pass, rows in input-batch order.

    Tensors stay on the device until the proposer reads them, after vLLM's own sync.
    """

    num_draft_tokens: list[int]
    draft_token_ids: torch.Tensor  # [sum(num_draft_tokens)]
    target_argmax: torch.Tensor  # [sum(num_draft_tokens)]
    bonus_token_ids: torch.Tensor  # [rows]
    # the observer's ``capture_top_k`` most likely tokens at each position, if it asks
    target_top_ids: torch.Tensor | None = None  # [sum(num_draft_tokens), k]
    target_top_logprobs: torch.Tensor | None = None  # [sum(num_draft_tokens), k]


class VerificationObserver(Protocol):
    capture_top_k: int  # 0: argmax only

    def on_verification(self, capture: VerificationCapture) -> None: ...


class AcceptanceRule(Protocol):
    """Replaces vLLM's decisions: output tokens ``[rows, max_spec_len + 1]``, or None
    to leave this pass to vLLM (e.g. its warm-up runs)."""

    def __call__(self, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                 max_spec_len: int, target_logits: torch.Tensor,
                 bonus_token_ids: torch.Tensor, sampling_metadata: Any
                 ) -> torch.Tensor | None: ...


class TreeSource(Protocol):
    def draft_tree(self, req_id: str, scheduled: list[int]) -> np.ndarray | None:
        """Parents of ``[root] + scheduled`` (the request's draft as vLLM scheduled
        it), or None to verify it as a linear draft."""


@dataclass
class _TreeRow:
    """One request's tree in this step; node 0 is the root (first scheduled token)."""

    parents: np.ndarray
    slots: np.ndarray  # KV slot of each node, as vLLM assigned them (linear)
    off_chain: torch.Tensor  # nodes not on the first chain (causal kernel is wrong there)
    attention_bias: torch.Tensor  # [len(off_chain), nodes]: 0 (ancestor) or -inf
    req_id: str


@dataclass
class _TreeStep:
    rows: dict[int, _TreeRow]  # input-batch row -> tree
    # the KV caches the step's attention used, with their layouts, by data_ptr
    caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _PrefixCopy:
    """A tree request's prefix KV for one cache, unpacked (``[2, kv heads, capacity,
    head_size]``, float32) and extended each step by the positions added since."""

    kv: torch.Tensor
    length: int = 0


#: Bound on the unpacked prefix copies a worker keeps (beyond it, prefixes are read
#: from the paged cache at every step, which costs a gather per layer).
PREFIX_COPY_BYTES = 1 << 30

# One model runner per worker process, hence one observer, one acceptance rule and
# one step's trees at a time; prefix copies of the requests with trees in it.
_observer: VerificationObserver | None = None
_acceptance_rule: AcceptanceRule | None = None
_tree_step: _TreeStep | None = None
_prefix_copies: dict[tuple[str, int], _PrefixCopy] = {}


def install() -> None:
    """Called by ``plugin.register`` in every process; defers real work to workers."""
    from vllm.v1.worker import worker_base

    def make_wrapper(original):
        def __init__(self, *args, **kwargs):
            _install_worker_patches()
            original(self, *args, **kwargs)

        return __init__

    _patching.wrap(worker_base.WorkerBase, "__init__", make_wrapper)


def _install_worker_patches() -> None:
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_model_runner

    _patching.wrap(gpu_model_runner.GPUModelRunner, "__init__", _binding_init)
    _patching.wrap(rejection_sampler, "rejection_sample", _hooked_rejection_sample)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        _patching.wrap(CPUAttentionBackendImpl, "forward", _tree_aware_forward)
    if _cpu_expand_is_broken():
        _patching.replace(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
        logger.info("vllm-lookahead: replaced CPU expand_batch_to_tokens (sampling fix)")


def _binding_init(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "bind_model_runner"):
            drafter.bind_model_runner(self)
        if hasattr(drafter, "on_requests_removed") and hasattr(self, "_update_states"):
            _observe_scheduler_output(self, drafter)
        if hasattr(drafter, "draft_tree"):
            _place_tree_nodes(self, drafter)
        global _observer, _acceptance_rule
        if hasattr(drafter, "on_verification"):
            _observer = drafter
        if getattr(drafter, "acceptance_rule", None) is not None:
            _acceptance_rule = drafter.acceptance_rule

    return __init__


def _observe_scheduler_output(runner: Any, drafter: Any) -> None:
    original = runner._update_states
    step_started = getattr(drafter, "on_step_start", None)

    def _update_states(scheduler_output, *args, **kwargs):
        if step_started is not None:
            step_started(scheduler_output.total_num_scheduled_tokens,
                         _is_decode_only(scheduler_output))
        result = original(scheduler_output, *args, **kwargs)
        finished = scheduler_output.finished_req_ids  # aborted ones included
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        if finished or preempted:
            drafter.on_requests_removed(set(finished), set(preempted))
        return result

    runner._update_states = _update_states


def _is_decode_only(scheduler_output: Any) -> bool:
    """No prompt token in the step: each request computes one token plus its draft."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return all(count == 1 + len(drafts.get(req_id, ()))
               for req_id, count in scheduler_output.num_scheduled_tokens.items())


def _hooked_rejection_sample(original):
    def rejection_sample(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
        draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
    ):
        global _tree_step
        capture = None
        if _observer is not None:
            capture = _capture(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids)
            _observer.on_verification(capture)
        sampling_metadata = args[0] if args else kwargs["sampling_metadata"]
        if _acceptance_rule is not None:
            output = _acceptance_rule(draft_token_ids, list(num_draft_tokens), max_spec_len,
                                      target_logits, bonus_token_ids, sampling_metadata)
            if output is not None:
                return output
        output = original(
            draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
            draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
        )
        if _tree_step is not None:
            target_argmax = capture.target_argmax if capture else target_logits.argmax(-1)
            _verify_trees(_tree_step, output, draft_token_ids, list(num_draft_tokens),
                          target_logits, target_argmax, bonus_token_ids, sampling_metadata)
            _tree_step = None  # the step is done; dummy runs must not see its trees
        return output

    return rejection_sample


# -- tree drafts -------------------------------------------------------------------------


def _place_tree_nodes(runner: Any, source: TreeSource) -> None:
    """Wrap ``runner._prepare_inputs``: vLLM computes positions and KV slots as if the
    draft were linear; tree nodes keep those slots but get their depth as position."""
    original = runner._prepare_inputs

    def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        global _tree_step
        result = original(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        _tree_step = _trees_of_step(runner, source, scheduler_output)
        return result

    runner._prepare_inputs = _prepare_inputs


def _trees_of_step(runner: Any, source: TreeSource, scheduler_output: Any) -> _TreeStep | None:
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    batch = runner.input_batch
    query_starts = runner.query_start_loc.np
    slot_mapping = batch.block_table[0].slot_mapping.gpu
    rows = {}
    for row, req_id in enumerate(batch.req_ids):
        scheduled = spec_tokens.get(req_id) if spec_tokens else None
        if not scheduled:
            continue
        parents = source.draft_tree(req_id, list(scheduled))
        if parents is None or is_chain(parents):
            continue
        start, size = int(query_starts[row]), len(parents)
        base = int(batch.num_computed_tokens_cpu[row])
        depths = depths_of(parents)
        runner.positions[start : start + size] = torch.from_numpy(base + depths).to(
            runner.positions.device)
        mask = ancestor_mask(parents)
        # a node whose earlier nodes are all its ancestors: the causal kernel is right
        on_chain = (mask | ~np.tri(size, dtype=bool)).all(axis=1)
        off_chain = np.flatnonzero(~on_chain)
        bias = np.zeros((len(off_chain), size), dtype=np.float32)
        bias[~mask[off_chain]] = -np.inf
        rows[row] = _TreeRow(
            parents=parents,
            slots=slot_mapping[start : start + size].cpu().numpy().astype(np.int64),
            off_chain=torch.from_numpy(off_chain),
            attention_bias=torch.from_numpy(bias),
            req_id=req_id,
        )
    # a request without a tree in this step (finished, preempted, prefilling or linear)
    # loses its prefix copy: a recomputed prefix must be read afresh
    tree_requests = {tree.req_id for tree in rows.values()}
    for key in [key for key in _prefix_copies if key[0] not in tree_requests]:
        del _prefix_copies[key]
    return _TreeStep(rows) if rows else None


def _tree_aware_forward(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        result = original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                          *args, **kwargs)
        step = _tree_step
        if step is not None and attn_metadata is not None and kv_cache.numel():
            _attend_over_ancestors(self, layer, query, key, value, kv_cache, attn_metadata,
                                   output, step)
        return result

    return forward


def _attend_over_ancestors(impl, layer, query, key, value, kv_cache, meta, output,
                           step: _TreeStep) -> None:
    """Attention of off-chain tree nodes over the prefix (the request's unpacked copy)
    and their ancestors (this step's keys and values), in float32."""
    layout = _kv_layout(impl, layer, kv_cache)
    step.caches.setdefault(kv_cache.data_ptr(), (kv_cache, layout))
    num_kv_heads = kv_cache.shape[1]
    heads, head_size = impl.num_heads, impl.head_size
    group = heads // num_kv_heads
    queries = query.view(-1, heads, head_size)
    keys = key.view(-1, num_kv_heads, head_size)
    values = value.view(-1, num_kv_heads, head_size)
    out = output.view(-1, heads, head_size)
    for row, tree in step.rows.items():
        start, size = int(meta.query_start_loc[row]), len(tree.parents)
        cached = _prefix_kv(tree.req_id, kv_cache, layout, meta.block_table[row],
                            int(meta.seq_lens[row]) - size)  # [2, kv heads, prefix, d]
        rows = start + tree.off_chain
        q = queries[rows].view(len(rows), num_kv_heads, group, head_size)
        q = q.permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_size).float() * impl.scale
        new_keys = keys[start : start + size].transpose(0, 1).float()
        new_values = values[start : start + size].transpose(0, 1).float()
        scores = torch.cat([torch.bmm(q, cached[0].transpose(1, 2)),
                            torch.bmm(q, new_keys.transpose(1, 2))], dim=2)
        prefix = cached.shape[2]
        scores = scores.view(num_kv_heads, len(rows), group, -1)
        scores[..., prefix:] += tree.attention_bias[None, :, None, :]
        weights = scores.softmax(-1).view(num_kv_heads, len(rows) * group, -1)
        attended = (torch.bmm(weights[:, :, :prefix], cached[1])
                    + torch.bmm(weights[:, :, prefix:], new_values))
        attended = attended.view(num_kv_heads, len(rows), group, head_size)
        out[rows] = attended.permute(1, 0, 2, 3).reshape(len(rows), heads, head_size).to(
            out.dtype)


def _prefix_kv(req_id: str, kv_cache: torch.Tensor, layout: torch.Tensor,
               block_table: torch.Tensor, prefix: int) -> torch.Tensor:
    """Keys and values of positions ``0..prefix-1``, ``[2, kv heads, prefix, d]``: from
    the request's prefix copy, extended by the positions added since the last step."""
    key = (req_id, kv_cache.data_ptr())
    copy = _prefix_copies.get(key)
    if copy is None or copy.length > prefix:
        copy = _PrefixCopy(torch.empty((2, kv_cache.shape[1], 0, kv_cache.shape[3] // 2),
                                       device=kv_cache.device))
    if prefix > copy.kv.shape[2]:
        grown = copy.kv.new_empty((*copy.kv.shape[:2], 2 * prefix, copy.kv.shape[3]))
        grown[:, :, : copy.length] = copy.kv[:, :, : copy.length]
        copy.kv = grown
    if prefix > copy.length:
        elements = _kv_elements(block_table, torch.arange(copy.length, prefix), kv_cache.shape,
                                layout)
        copy.kv[:, :, copy.length : prefix] = kv_cache.view(-1)[elements]
        copy.length = prefix
    if key in _prefix_copies or _bytes_of(_prefix_copies.values()) + \
            _bytes_of([copy]) <= PREFIX_COPY_BYTES:  # the sum only for a new request
        _prefix_copies[key] = copy
    return copy.kv[:, :, :prefix]


def _bytes_of(copies) -> int:
    return sum(copy.kv.numel() * copy.kv.element_size() for copy in copies)


def _kv_elements(block_table: torch.Tensor, positions: torch.Tensor, shape: torch.Size,
                 layout: torch.Tensor) -> torch.Tensor:
    """Element offsets, in a KV cache of ``shape``, of the keys and values at
    ``positions`` of the request with ``block_table``: ``[2, kv heads, positions, d]``."""
    _, num_kv_heads, block_size, width = shape
    region = block_size * width
    blocks = block_table[positions // block_size].long()
    within = layout[:, positions % block_size, :]  # [2, prefix, d]
    heads = torch.arange(num_kv_heads) * region
    return (blocks[None, None, :, None] * (num_kv_heads * region)
            + heads[None, :, None, None] + within[:, None, :, :])


_kv_layouts: dict[tuple, torch.Tensor] = {}


def _kv_layout(impl, layer, kv_cache: torch.Tensor) -> torch.Tensor:
    """Where a block stores each token's key and value: ``[2, block_size, head_size]``
    element indices into one (block, kv head) region of the cache.

    The CPU backend packs keys by ISA (AMX tiles, vector lanes), so the layout is
    learned by writing bit patterns through the backend's own ``do_kv_cache_update``
    into a scratch cache, then checked on random data.
    """
    _, num_kv_heads, block_size, width = kv_cache.shape
    signature = (kv_cache.dtype, num_kv_heads, block_size, width, getattr(layer, "isa", None))
    layout = _kv_layouts.get(signature)
    if layout is not None:
        return layout
    head_size = width // 2
    region = block_size * width
    codes = torch.arange(1, 2 * block_size * head_size + 1).view(2, block_size, 1, head_size)
    codes = codes.expand(2, block_size, num_kv_heads, head_size)
    slots = torch.arange(block_size)
    found = torch.zeros(num_kv_heads, region, dtype=torch.long)
    scratch = kv_cache.new_zeros((1, num_kv_heads, block_size, width))
    for bit in range(int(codes.max()).bit_length()):
        bits = ((codes >> bit) & 1).to(kv_cache.dtype)
        scratch.zero_()
        impl.do_kv_cache_update(layer, bits[0].contiguous(), bits[1].contiguous(), scratch,
                                slots)
        found |= (scratch.view(num_kv_heads, region) != 0).long() << bit
    layout = torch.full((2 * block_size * head_size,), -1, dtype=torch.long)
    written = found[0] > 0
    layout[found[0][written] - 1] = torch.nonzero(written).view(-1)
    layout = layout.view(2, block_size, head_size)
    sample = torch.randn(2, block_size, num_kv_heads, head_size).to(kv_cache.dtype)
    order = torch.randperm(block_size)
    scratch.zero_()
    impl.do_kv_cache_update(layer, sample[0][order].contiguous(),
                            sample[1][order].contiguous(), scratch, slots)
    read = scratch.view(num_kv_heads, region)[:, layout.clamp(min=0)]  # [heads, 2, blk, d]
    if (layout < 0).any() or not torch.equal(read.permute(1, 2, 0, 3), sample[:, order]):
        raise RuntimeError(
            "vllm-lookahead: tree drafts cannot read this attention backend's KV cache "
            f"layout ({type(impl).__name__}, {kv_cache.dtype}); set tree_candidates=0 and "
            "tree_window=0 to verify linear drafts")
    _kv_layouts[signature] = layout
    return layout


def _verify_trees(step: _TreeStep, output: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: list[int], target_logits: torch.Tensor,
                  target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                  sampling_metadata: Any) -> None:
    """Replace vLLM's linear verdict for tree rows (in place): follow, from the root,
    the child whose token the target chose at each node (greedy: its argmax; random:
    a sample of the processed distribution, which is lossless for point-mass drafts
    with distinct sibling tokens), emit those tokens and the target's token at the
    last node; then move the accepted nodes' KV to the positions after the root."""
    offsets = np.cumsum([0, *num_draft_tokens])
    temperature = None if sampling_metadata.all_greedy else sampling_metadata.temperature
    generators = sampling_metadata.generators
    moves_from, moves_to = [], []
    for row, tree in step.rows.items():
        begin, end = int(offsets[row]), int(offsets[row + 1])
        if end - begin != len(tree.parents) - 1:
            raise RuntimeError(f"vllm-lookahead: row {row} verified {end - begin} draft "
                               f"tokens, its tree has {len(tree.parents) - 1}")
        if temperature is None or float(temperature[row]) <= 0:
            predictions = target_argmax[begin:end]
        else:
            predictions = target_logits[begin:end].softmax(-1, dtype=torch.float32).multinomial(
                1, generator=generators.get(row)).view(-1)
        predictions = predictions.tolist() + [int(bonus_token_ids.view(-1)[row])]
        tokens = [-1, *draft_token_ids[begin:end].tolist()]
        path = accepted_path(tree.parents, tokens, predictions)
        emitted = [tokens[node] for node in path] + [predictions[path[-1] if path else 0]]
        output[row].fill_(-1)
        output[row, : len(emitted)] = torch.tensor(emitted, dtype=output.dtype)
        for depth, node in enumerate(path, start=1):
            if node != depth:
                moves_from.append(tree.slots[node])
                moves_to.append(tree.slots[depth])
    if moves_from:
        _move_kv(step, np.array(moves_from), np.array(moves_to))


def _move_kv(step: _TreeStep, sources: np.ndarray, targets: np.ndarray) -> None:
    """Copy each source slot's key and value to its target slot, in every KV cache the
    step's attention read (all sources are read before any target is written)."""
    for cache, layout in step.caches.values():
        num_blocks, num_kv_heads, block_size, _ = cache.shape
        elements = layout.permute(1, 0, 2).reshape(block_size, -1)  # [offset, 2 * head]
        regions = cache.view(num_blocks, num_kv_heads, -1)
        source_blocks = torch.from_numpy(sources // block_size)[:, None]
        target_blocks = torch.from_numpy(targets // block_size)[:, None]
        moved = regions[source_blocks, :, elements[torch.from_numpy(sources % block_size)]]
        regions[target_blocks, :, elements[torch.from_numpy(targets % block_size)]] = moved


def _capture(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids
             ) -> VerificationCapture:
    capture = VerificationCapture(
        num_draft_tokens=list(num_draft_tokens),
        draft_token_ids=draft_token_ids,
        target_argmax=target_logits.argmax(dim=-1),
        bonus_token_ids=bonus_token_ids.view(-1),
    )
    top_k = min(getattr(_observer, "capture_top_k", 0), target_logits.shape[-1])
    if top_k and target_logits.shape[0]:
        values, capture.target_top_ids = target_logits.topk(top_k, dim=-1)
        capture.target_top_logprobs = values - target_logits.logsumexp(-1, keepdim=True)
    return capture


def _cpu_expand_is_broken() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: Any = 0,
    replace_to: Any = 0,
) -> torch.Tensor:
    """Pure-torch ``expand_batch_to_tokens``: row value i repeated count_i times."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def check_bound(runner: Any) -> None:
    """Raise unless ``_binding_init`` handed the runner over (vLLM calls the drafter's
    ``load_model`` after building the runner, so this is the place to check)."""
    if runner is None:
        raise RuntimeError(
            "vllm-lookahead: the model runner was not bound to the proposer; "
            "is the vllm_lookahead plugin installed in this Python environment?"
        )


def check_tree_attention(runner: Any) -> None:
    """Raise unless every attention layer of the target can take tree masks here: the
    CPU backend, decoder self-attention without sliding window, ALiBi, soft-capping or
    sinks, an unquantized KV cache and plain (not multimodal) rotary positions."""
    from vllm.model_executor.layers.attention import Attention

    problems = set()
    if getattr(runner, "uses_mrope", False):
        problems.add("multimodal rotary positions (M-RoPE)")
    for module in runner.model.modules():
        if not isinstance(module, Attention):
            continue
        impl = module.impl
        if type(impl).__name__ != "CPUAttentionBackendImpl":
            problems.add(f"attention backend {type(impl).__name__} (only CPU_ATTN masks "
                         "trees in this version)")
            continue
        if impl.attn_type != "decoder":
            problems.add(f"{impl.attn_type} attention")
        if impl.sliding_window != -1 or impl.alibi_slopes is not None or impl.sinks is not None \
                or impl.logits_soft_cap:
            problems.add("sliding window, ALiBi, attention sinks or soft-capping")
        if impl.kv_cache_dtype != "auto":
            problems.add(f"kv_cache_dtype {impl.kv_cache_dtype!r}")
    if problems:
        raise ValueError(
            "lookahead: tree_candidates and tree_window need tree attention, which this "
            f"model cannot take here: {'; '.join(sorted(problems))}. Set both to 0 (linear "
            "drafts) for this model.")


def request_ids(runner: Any) -> list[str | None]:
    """Request id of each input-batch row (the rows ``propose`` receives)."""
    return runner.input_batch.req_ids


def live_request_ids(runner: Any) -> Any:
    """Requests the runner still holds state for (running, paused or preempted)."""
    return runner.requests.keys()


def worker_rank() -> int:
    """This worker's rank in the engine's process group (0 without one)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def num_prompt_tokens(runner: Any, row: int) -> int:
    return int(runner.input_batch.num_prompt_tokens[row])


def sampling_params(runner: Any, req_id: str) -> Any:
    """The request's ``SamplingParams`` (None for pooling requests)."""
    return getattr(runner.requests.get(req_id), "sampling_params", None)


def extra_args(runner: Any, req_id: str) -> dict[str, Any] | None:
    """The request's ``SamplingParams.extra_args`` (None for pooling requests)."""
    return getattr(sampling_params(runner, req_id), "extra_args", None)


def _tp_group() -> Any:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tp_group()


def is_first_tp_rank() -> bool:
    group = _tp_group()
    return group is None or group.rank_in_group == 0


def broadcast_from_first_tp_rank(obj: Any) -> Any:
    """``obj`` as the first tensor-parallel rank has it (no-op without TP)."""
    group = _tp_group()
    if group is None or group.world_size == 1:
        return obj
    return group.broadcast_object(obj, src=0)
