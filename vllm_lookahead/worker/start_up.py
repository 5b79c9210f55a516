"""What a runner whose drafter builds trees does once its KV cache exists, before the
first request: measure what one more token costs (``start_cost``) where the drafter
asks, then install the tree step (``tree_step``, ``attention_backends``) and prove it
on the device in use (``tree_check``). The drafter hears both.

The procedures above the mechanism: this module and the two it runs use the tree step;
the tree step knows none of them.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``runner.initialize_kv_cache`` (instance attribute, drafters with ``draft_tree`` only; its ``is_profiling`` argument) | wrapped | once the KV cache exists (not vLLM's minimal profiling cache): the cost measurement, then the tree step's wrappers and its self-check | 0.32.0, 0.26.0 (CPU) |
| ``impl`` of the target's ``Attention`` layers (``tree_step.attention_layers``) | read | the implementations whose ``forward`` is wrapped | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

from typing import Any

from vllm_lookahead.worker import attention_backends, start_cost, tree_check, tree_step
from vllm_lookahead.worker.hooks import DrafterHooks, hook


def check_at_start(runner: Any, source: DrafterHooks) -> None:
    """Wrap ``runner.initialize_kv_cache`` (instance attribute): once the KV cache and
    its metadata builders exist (not the minimal cache of vLLM's CUDA-graph profiling),
    measure what an extra token costs if the drafter asks (``start_cost``), then wrap the builders and run the tree step's self-check
    (``tree_check``); the drafter gets both before the first request."""
    original = runner.initialize_kv_cache

    def initialize_kv_cache(kv_cache_config, *args, **kwargs):
        result = original(kv_cache_config, *args, **kwargs)
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        if is_profiling or not hook(source, "trees_on"):
            return result
        if hook(source, "measures_start_cost"):
            source.on_start_cost(start_cost.measure(runner))
        if source.trees_on:
            tree_step.wrap_metadata_builders(runner)
            attention_backends.wrap_forwards(
                [layer.impl for layer in tree_step.attention_layers(runner)])
            check = tree_check.run(runner)
            if check.passed:
                tree_step.run_tree_steps_eagerly(runner)
            source.on_tree_check(check)
        return result

    runner.initialize_kv_cache = initialize_kv_cache
