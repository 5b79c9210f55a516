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


def _lying_clock_on_second_rank(worker) -> None:
    """The second rank's step clock runs at a random pace: whatever it measures, it must
    draft as the first rank decides."""
    import random

    import torch

    if torch.distributed.get_rank() == 0:
        return
    rng, now = random.Random(1), [0.0]

    def clock() -> float:
        now[0] += rng.uniform(0.001, 0.5)
        return now[0]

    worker.model_runner.drafter.clock = clock


#: Every counter of a drafting decision: what was drafted, from which source, cut,
#: filled to K, grown into trees and verified off the first chain.
DECISIONS = ("drafts", "draft_tokens", "cut_tokens", "suffix_tokens", "corpus_tokens",
             "pool_tokens", "recycled_tokens", "padding_tokens", "filled_steps", "tree_steps",
             "tree_nodes", "tree_branches", "tree_accepted")


def test_tp2_ranks_decide_alike_round_after_round(llama_path, llama_reference, monkeypatch):
    """Rounds of 8 requests that finish in the same step: each round's outputs join the
    corpus (in the order the ranks iterate the finished ids) and the next round drafts
    from it; filling, cuts and trees (``auto``: which steps grow them, by each rank's
    own step times) on every rank's own timing, the second rank's clock lying. After
    every round each rank has taken the same decisions."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    config = {**TREE, "trees": "auto", "cost_aware_drafts": True, "uniform_drafts": "on",
              "suffix_match_min": 2}
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=config, **ENGINE_KWARGS)
    llm.collective_rpc(_lying_clock_on_second_rank)
    try:
        for round_ in range(4):
            params = greedy()
            if round_ >= 2:  # drafts bounded below K cannot be filled: trees instead
                params.extra_args = {"lookahead_num_speculative_tokens": 11}
            outputs = generate(llm, make_prompts(seed=round_ % 2), params)
            if round_ % 2 == 0:
                assert outputs == llama_reference
            stats = proposer_stats(llm)
            decisions = [{name: getattr(s, name) for name in DECISIONS} for s in stats]
            print(f"round {round_} rank decisions:", decisions)  # the evidence, with -s
            assert decisions[0] == decisions[1], f"round {round_}: {decisions}"
        assert stats[0].corpus_tokens > 0 and stats[0].filled_steps > 0
        assert stats[0].tree_nodes > 0
    finally:
        shutdown(llm)


def _clock_pricing_tokens(worker) -> None:
    """Each rank's step clock prices a step's tokens its own way: on the first rank each
    token costs 10 ms more (tree steps are dear), on the second none (trees are free).
    Trees ``auto`` would choose differently on each rank by its own times."""
    import torch

    drafter = worker.model_runner.drafter
    per_token = 0.010 if torch.distributed.get_rank() == 0 else 0.0
    now = [0.0]

    def clock() -> float:  # called once per step start; the step before had these tokens
        previous = drafter._step_start
        now[0] += 0.010 + per_token * (previous[1] if previous else 0)
        return now[0]

    drafter.clock = clock


def test_tp2_ranks_choose_tree_steps_alike(llama_path, llama_reference, monkeypatch):
    """One request at a time, trees ``auto``: which steps grow trees is chosen from step
    times, and the ranks' clocks disagree on them; every rank follows the first."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config={**TREE, "trees": "auto"}, **ENGINE_KWARGS)
    llm.collective_rpc(_clock_pricing_tokens)
    try:
        outputs = [generate(llm, [prompt], greedy())[0] for prompt in make_prompts()]
        stats = proposer_stats(llm)
    finally:
        shutdown(llm)
    assert outputs == llama_reference
    decisions = [{name: getattr(s, name) for name in DECISIONS} for s in stats]
    assert decisions[0] == decisions[1], decisions
    # the first rank's dear tokens: trees beyond the first steps only in probes
    assert 0 < stats[0].tree_steps < stats[0].steps / 3


#: One step's finished requests reach each rank as a set of id strings, which each
#: process iterates in the order of its own string hashing (``PYTHONHASHSEED``, random
#: for every process vLLM spawns).
FINISH_TOGETHER = """
import json, sys
sys.path.insert(0, "tests")
from proposers import Batch, make_proposer

proposer, runner = make_proposer(k=4)
contexts = {f"request-{i}": [1 + i, 2, 3, 10 + i] for i in range(8)}
Batch(runner, contexts).propose(proposer, [[20 + i] for i in range(8)])
proposer.on_requests_removed(set(contexts), set())
corpus = proposer._sources.corpus
print(json.dumps(corpus.storage[0][:len(corpus)].tolist()))
"""


def test_requests_finishing_together_fill_every_ranks_corpus_alike():
    """The corpus (and so every later draft from it) does not depend on the process's
    string hashing: ranks that differ only in it fill it alike."""
    import json
    import os
    import subprocess
    import sys

    corpora = set()
    for seed in ("1", "2", "3"):
        run = subprocess.run([sys.executable, "-c", FINISH_TOGETHER], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": seed})
        assert run.returncode == 0, run.stderr[-3000:]
        corpora.add(run.stdout.strip().splitlines()[-1])
    assert len(corpora) == 1, corpora
    assert len(json.loads(corpora.pop())) >= 8  # every finished output is in it
