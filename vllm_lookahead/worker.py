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
| ``runner._prepare_inputs`` (instance attribute of the bound runner, drafters with ``draft_tree`` only) | wrapped | after vLLM has computed the step's KV slots from linear positions, gives each tree node the position of its depth (RoPE), plans the step's branches and their scratch blocks (tree_attention.py) | 0.32.0 (CPU) |
| ``builder.build`` of each ``runner.attn_groups[0][i].metadata_builders`` (instance attribute) | wrapped | in a step with trees, builds the backend's metadata from ``CommonAttentionMetadata`` split into branch sequences (``tree_attention.split_metadata``) | 0.32.0 (CPU_ATTN) |
| ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` | wrapped | before the kernel, fills the branches' scratch blocks (root block copy, path keys and values) and keeps the tree nodes' keys and values for the move after verification | 0.32.0 (CPU) |
| ``impl.do_kv_cache_update``, ``layer.attn_backend.get_kv_cache_shape`` | called | the backend's own KV writer fills scratch blocks and moves accepted nodes; the shape tells which cache dimension indexes blocks | 0.32.0 (CPU) |
| ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` | wrapped (every process; acts in the engine core) | with tree drafts on, takes the branches' scratch blocks (the pool's last ids) out of ``kv_cache_manager.block_pool`` with ``touch`` | 0.32.0 (CPU) |
| ``vllm.v1.sample.rejection_sampler.rejection_sample`` | wrapped | captures the target's argmax (and, if the drafter asks, its top-k with log-probabilities) at every draft position, also after the first rejection (the Jacobi iteration the proposer harvests); hands verification to the drafter's ``acceptance_rule`` if it has one (MTAD's joint rule), after vLLM has applied the request's temperature, top-k and top-p; verifies tree drafts (longest path the target's greedy choices or samples follow) and moves the accepted path's KV to the positions vLLM expects | 0.32.0 (CPU) |
| ``vllm.distributed.get_tp_group().broadcast_object`` | called | MTAD drafts on the first tensor-parallel rank only and broadcasts them | 0.32.0 (CPU, TP 2) |
| ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` | replaced, only on CPU without Triton | vLLM's C++ fallback writes float results into a discarded int64 copy, so temperature/top-p reach verification as garbage | 0.32.0 (CPU) |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from vllm_lookahead import _patching, tree_attention
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.tree import accepted_path, depths_of, is_chain

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

    def on_tree_planned(self, req_id: str, branches: int | None) -> None:
        """The tree became ``branches`` extra attention sequences, or (None) it is
        verified as a linear draft for want of scratch blocks."""


# One model runner per worker process, hence one observer, one acceptance rule and
# one step's trees at a time.
_observer: VerificationObserver | None = None
_acceptance_rule: AcceptanceRule | None = None
_tree_step: tree_attention.TreeStep | None = None


def install() -> None:
    """Called by ``plugin.register`` in every process; defers real work to workers."""
    from vllm.v1.worker import worker_base

    def make_wrapper(original):
        def __init__(self, *args, **kwargs):
            _install_worker_patches()
            original(self, *args, **kwargs)

        return __init__

    _patching.wrap(worker_base.WorkerBase, "__init__", make_wrapper)
    from vllm.v1.core.sched import scheduler

    _patching.wrap(scheduler.Scheduler, "__init__", _hold_back_scratch_blocks)


def _install_worker_patches() -> None:
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_model_runner

    _patching.wrap(gpu_model_runner.GPUModelRunner, "__init__", _binding_init)
    _patching.wrap(rejection_sampler, "rejection_sample", _hooked_rejection_sample)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        _patching.wrap(CPUAttentionBackendImpl, "forward", _tree_aware_forward)
    if cpu_expand_is_broken():
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
    draft were linear; tree nodes keep those slots but get their depth as position,
    and the step's branches get scratch blocks (tree_attention.py)."""
    original = runner._prepare_inputs
    builders_wrapped = False  # the builders exist once the KV cache is initialized

    def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        global _tree_step
        nonlocal builders_wrapped
        result = original(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        if not builders_wrapped:
            _wrap_metadata_builders(runner)
            builders_wrapped = True
        _tree_step = _trees_of_step(runner, source, scheduler_output)
        return result

    runner._prepare_inputs = _prepare_inputs


def _trees_of_step(runner: Any, source: TreeSource, scheduler_output: Any
                   ) -> tree_attention.TreeStep | None:
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    if not spec_tokens:
        return None
    batch = runner.input_batch
    query_starts = runner.query_start_loc.np
    slot_mapping = batch.block_table[0].slot_mapping.gpu
    block_size = _block_size(runner)
    block_tables = batch.block_table[0].block_table.np
    free_blocks = list(_scratch_blocks(runner))
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
    step = tree_attention.make_step(rows, branches, block_tables, prefixes, block_size)
    caches, dim = _layer_caches(runner)
    tree_attention.copy_root_blocks(caches, dim, step)
    return step


_stacked_caches: dict[int, tuple[list[torch.Tensor], int]] = {}


def _layer_caches(runner: Any) -> tuple[list[torch.Tensor], int]:
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


def _block_size(runner: Any) -> int:
    return runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size


def _scratch_blocks(runner: Any) -> list[int]:
    """The blocks ``_hold_back_scratch_blocks`` took out of the scheduler's pool."""
    config = runner.kv_cache_config
    count = tree_attention.scratch_block_count(
        config.num_blocks, _block_size(runner), runner.speculative_config.num_speculative_tokens)
    return tree_attention.scratch_block_ids(config.num_blocks, count)


def _wrap_metadata_builders(runner: Any) -> None:
    """Wrap each attention metadata builder's ``build`` (instance attribute): in a step
    with tree branches it builds from the branch-split common metadata."""
    if len(runner.attn_groups) != 1:
        raise ValueError("lookahead: tree_candidates and tree_window need a model with one "
                         f"KV cache group (this one has {len(runner.attn_groups)}); set both "
                         "to 0 (linear drafts) for this model")
    for group in runner.attn_groups[0]:
        if getattr(group, "kernel_block_size", None) not in (None, _block_size(runner)):
            raise ValueError("lookahead: tree_candidates and tree_window need the attention "
                             "kernel's block size to equal the KV cache's; set both to 0")
        for builder in group.metadata_builders:
            _patching.wrap(builder, "build", _branch_aware_build)


def _branch_aware_build(original):
    def build(common_prefix_len, common_attn_metadata, *args, **kwargs):
        step = _tree_step
        if step is not None and step.branches:
            common_attn_metadata = tree_attention.split_metadata(common_attn_metadata, step)
            common_prefix_len = 0  # no cascade attention over the split batch
            step.metadata_rewritten = True
        return original(common_prefix_len, common_attn_metadata, *args, **kwargs)

    return build


def _tree_aware_forward(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        step = _tree_step
        if step is not None and attn_metadata is not None and kv_cache.numel():
            tree_attention.prepare_layer(self, layer, key, value, kv_cache, step)
        return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                        *args, **kwargs)

    return forward


def _hold_back_scratch_blocks(original):
    """Wrap ``Scheduler.__init__``: with tree drafts on, take the branches' scratch
    blocks (the pool's last ids) out of the KV block pool for good."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        options = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {})
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


def _verify_trees(step: tree_attention.TreeStep, output: torch.Tensor,
                  draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                  target_logits: torch.Tensor, target_argmax: torch.Tensor,
                  bonus_token_ids: torch.Tensor, sampling_metadata: Any) -> None:
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
                moves_from.append(tree.first_token + node)
                moves_to.append(int(tree.slots[depth]))
    tree_attention.move_accepted_kv(step, moves_from, moves_to)


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


def cpu_expand_is_broken() -> bool:
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


#: Attention backends whose tree verification (tree_attention.py) has been tested.
#: The code is backend-neutral; FLASH_ATTN waits for a GPU run (and CUDA graphs that
#: replay attention without the Python wrapper must be ruled out for tree steps).
TREE_BACKENDS = ("CPUAttentionBackendImpl",)


def check_tree_attention(runner: Any) -> None:
    """Raise unless every attention layer of the target can take trees here: a tested
    backend, decoder self-attention without sliding window, ALiBi, soft-capping or
    sinks, an unquantized KV cache and plain (not multimodal) rotary positions."""
    from vllm.model_executor.layers.attention import Attention

    problems = set()
    if getattr(runner, "uses_mrope", False):
        problems.add("multimodal rotary positions (M-RoPE)")
    for module in runner.model.modules():
        if not isinstance(module, Attention):
            continue
        impl = module.impl
        if type(impl).__name__ not in TREE_BACKENDS:
            problems.add(f"attention backend {type(impl).__name__} (trees are verified "
                         "on CPU_ATTN only in this version)")
            continue
        if impl.attn_type != "decoder":
            problems.add(f"{impl.attn_type} attention")
        if impl.sliding_window != -1 or impl.alibi_slopes is not None or impl.sinks is not None \
                or impl.logits_soft_cap:
            problems.add("sliding window, ALiBi, attention sinks or soft-capping")
        if impl.kv_cache_dtype != "auto":
            problems.add(f"kv_cache_dtype {impl.kv_cache_dtype!r}")
        if getattr(module, "kv_cache_update_bypass", False):  # vLLM 0.33: no K/V to write
            problems.add("attention without its own key/value (kv_cache_update_bypass)")
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
