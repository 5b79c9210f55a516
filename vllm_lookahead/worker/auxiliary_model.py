"""A second decoder in the target's worker on vLLM's own model code, attention kernels
and paged KV cache (MTAD's auxiliary model).

It is loaded the way vLLM loads ``draft_model``: ``get_model`` under a prefix, from the
drafter's ``load_model``, before the runner sizes the KV cache, so the runner gives its
attention layers caches in the same block pool and block tables as the target's. A
pass runs any batch of *sequences*, each with its own list of blocks: beams share their
request's prefix blocks and keep their tails in blocks of their own.

| vLLM attribute | use | why | verified on |
|---|---|---|---|
| ``vllm.config.ModelConfig(model=, runner="draft", ...)`` | called | the auxiliary model's configuration, with the keywords ``SpeculativeConfig`` gives ``draft_model``'s | 0.32.0, 0.26.0 (CPU) |
| ``vllm.config.utils.replace`` | called | a ``VllmConfig`` with that model (the compilation config, hence the forward context, stays shared) | 0.32.0, 0.26.0 (CPU) |
| ``vllm.model_executor.model_loader.get_model(vllm_config=, prefix=)`` | called | weights through vLLM's model code; its attention layers register under the prefix | 0.32.0, 0.26.0 (CPU) |
| ``vllm.compilation.backends.set_model_tag`` | called | a compile cache of its own, as ``draft_model`` | 0.32.0, 0.26.0 (CPU) |
| ``vllm.config.get_layers_from_vllm_config`` | called | the auxiliary model's attention layers | 0.32.0, 0.26.0 (CPU) |
| ``runner.kv_cache_config.kv_cache_groups``, ``runner.input_batch.block_table[group]`` | read | the group of the auxiliary layers; a request's block ids | 0.32.0, 0.26.0 (CPU) |
| ``layer.get_attn_backend().get_builder_cls()(spec, layers, vllm_config, device).build(0, CommonAttentionMetadata(...))`` | called | the backend's own metadata for these batches, built with the auxiliary model's configuration (head counts) | 0.32.0, 0.26.0 (CPU_ATTN) |
| ``vllm.forward_context.set_forward_context(metadata, vllm_config, num_tokens=, slot_mapping=)`` | called | the per-layer metadata and KV slots of a pass | 0.32.0, 0.26.0 (CPU) |
| ``model.compute_logits``, ``layer.kv_cache`` | called, read | next-token logits; block copies between beams | 0.32.0, 0.26.0 (CPU) |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_lookahead.worker import tree_attention
from vllm_lookahead.worker.scratch import scratch_blocks

#: The auxiliary model's attention layers are named under this prefix.
PREFIX = "mtad_auxiliary"


@dataclass
class Sequence:
    """One sequence of a pass: its last ``query_len`` tokens are computed, its first
    ``seq_len`` tokens are in context; ``blocks[i]`` holds positions
    ``[i * block_size, (i + 1) * block_size)``."""

    query_len: int
    seq_len: int
    blocks: np.ndarray


def load(vllm_config: Any, name: str) -> tuple[torch.nn.Module, Any]:
    """The model and its ``VllmConfig``; raises what vLLM raises if it cannot load it."""
    from vllm.compilation.backends import set_model_tag
    from vllm.config import ModelConfig
    from vllm.config.utils import replace
    from vllm.model_executor.model_loader import get_model

    target = vllm_config.model_config
    model_config = ModelConfig(
        model=name, runner="draft", tokenizer=target.tokenizer,
        tokenizer_mode=target.tokenizer_mode, trust_remote_code=target.trust_remote_code,
        dtype=target.dtype, seed=target.seed, max_model_len=target.max_model_len,
        enforce_eager=target.enforce_eager, max_logprobs=target.max_logprobs,
    )
    aux_config = replace(vllm_config, model_config=model_config, quant_config=None)
    with set_model_tag(PREFIX):
        model = get_model(vllm_config=aux_config, prefix=PREFIX)
    return model, aux_config


class PagedModel:
    """Runs the loaded auxiliary model over batches of ``Sequence`` in the runner's
    KV cache. Bound to the cache lazily: the runner allocates it after loading."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, runner: Any):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        self.model = model
        self.vllm_config = vllm_config
        self.runner = runner
        self.layers = {name: layer for name, layer in get_layers_from_vllm_config(
            vllm_config, AttentionLayerBase).items() if name.startswith(PREFIX + ".")}
        if not self.layers:
            raise RuntimeError("vllm-lookahead: the auxiliary model has no attention layers")
        self._group: int | None = None
        self._builders: list[tuple[Any, list[str]]] = []
        self.block_size = 0
        self._caches: list[tuple[list[torch.Tensor], int]] = []  # (stacked caches, block dim)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _bind(self) -> None:
        """Find the auxiliary layers' KV cache group and build their metadata builders."""
        config = self.runner.kv_cache_config
        groups = {gid for gid, group in enumerate(config.kv_cache_groups)
                  for name in group.layer_names if name in self.layers}
        if len(groups) != 1:
            raise RuntimeError(f"vllm-lookahead: the auxiliary model's layers are in KV "
                               f"cache groups {sorted(groups)}; one group is needed")
        self._group = groups.pop()
        group_spec = config.kv_cache_groups[self._group].kv_cache_spec
        by_key: dict[tuple[type, Any], list[str]] = {}
        for name, layer in self.layers.items():
            specs = getattr(group_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            spec = specs[name] if specs else group_spec
            by_key.setdefault((layer.get_attn_backend(), spec), []).append(name)
        for (backend, spec), names in by_key.items():
            builder = backend.get_builder_cls()(spec, names, self.vllm_config, self.device)
            self._builders.append((builder, names))
            caches = [_layer_cache(self.layers[name]) for name in names]
            self._caches.append((tree_attention.stacked(caches),
                                 tree_attention.block_dim(backend, caches[0])))
        self.block_size = group_spec.block_size

    def beam_blocks(self) -> list[int]:
        """The scratch blocks held back for beams (``scratch.py``)."""
        if self._group is None:
            self._bind()
        return scratch_blocks(self.runner.vllm_config, self.runner.kv_cache_config.num_blocks,
                              self.block_size).beams

    def request_blocks(self, row: int) -> np.ndarray:
        """The block ids the scheduler gave the request in input-batch row ``row``."""
        if self._group is None:
            self._bind()
        table = self.runner.input_batch.block_table[self._group]
        return table.block_table.np[row, : int(table.num_blocks_per_row[row])]

    @torch.inference_mode()
    def forward(self, tokens: np.ndarray, positions: np.ndarray,
                sequences: list[Sequence]) -> torch.Tensor:
        """Logits after each sequence's last token (``[len(sequences), vocab]``), having
        written the keys and values of every token to its sequence's blocks. Tokens are
        laid out sequence after sequence."""
        if self._group is None:
            self._bind()
        query_lens = np.array([s.query_len for s in sequences], dtype=np.int64)
        seq_lens = np.array([s.seq_len for s in sequences], dtype=np.int64)
        width = max(len(s.blocks) for s in sequences)
        table = np.zeros((len(sequences), width), dtype=np.int32)
        for i, s in enumerate(sequences):
            table[i, : len(s.blocks)] = s.blocks
        owner = np.repeat(np.arange(len(sequences)), query_lens)
        slots = table[owner, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        metadata = self._metadata(starts, seq_lens, table, slots, int(query_lens.max()))
        device = self.device
        slot_tensor = torch.from_numpy(slots).to(device)
        from vllm.forward_context import set_forward_context

        with set_forward_context(metadata, self.runner.vllm_config, num_tokens=len(tokens),
                                 slot_mapping={name: slot_tensor for name in self.layers}):
            hidden = self.model(input_ids=torch.from_numpy(tokens.astype(np.int64)).to(device),
                                positions=torch.from_numpy(positions.astype(np.int64)).to(device))
        last = torch.from_numpy(starts[1:] - 1).to(device)
        return self.model.compute_logits(hidden[last])

    def _metadata(self, starts: np.ndarray, seq_lens: np.ndarray, table: np.ndarray,
                  slots: np.ndarray, max_query_len: int) -> dict[str, Any]:
        common = common_attention_metadata(starts, seq_lens, table, slots, max_query_len,
                                           self.device)
        metadata = {}
        for builder, layer_names in self._builders:
            built = builder.build(0, common)
            metadata.update(dict.fromkeys(layer_names, built))
        return metadata

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Block ``targets[i]`` becomes a copy of block ``sources[i]`` in every layer (all
        sources are read before any target is written)."""
        if not sources:
            return
        src = torch.tensor(sources, dtype=torch.long, device=self.device)
        dst = torch.tensor(targets, dtype=torch.long, device=self.device)
        for stacked, dim in self._caches:
            for caches in stacked:
                caches.index_copy_(dim + 1, dst, caches.index_select(dim + 1, src))


def common_attention_metadata(starts: np.ndarray, seq_lens: np.ndarray, table: np.ndarray,
                              slots: np.ndarray, max_query_len: int, device: torch.device
                              ) -> Any:
    """vLLM's ``CommonAttentionMetadata`` for sequences whose queries start at
    ``starts`` (one more entry than sequences), ``seq_lens`` tokens long with their
    block table rows ``table``; ``slots``: the KV slot of each query token."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts_cpu = torch.from_numpy(starts.astype(np.int32))
    seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    values = {
        "query_start_loc": starts_cpu.to(device), "query_start_loc_cpu": starts_cpu,
        "seq_lens": seq_lens_cpu.to(device), "num_reqs": len(seq_lens),
        "num_actual_tokens": int(starts[-1]), "max_query_len": max_query_len,
        "max_seq_len": int(seq_lens.max()),
        "block_table_tensor": torch.from_numpy(table).to(device),
        "slot_mapping": torch.from_numpy(slots).to(device),
        # vLLM 0.26 keeps these host copies as optional fields
        "_seq_lens_cpu": seq_lens_cpu,
        "_num_computed_tokens_cpu": seq_lens_cpu - torch.from_numpy(
            np.diff(starts).astype(np.int32)),
    }
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    return CommonAttentionMetadata(**{k: v for k, v in values.items() if k in names})


def _layer_cache(layer: Any) -> torch.Tensor:
    cache = layer.kv_cache
    return cache[0] if isinstance(cache, (list, tuple)) else cache
