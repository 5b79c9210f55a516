"""Token trees: the trie, its masks and walks (unit), and tree drafts on the engine:
bit-exact greedy under chunked prefill and preemption, and the target's distribution
when sampling."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from conftest import (
    ENGINE_KWARGS,
    SIGNIFICANCE,
    STRESSED,
    TREE,
    generate,
    greedy,
    make_prompts,
    proposer_stats,
    same_distribution_pvalue,
    sample_tokens,
    shutdown,
)
from vllm import LLM, SamplingParams

from vllm_lookahead.worker.runner_state import allows_trees
from vllm_lookahead.worker.tree_step import check_tree_attention
from vllm_lookahead.tree import (
    TreeBuilder,
    accepted_path,
    ancestor_mask,
    depths_of,
    is_chain,
    path_by_tokens,
)


def test_chains_sharing_a_prefix_share_nodes_within_the_budget():
    builder = TreeBuilder(root_token=7, max_nodes=6)
    assert builder.add_chain([1, 2, 3]) == [1, 2, 3]
    assert builder.add_chain([1, 5]) == [1, 4]
    assert builder.add_chain([9, 8, 7], parent=2) == [5, 6]  # budget: 6 nodes
    assert builder.draft == [1, 2, 3, 5, 9, 8]
    assert builder.parents == [-1, 0, 1, 2, 1, 2, 5]
    assert depths_of(np.array(builder.parents)).tolist() == [0, 1, 2, 3, 2, 3, 4]


def test_ancestor_mask_and_chains():
    parents = np.array([-1, 0, 1, 0, 3])
    assert ancestor_mask(parents).astype(int).tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    assert not is_chain(parents)
    assert is_chain(np.array([-1, 0, 1, 2]))


def test_walks_follow_the_targets_choice_at_each_node():
    #            root  a  b  c  d      tree: root-a-b, root-c-d
    parents = np.array([-1, 0, 1, 0, 3])
    tokens = [100, 1, 2, 3, 4]
    assert accepted_path(parents, tokens, [3, 9, 9, 4, 8]) == [3, 4]
    assert accepted_path(parents, tokens, [1, 5, 9, 9, 9]) == [1]
    assert accepted_path(parents, tokens, [6, 2, 9, 9, 9]) == []
    assert path_by_tokens(parents, tokens, [3, 4, 8]) == [3, 4]
    assert path_by_tokens(parents, tokens, [3]) == []  # the bonus token is no node


def test_requests_whose_sampling_depends_on_draft_position_get_linear_drafts():
    assert allows_trees(SamplingParams(temperature=0.7, top_p=0.9))
    assert not allows_trees(None)
    for params in (SamplingParams(logprobs=2), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(frequency_penalty=0.5), SamplingParams(min_tokens=3)):
        assert not allows_trees(params)


#: Sampling: no main draft at all (no context match, no pool draft), so every accepted
#: token was chosen among the tree's branches (pool candidates and the window).
TREE_ONLY = {**TREE, "corpus_tokens": 0, "suffix_match_min": 128, "suffix_match_max": 128,
             "guess_set_size": 0, "tree_candidates": 8}


def test_tree_options_are_refused_where_attention_cannot_mask_trees():
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.layers.attention import Attention

    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    layer.impl = SimpleNamespace()  # a backend without the plugin's tree step
    forward_context = {"model.layers.0.self_attn.attn": layer}  # where layers register
    runner = SimpleNamespace(uses_mrope=False, vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward_context)))
    with pytest.raises(ValueError, match="tree_candidates and tree_window need tree "
                                         "attention.*attention implementation "
                                         "SimpleNamespace"):
        check_tree_attention(runner)


@pytest.fixture(scope="module")
def tree_llm(llama_path):
    llm = LLM(llama_path, speculative_config=TREE, **STRESSED)
    yield llm
    shutdown(llm)


def test_trees_under_chunked_prefill_and_preemption_match_plain_decoding(
        tree_llm, llama_reference):
    before, = proposer_stats(tree_llm)
    assert generate(tree_llm, make_prompts(), greedy()) == llama_reference
    after, = proposer_stats(tree_llm)
    assert after.tree_nodes > before.tree_nodes


def test_prefix_cache_resets_with_scratch_blocks_held(tree_llm, llama_reference):
    # vLLM refuses a reset while any block is in use; the held scratch blocks must be
    # back in our hands afterwards, or requests in this tight KV pool would take them
    # while trees write their branches there
    assert tree_llm.reset_prefix_cache()
    assert generate(tree_llm, make_prompts(), greedy()) == llama_reference


def test_tree_samples_follow_the_target_distribution(llama_path, plain_samples):
    prompt, reference = plain_samples
    # few requests per step: every step's trees fit the held-back scratch blocks
    llm = LLM(llama_path, speculative_config=TREE_ONLY, max_num_seqs=3, **ENGINE_KWARGS)
    speculated = sample_tokens(llm, prompt)
    stats, = proposer_stats(llm)
    # the control: tree nodes verified by the target's argmax instead of its samples
    llm.collective_rpc(partial(_verify_trees_greedily, biased=True))
    try:
        biased = sample_tokens(llm, prompt)
    finally:  # an engine in pytest's process shares the module with later engines
        llm.collective_rpc(partial(_verify_trees_greedily, biased=False))
        shutdown(llm)
    # the positions below really went through tree verification
    assert stats.tree_fallbacks == 0
    assert stats.tree_accepted > 500  # of ~6000 tokens; S ~1.15 at T=0.7 on this model
    for position in (1, 2, 3):
        assert same_distribution_pvalue(reference[:, position],
                                        speculated[:, position]) > SIGNIFICANCE
    # the test can tell: the biased verifier's samples fail it
    assert min(same_distribution_pvalue(reference[:, position], biased[:, position])
               for position in (1, 2, 3)) < SIGNIFICANCE


def _verify_trees_greedily(worker, biased: bool):
    """In the worker: a deliberately biased tree verifier, which follows the target's
    argmax at every node of a sampled request (vLLM still samples the bonus token);
    ``biased=False`` puts the true one back."""
    from types import SimpleNamespace

    from vllm_lookahead.worker import sampler

    if not biased:
        sampler._verify_trees = sampler._verify_trees.unbiased
        return
    original = sampler._verify_trees

    def greedy(step, output, draft_token_ids, num_draft_tokens, target_logits,
               target_argmax, bonus_token_ids, sampling_metadata):
        as_greedy = SimpleNamespace(all_greedy=True, generators=sampling_metadata.generators)
        original(step, output, draft_token_ids, num_draft_tokens, target_logits,
                 target_argmax, bonus_token_ids, as_greedy)

    greedy.unbiased = original
    sampler._verify_trees = greedy


#: Oracle trees: a wrong first chain, then the reference continuation as a branch.
WRONG, TRUE = 2, 6


def _install_oracle(worker, prompts, reference):
    """In the worker: make the drafter propose, for each request, WRONG tokens as its
    first chain and the next TRUE tokens of plain decoding as a second chain from the
    root. Every accepted token then comes through a branch sequence: a node's
    prediction is only right if its attention saw exactly its ancestors (and, after a
    move, the KV of the accepted path). Counts the requests' passes and tokens."""
    drafter = worker.model_runner.drafter
    vocab = worker.model_runner.model_config.get_vocab_size()
    counts = drafter.oracle_counts = {"passes": 0, "tokens": 0}

    def propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, *args, **kwargs):
        drafts = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            counts["passes"] += 1
            counts["tokens"] += len(sampled)
            context = token_ids_cpu[row, : int(num_tokens_no_spec[row])].tolist()
            index = next(i for i, p in enumerate(prompts) if context[: len(p)] == p)
            done = len(context) - len(prompts[index])
            truth = reference[index][done : done + TRUE]
            wrong = [(token + 1) % vocab for token in truth[:WRONG]]
            drafts.append(wrong + truth if len(truth) == TRUE else [])
        return drafts

    def draft_tree(req_id, scheduled):
        parents = [-1, 0, 1, 0, *range(3, 3 + TRUE - 1)][: len(scheduled) + 1]
        return np.array(parents)

    drafter.propose = propose
    drafter.draft_tree = draft_tree


def _remove_oracle(worker):
    """Back to the drafter's own methods (the oracle set them on the instance)."""
    drafter = worker.model_runner.drafter
    del drafter.propose, drafter.draft_tree
    return drafter.oracle_counts


def test_oracle_trees_accepted_off_the_first_chain_match_plain_decoding(
        tree_llm, llama_reference):
    prompts = make_prompts()
    tree_llm.collective_rpc(lambda worker: _install_oracle(worker, prompts, llama_reference))
    try:
        outputs = generate(tree_llm, prompts, greedy())
    finally:
        counts, = tree_llm.collective_rpc(_remove_oracle)
    assert outputs == llama_reference
    # most passes accept the whole branch: no token of the first chain is ever right
    assert counts["tokens"] / counts["passes"] > 3.0


def test_after_a_failed_check_drafts_are_linear_and_exact(tree_llm, llama_reference):
    """A failed tree self-check (``worker/tree_check.py``) leaves an engine with trees
    ``auto`` serving linear drafts, still exact. Last of this module's tests on ``tree_llm``: trees
    stay off in it from here on."""
    def fail(worker):
        import dataclasses

        from vllm_lookahead.worker import tree_check

        switch = worker.model_runner.drafter._trees  # as if started with trees auto
        switch.options = dataclasses.replace(switch.options, trees="auto")
        worker.model_runner.drafter.on_tree_check(tree_check.TreeCheck(
            passed=False, backend="any", dtype="float32", max_difference=1.0,
            tolerance=1e-3))

    before, = proposer_stats(tree_llm)
    tree_llm.collective_rpc(fail)
    assert generate(tree_llm, make_prompts(), greedy()) == llama_reference
    after, = proposer_stats(tree_llm)
    assert after.tree_check == 0 and after.tree_nodes == before.tree_nodes
    assert after.drafts > before.drafts
