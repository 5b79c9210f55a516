"""Every place where the plugin touches vLLM's model runner, sampler, attention and
scheduler, split by concern (the configuration layer's are in ``engine_config.py``).

The ``custom_class`` proposer interface passes neither request ids nor the target's
predictions, and vLLM's CPU fallback corrupts sampling verification. Each patch
below wraps the original (no vLLM method body is copied) and is installed at most
once per process; the runner, sampler and attention patches only in worker processes.

The modules import only downwards, bottom floor first:

1. ``runner_state``, ``hooks``, ``tree_attention``, ``cpu_top_p``, ``cpu_recovered_tokens``,
   ``kernel_overrides``, ``request_support``: leaves (the runner's state as drafters
   read it, the drafter protocol, the backend-neutral tree data and KV operations, top-p
   and recovered tokens on CPU, vLLM's CPU kernel overrides beside numba, which requests
   vLLM verifies exactly with drafts);
2. ``scratch``, ``auxiliary_model``: the scratch blocks; a second model on the paged
   KV cache;
3. ``tree_step``, then ``attention_backends`` on it: the tree step in the runner and
   each backend's part of it;
4. ``tree_check``, ``start_cost``, then ``start_up`` running both once the KV cache
   exists: the start-up procedures that use the tree step;
5. ``sampler``, ``scheduler``, then ``runner``: the sampler's hooks, the engine core's
   side, the runner binding; this package's ``install`` on top.

| vLLM attribute | module | patch | why | verified on |
|---|---|---|---|---|
| ``vllm.v1.worker.worker_base.WorkerBase.__init__`` | ``plugin`` | wrapped | calls ``install_worker_patches`` in worker processes only, before the runner exists: on a vLLM with Model Runner V1, the CPU sampling fixes in every engine and the rest in engines running our methods; on a vLLM without V1, none | 0.32.0, 0.26.0 (CPU, mp executor, TP 1 and 2); 0.33.0 read; 0.34.0 imported (no V1: nothing installed) |
| ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__`` (``CPUModelRunner`` inherits it) | ``runner`` | wrapped | hands the runner to its drafter (``hooks.DrafterHooks``: request ids per batch row) and connects the drafter's hooks | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner._update_states`` (instance attribute of the bound runner) | ``runner`` | wrapped | tells the drafter which requests finished, were aborted or preempted, so their state is freed at once; and when a step starts, with its scheduled token count, its request count and whether it holds prompt tokens (the drafter times decode steps from start to start) | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner._prepare_inputs`` (instance attribute of the bound runner, drafters with ``draft_tree`` only) | ``tree_step`` | wrapped | after vLLM has computed the step's KV slots from linear positions, gives each tree node the position of its depth (RoPE), plans the step's branches and their scratch blocks (``tree_attention``) | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``builder.build`` of each ``runner.attn_groups[0][i].metadata_builders`` (instance attribute) | ``tree_step`` | wrapped | in a step with trees, builds the backend's metadata (and whatever it derives from ``seq_lens``: FA3's scheduler metadata, FlashInfer's plan) from ``CommonAttentionMetadata`` split into branch sequences (``tree_attention.split_metadata``), without cascade attention | 0.32.0, 0.26.0 (CPU_ATTN); 0.33.0 read |
| ``runner._determine_batch_execution_and_padding`` (instance attribute, once the tree self-check has passed) | ``tree_step`` | wrapped | a step with trees runs without CUDA graphs (``force_eager``): a graph captured for a uniform linear draft would replay it without its tree metadata and scratch writes | 0.32.0, 0.26.0 read (called after ``_prepare_inputs``, has ``force_eager``); never run on CUDA |
| ``runner.initialize_kv_cache`` (instance attribute, drafters with ``draft_tree`` only) | ``start_up`` | wrapped | once the KV cache exists (not vLLM's minimal profiling cache, ``is_profiling``): for trees ``auto``, times the target's passes of 1 to 33 query tokens (``start_cost``, its own table); then, if trees are still on, wraps the metadata builders and the attention implementations in use and runs the tree step's self-check (``tree_check``, its own table); the drafter gets both before the first request | 0.32.0, 0.26.0 (CPU) |
| ``forward`` of the attention implementations (``CPUAttentionBackendImpl``, ``FlashAttentionImpl``, ``TritonAttentionImpl``, ``FlashInferImpl``, ``FlexAttentionImpl``) the target uses | ``attention_backends`` | wrapped | before the kernel, fills the branches' scratch blocks (root block copy, path keys and values) and keeps the tree nodes' keys and values for the move after verification | CPU_ATTN: 0.32.0, 0.26.0 (CPU), 0.33.0 read; the others read on 0.32.0 and 0.26.0, never run |
| ``impl.do_kv_cache_update``, ``layer.attn_backend.get_kv_cache_shape`` | ``tree_attention`` | called | the backend's own KV writer fills scratch blocks and moves accepted nodes; the shape tells which cache dimension indexes blocks | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.v1.engine.core.EngineCore._initialize_kv_caches``, ``self.model_executor.collective_rpc`` | ``scheduler`` | wrapped (every process; acts in the engine core, which loads plugins in ``EngineCore.__init__`` before calling it); called | once it returns, the workers have their KV cache and have decided on trees (trees ``auto``, self-check): each is asked which scratch blocks it uses (``scratch.blocks_in_use``), for the scheduler built next from the returned config | 0.32.0, 0.26.0 (CPU, uni and mp executors); 0.33.0 read |
| ``vllm.v1.core.sched.scheduler.Scheduler.__init__`` | ``scheduler`` | wrapped (every process; acts in the engine core) | takes the scratch blocks of tree branches and MTAD beams the workers reported (``scratch``: the pool's last ids; without a report, all they might use) out of ``kv_cache_manager.block_pool`` with ``touch``; for MTAD, raises ``num_lookahead_tokens`` to the draft length γ so the auxiliary model's draft has KV slots past the scheduled tokens (as vLLM does for ``draft_model``; 0.26 sets it in ``__init__``) | 0.32.0, 0.26.0 (CPU); 0.33.0 read (lookahead slots: not read) |
| ``block_pool.reset_prefix_cache`` (instance attribute of the engine core's ``kv_cache_manager.block_pool``), ``BlockPool.free_blocks``, ``BlockPool.touch`` | ``scheduler`` | wrapped; called | vLLM refuses a prefix-cache reset while any block is in use: the held scratch blocks are handed back for the reset and taken again at once | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.config.VllmConfig.num_lookahead_tokens`` (property; absent in 0.26) | ``scheduler`` | wrapped | MTAD's γ lookahead slots, seen by ``Scheduler.__init__``'s admission estimate (``_spec_decode_step_blocks``, ``_request_remaining_blocks``) and ``allocate_slots`` | 0.32.0 (CPU); 0.26.0 has none |
| ``get_model``, ``ModelConfig``, the attention backends' metadata builders, ``set_forward_context`` | ``auxiliary_model`` | called | MTAD's auxiliary model on vLLM's model code, kernels and paged KV cache (its own table) | 0.32.0, 0.26.0 (CPU) |
| ``vllm.v1.sample.rejection_sampler.rejection_sample`` | ``sampler`` | wrapped | captures the target's argmax (and, if the drafter asks, its top-k with log-probabilities) at every draft position, also after the first rejection (the Jacobi iteration the proposer harvests); hands verification to the drafter's ``acceptance_rule`` if it has one (MTAD's joint rule, tree rows included), after vLLM has applied the request's temperature, top-k and top-p; otherwise verifies tree drafts (longest path the target's greedy choices or samples follow); then moves each tree's accepted path's KV to the positions vLLM expects; a step without draft tokens gets its bonus tokens without vLLM's rejection sampling (which draws noise over the vocabulary per sampled row for recovered tokens it has none of) | 0.32.0, 0.26.0 (CPU); 0.33.0 read (before the undrafted steps' path) |
| ``runner.rejection_sampler.forward`` (instance attribute of every speculative runner's ``RejectionSampler``) | ``sampler`` | wrapped | the module-level ``rejection_sample`` wrapper above sees the observer and acceptance rule of the runner that is verifying: engines in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) keep their own; a step without draft tokens and without log-probabilities asked is sampled by the rejection sampler's ``sampler`` alone (``predict_bonus_token=True``, as vLLM samples bonus tokens), without vLLM's copy of the logits and constraints on an empty target (0.95 ms of an 85 ms step of 16 sampled requests on a 2-core CPU), except under a drafter's own acceptance rule | 0.32.0, 0.26.0 (CPU) |
| ``runner.sampler.forward`` (instance attribute of the bound runner's ``Sampler``, which its ``rejection_sampler`` shares; drafters with ``capture_last_top_k`` when the runner is built: lookahead with recycling, ``recycle_top_k`` or trees that may be on; the wrapper reads it again each pass: 0 once trees are off, and with ``auto`` recycling in a pass that verifies drafts filled to K) | ``sampler`` | wrapped | before vLLM processes the logits in place, hands the drafter the target's top-k at each row's last position (the one the next or bonus token is sampled from) in every pass, drafts or none: Token Recycling's predictions after the last input token | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.triton_utils.dispatcher.register_kernels`` (where it exists) | ``kernel_overrides`` | wrapped (every process) | vLLM's scan for its CPU kernel overrides fails on llvmlite's library object (numba's): a worker in a process that had loaded numba (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a second engine) did not start | 0.32.0 (CPU); 0.26.0 has none; 0.33.0 read |
| ``vllm.v1.worker.gpu_model_runner.build_logitsprocs`` | ``request_support`` | wrapped (our methods only) | plain decoding's logits processors (logit_bias, min_p) for the requests served without drafts; start-up refusal of processors vLLM's verifier skips at draft positions | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` | ``sampler`` | replaced, only on CPU without Triton | vLLM's C++ fallback writes float results into a discarded int64 copy, so temperature/top-p reach verification as garbage | 0.32.0, 0.26.0 (CPU); 0.33.0 read (bug still there) |
| ``vllm.v1.sample.rejection_sampler.sample_recovered_tokens`` | ``cpu_recovered_tokens`` | wrapped, only on CPU (every engine, any method), drafts without probabilities | a rejected sampled draft token's replacement drawn from one uniform number a request (inverse transform) instead of exponential noise over the vocabulary (1.2 ms of a 2-core CPU's drafted SmolLM2-135M step) | 0.32.0, 0.26.0 (CPU); 0.33.0 not read |
| ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``, ``vllm.v1.sample.rejection_sampler.apply_top_k_top_p`` | ``cpu_top_p`` | wrapped, only on CPU (every engine, any method) | rows whose top-p nucleus (with top-k) the 128 largest logits decide skip vLLM's sort of the whole vocabulary, which cost more than the model's own share of a verified token under top-p; other rows go to vLLM's function | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``runner.cudagraph_dispatcher.cudagraph_keys`` (``BatchDescriptor.uniform``, ``.num_reqs``) | ``runner_state`` | read | which batch sizes of uniform decode steps (every request 1 + K tokens) replay a full CUDA graph that other speculative steps do not get (``uniform_drafts``: lookahead fills its drafts to K there) | 0.32.0, 0.26.0 read (CPU: no keys); never run on CUDA |
| ``vllm.distributed.get_tp_group().broadcast_object`` | ``runner_state`` | called | every rank drafts with the first rank's step budget; MTAD drafts on the first rank only | 0.32.0, 0.26.0 (CPU, TP 2); 0.33.0 read |
"""

from __future__ import annotations

from typing import Any

from vllm_lookahead import _patching, vllm_support
from vllm_lookahead.options import method_config


def install() -> None:
    """Called by ``plugin.register`` in every process: the engine core's side and the
    CPU kernel scan fix; ``install_worker_patches`` when a worker is built."""
    from vllm_lookahead.worker import kernel_overrides, scheduler

    scheduler.install()
    kernel_overrides.install()


def install_worker_patches(vllm_config: Any) -> None:
    """A worker is being built: on a vLLM with Model Runner V1, the CPU sampling fixes
    (every engine); the runner's and sampler's hooks only for an engine that runs one of
    our methods through V1's ``custom_class``. A vLLM without V1 (0.34 on) gets none of
    them: its engines start as without the plugin, ours through its speculator registry
    (``model_runner_v2``)."""
    if not vllm_support.has_model_runner_v1():
        return
    from vllm_lookahead.worker import sampler

    sampler.install_cpu_fixes()
    if not method_config(vllm_config):
        return
    from vllm.v1.worker import gpu_model_runner

    from vllm_lookahead.worker import request_support, runner

    _patching.wrap(gpu_model_runner.GPUModelRunner, "__init__", runner.binding_init)
    sampler.install()
    request_support.install()
