"""Each attention backend's part of tree verification: before its kernel runs, fill the
branches' scratch blocks (root block copy, path keys and values;
``tree_attention.prepare_layer``).

The part is the same for every backend below: each writes its KV cache through
``do_kv_cache_update`` (vLLM calls it before ``forward``, ``forward_includes_kv_cache_update``
is false) and reads it in ``forward`` by the metadata's block tables, which
``tree_step`` builds from the branch-split batch. A backend's ``forward`` is wrapped
(by ``start_up``, once the KV cache exists) when a model that drafts trees is found to
use it, if it is one of ``tree_step.TREE_IMPLS``; whether trees then run is decided on
the device by the start-up self-check (``tree_check``), and steps with trees run
without CUDA graphs (``tree_step.run_tree_steps_eagerly``).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward`` | wrapped | fill the branches' scratch blocks before the kernel | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``...flash_attn.FlashAttentionImpl.forward``, ``...triton_attn.TritonAttentionImpl.forward``, ``...flashinfer.FlashInferImpl.forward`` | wrapped | the same, on CUDA | 0.32.0, 0.26.0 read (same signature, ``do_kv_cache_update``, no KV write in ``forward``); never run: no GPU so far |
| ``...flex_attention.FlexAttentionImpl.forward`` | wrapped | the same | 0.32.0, 0.26.0 read |
"""

from __future__ import annotations

from typing import Any

from vllm_lookahead import _patching
from vllm_lookahead.worker import tree_attention, tree_step


def wrap_forwards(impls: list[Any]) -> None:
    """Wrap ``forward`` of each implementation class among ``impls`` (once per class)."""
    for cls in {type(impl) for impl in impls}:
        if cls.__name__ not in tree_step.TREE_IMPLS:
            raise ValueError(f"vllm-lookahead: no tree step for {cls.__name__}")
        _patching.wrap(cls, "forward", _tree_aware_forward)


def _tree_aware_forward(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        step = tree_step.active_step()
        if step is not None and attn_metadata is not None and kv_cache.numel():
            tree_attention.prepare_layer(self, layer, key, value, kv_cache, step)
        return original(self, layer, query, key, value, kv_cache, attn_metadata,
                        *args, **kwargs)

    return forward
