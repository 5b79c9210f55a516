"""CPU_ATTN's part of tree verification: before its kernel runs, fill the branches'
scratch blocks (root block copy, path keys and values; ``tree_attention.prepare_layer``)."""

from __future__ import annotations

from vllm_lookahead import _patching
from vllm_lookahead.worker import tree_attention, tree_step


def install() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    _patching.wrap(CPUAttentionBackendImpl, "forward", _tree_aware_forward)


def _tree_aware_forward(original):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        step = tree_step.active_step()
        if step is not None and attn_metadata is not None and kv_cache.numel():
            tree_attention.prepare_layer(self, layer, key, value, kv_cache, step)
        return original(self, layer, query, key, value, kv_cache, attn_metadata, output,
                        *args, **kwargs)

    return forward
