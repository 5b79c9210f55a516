"""Tensor parallel 2 on CPU (multiprocessing executor) gives the same greedy output, with
tree drafts (each rank splits branches, verifies and moves the KV of its own heads), and
every rank takes the same drafting decisions (the step budget is the first rank's)."""

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


def _cheap_tokens_on_first_rank(worker) -> None:
    """The first rank's cost model is fitted from the start on a simulated clock (30 ms
    a step plus 0.1 ms a token: 300 tokens free) and keeps timing its steps on it, so
    trees are built in every step whatever this machine's timing (with real timing, or
    before the first fit, a batch of requests may get none). The other rank keeps its
    real clock: only the broadcast budget makes their decisions equal."""
    import torch

    from vllm_lookahead.lookahead.step_cost import MIN_SAMPLES

    if torch.distributed.get_rank() != 0:
        return
    drafter = worker.model_runner.drafter

    def step_seconds(tokens: int) -> float:
        return 0.030 + 0.0001 * tokens

    for tokens in range(1, MIN_SAMPLES + 1):
        drafter.cost_model.add(tokens, step_seconds(tokens))
    now = [0.0]

    def clock() -> float:  # called once per step start; the step before had these tokens
        previous = drafter._step_start
        now[0] += step_seconds(previous[1] if previous else 0)
        return now[0]

    drafter.clock = clock


def test_tp2_matches_plain_decoding(llama_path, llama_reference, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    # the default cost-aware budget: each rank times its own steps
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config={**TREE, "cost_aware_drafts": True}, **ENGINE_KWARGS)
    llm.collective_rpc(_cheap_tokens_on_first_rank)
    outputs = generate(llm, make_prompts(), greedy())
    stats = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    assert len(stats) == 2 and stats[0].drafts > 0 and stats[0].tree_branches > 0
    assert [s.tree_check for s in stats] == [1, 1]  # every rank's self-check passed
    decisions = [(s.drafts, s.draft_tokens, s.cut_tokens, s.tree_nodes, s.tree_branches,
                  s.tree_accepted) for s in stats]
    assert decisions[0] == decisions[1]
