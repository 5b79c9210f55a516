"""The tree step's graph-mode decision, run through vLLM's own dispatcher and batch
planner on CPU (no engine, no GPU): a step with tree branches must not replay a CUDA
graph, which was captured with linear metadata and would drop the tree's mask and
scratch writes; a step without branches keeps the graph vLLM picks."""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_lookahead.worker import tree_step

K = 4


def runner_with_graphs(mode):
    """A stand-in runner holding the attributes vLLM's
    ``_determine_batch_execution_and_padding`` reads, with vLLM's ``CudagraphDispatcher``
    holding the keys it would capture in ``mode``."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    compilation = SimpleNamespace(
        # multiples of 1 + K, as vLLM rounds them with speculative decoding
        cudagraph_mode=mode, max_cudagraph_capture_size=8 * (1 + K),
        cudagraph_capture_sizes=[(1 + K) * n for n in (1, 2, 4, 8)], compile_sizes=[],
        is_attention_compiled_piecewise=lambda: True, splitting_ops=[], mode=None,
        pass_config=SimpleNamespace(enable_sp=False))
    parallel = SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1)
    config = SimpleNamespace(
        compilation_config=compilation, num_speculative_tokens=K, lora_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=8), parallel_config=parallel,
        observability_config=SimpleNamespace(cudagraph_metrics=False))
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(mode, 1 + K)
    runner = SimpleNamespace(
        cudagraph_dispatcher=dispatcher, uniform_decode_query_len=1 + K, vllm_config=config,
        compilation_config=compilation, parallel_config=parallel,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        _is_uniform_decode=GPUModelRunner._is_uniform_decode,
        _pad_for_sequence_parallelism=lambda num_tokens: num_tokens)  # vLLM 0.26
    runner._determine_batch_execution_and_padding = types.MethodType(
        GPUModelRunner._determine_batch_execution_and_padding, runner)
    return runner


def graph_mode(runner, num_reqs: int):
    """The mode vLLM picks for a decode step of ``num_reqs`` requests with K draft
    tokens (or K tree nodes) each: a uniform decode batch."""
    scheduled = np.full(num_reqs, 1 + K)
    return runner._determine_batch_execution_and_padding(
        num_tokens=int(scheduled.sum()), num_reqs=num_reqs, num_scheduled_tokens_np=scheduled,
        max_num_scheduled_tokens=1 + K, use_cascade_attn=False)[0]


@pytest.mark.parametrize("mode_name", ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE"])
def test_steps_with_trees_run_eagerly_and_other_steps_keep_their_graphs(monkeypatch,
                                                                          mode_name):
    from vllm.config import CUDAGraphMode

    mode = CUDAGraphMode[mode_name]
    runner = runner_with_graphs(mode)
    picked = graph_mode(runner, 2)
    # a tree of K nodes looks like a uniform K-token draft: vLLM alone would replay a graph
    assert picked == (CUDAGraphMode.PIECEWISE if mode_name == "PIECEWISE" else CUDAGraphMode.FULL)
    tree_step.run_tree_steps_eagerly(runner)
    monkeypatch.setattr(tree_step, "_step", None)
    assert graph_mode(runner, 2) == picked  # no tree this step: the graph stays
    monkeypatch.setattr(tree_step, "_step", SimpleNamespace(branches=[]))
    assert graph_mode(runner, 2) == picked  # trees planned, none split off: linear
    monkeypatch.setattr(tree_step, "_step", SimpleNamespace(branches=[object()]))
    assert graph_mode(runner, 2) == CUDAGraphMode.NONE
