"""Tensor parallel 2 on CPU (multiprocessing executor) gives the same greedy output, with
tree drafts (each rank masks, verifies and moves the KV of its own heads)."""

from __future__ import annotations

from conftest import (
    ENGINE_KWARGS,
    TREE,
    generate,
    greedy,
    make_prompts,
    proposer_stats,
    shutdown,
)
from vllm import LLM


def test_tp2_matches_plain_decoding(llama_path, llama_reference, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=TREE, **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(), greedy())
    stats = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    # every rank runs the proposer; the scheduler takes the first rank's drafts (the
    # ranks' draft counts differed by 3 of ~680 tokens in 2 of many runs: unexplained,
    # harmless to the output, which the line above checks)
    assert len(stats) == 2 and all(s.drafts > 0 and s.tree_nodes > 0 for s in stats)
