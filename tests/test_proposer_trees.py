"""Tree drafts in the proposer, without an engine: their shape, options and the start-up
decisions (cost measurement, self-check) that turn them on or off."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from proposers import Batch, capture, make_proposer, top_k

from vllm_lookahead.lookahead.options import LookaheadOptions, request_overrides
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.step_cost import MIN_SAMPLES
from vllm_lookahead.metrics import ACCEPTED_SOURCES
from vllm_lookahead.worker.start_cost import StartCost
from vllm_lookahead.tree import path_by_tokens

def test_tree_drafts_hang_pool_candidates_and_the_window_below_the_main_draft():
    from vllm import SamplingParams

    proposer, runner = make_proposer(k=12, ngram_size=3, tree_candidates=2, tree_window=2,
                                     cost_aware_drafts=False, draft_min_prob=0.3)
    # pool: 5 -> (1, 2), (1, 3), (1, 4); 4 -> three continuations, so the main draft
    # (pool chain while its probability estimate stays >= 0.3) is 1, 4
    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 4, 8, 8, 4, 7, 7, 6, 5]
    batch = Batch(runner, {"tree": context, "linear": context})
    runner.requests["tree"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    runner.requests["linear"] = SimpleNamespace(sampling_params=SamplingParams(
        temperature=0, extra_args={"lookahead_tree_candidates": 0, "lookahead_tree_window": 0}))
    for _ in range(MIN_SAMPLES):  # timed passes whose cost does not grow with tokens:
        proposer.cost_model.add(random.randrange(2, 40), 0.01)  # trees for two rows
    tree_draft, linear_draft = batch.propose(proposer, [[5], [5]])
    assert linear_draft == [1, 4]
    assert proposer.draft_tree("linear", linear_draft) is None
    parents = proposer.draft_tree("tree", tree_draft)
    tokens = [5, *tree_draft]
    assert tree_draft[: len(linear_draft)] == linear_draft  # the main draft comes first
    assert len(tree_draft) <= 12 and all(parents[n] < n for n in range(1, len(parents)))
    assert path_by_tokens(parents, tokens, [1, 3, 0]) == [1, len(linear_draft) + 1]
    assert path_by_tokens(parents, tokens, [1, 4, 0]) == [1, 2]
    # vLLM accepts the candidate 1, 3 (off the main draft); the window's columns harvest
    predictions = [[1, 3] + [0] * (len(tree_draft) - 2), [1] + [0] * (len(linear_draft) - 1)]
    proposer.on_verification(capture([tree_draft, linear_draft], predictions, [0, 0]))
    before = proposer.stats
    batch.set({"tree": context + [1, 3, 7], "linear": context + [1, 7]})
    batch.propose(proposer, [[1, 3, 7], [1, 7]])
    after = proposer.stats
    assert after.tree_accepted - before.tree_accepted == 1
    assert after.harvested_ngrams - before.harvested_ngrams >= 2  # one per window column


def test_a_tree_verified_linearly_for_want_of_scratch_blocks_is_read_as_that_draft():
    """Out of scratch blocks, the worker verifies a tree's nodes in order as a linear
    draft: the proposer reads that pass against those nodes (its harvest included), not
    against the main draft alone, nor as a tree."""
    from vllm import SamplingParams

    proposer, runner = make_proposer(k=12, ngram_size=3, tree_candidates=2, tree_window=2,
                                     cost_aware_drafts=False, draft_min_prob=0.3)
    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 4, 8, 8, 4, 7, 7, 6, 5]
    batch = Batch(runner, {"a": context})
    runner.requests["a"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    draft, = batch.propose(proposer, [[5]])
    main = proposer.states.get("a").draft
    assert len(draft) > len(main) + 2 and proposer.draft_tree("a", draft) is not None
    proposer.on_tree_planned("a", None)
    assert proposer.draft_tree("a", draft) is None and proposer.stats.tree_fallbacks == 1
    # the target accepts the main draft and the first node after it, then disagrees
    predictions = [*draft[: len(main) + 1], 0, *[1] * (len(draft) - len(main) - 2)]
    proposer.on_verification(capture([draft], [predictions], [9]))
    emitted = [*draft[: len(main) + 1], 0]
    batch.set({"a": context + emitted})
    batch.propose(proposer, [emitted])
    stats = proposer.stats
    assert stats.tree_accepted == 0 and stats.harvested_ngrams > 0
    counted = sum(getattr(stats, field) for field in ACCEPTED_SOURCES.values())
    assert counted == len(main)  # the node past the main draft: by no source


def test_recycled_top_k_grows_below_the_root_best_first():
    from vllm_lookahead.lookahead.trees import grow_recycled
    from vllm_lookahead.tree import TreeBuilder

    table = RecycledTopK(vocab_size=16, top_k=2)
    successors = {5: ([1, 2], [.6, .3]), 1: ([3, 4], [.9, .05]), 2: ([6, 7], [.5, .4]),
                  3: ([8, 9], [.5, .4])}
    for token, (ids, probs) in successors.items():
        table.update(np.array([token]), *(t.numpy() for t in top_k([ids], [probs])))
    builder = TreeBuilder(root_token=5, max_nodes=12)
    builder.add_chain([1, 3])  # the main draft
    grow_recycled(builder, table, budget=3, chain_length=2)
    # picks by path probability, each a chain of 2: 1 (.6; 1-3, the main draft's, no new
    # node), 2 (.3; 2-6: two new nodes), 1-3-8 (.27; 8 has no successor: one new node,
    # and the budget of 3 is spent)
    assert builder.tokens == [5, 1, 3, 2, 6, 8]
    assert builder.parents == [-1, 0, 1, 0, 3, 2]
    assert builder.max_nodes == 12  # the tree's own limit is back


def test_tree_options_per_request_are_bounded_by_the_server():
    with pytest.raises(ValueError, match=r"lookahead_tree_window must be an integer in "
                                         r"\[0, 4\] \(4 is the server's tree_window\)"):
        request_overrides({"lookahead_tree_window": 5}, 8,
                          LookaheadOptions.from_dict({"tree_window": 4}))
    assert request_overrides({"lookahead_tree_candidates": 0}, 8,
                             LookaheadOptions.from_dict({"tree_candidates": 4})) == {
        "tree_candidates": 0}


def test_sampled_requests_keep_their_own_acceptance_estimates():
    """A sampled request whose drafts are always wrong lowers its sampling class's
    acceptance, not that of greedy requests in the same batch."""
    from vllm import SamplingParams

    from vllm_lookahead.lookahead.budget import sampling_class

    proposer, runner = make_proposer(k=4, adaptive_draft_length=False)
    contexts = {"greedy": [1, 2, 3] * 4, "sampled": [1, 2, 3] * 4}
    params = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=1.0)}
    batch = Batch(runner, contexts)
    for _ in range(20):
        batch.set(contexts)
        runner.requests.update({req_id: SimpleNamespace(sampling_params=request_params)
                                for req_id, request_params in params.items()})
        drafts = batch.propose(proposer, [[contexts[r][-1]] for r in contexts])
        assert drafts[1], "the sampled request must keep drafting for the test to mean much"
        contexts["greedy"].append(contexts["greedy"][-3])  # the period goes on: drafts right
        contexts["sampled"].append(min({1, 2, 3} - {drafts[1][0]}))  # never the draft's
    greedy, sampled = (proposer._estimates.depth_acceptance[sampling_class(p)]
                       for p in params.values())
    assert greedy.first_token_rate() > 0.8
    assert sampled.first_token_rate() < 0.2


def test_trees_auto_try_both_shapes_and_capture_the_recycled_top_k_in_tree_steps():
    """Trees ``auto``: the start-up measurement (however dear its tokens) leaves them on;
    the steps alternate between trees and linear drafts until both were timed
    (``tree_choice``), and recycling ``auto`` captures the target's top-k only for the
    passes that verify a tree."""
    from vllm import SamplingParams

    from vllm_lookahead.lookahead.options import RECYCLE_TOP_K_WITH_TREES

    proposer, runner = make_proposer(k=12, ngram_size=3, trees="auto", rescoring_top_k=3,
                                     cost_aware_drafts=False)
    proposer.on_start_cost(StartCost(pass_seconds=0.030, token_seconds=0.001))  # 29 free
    assert proposer.trees_on and proposer.stats.start_free_tokens == pytest.approx(29)
    assert proposer.capture_last_top_k == 0  # no tree verified yet
    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 4, 8, 8, 4, 7, 7, 6, 5]
    batch = Batch(runner, {"r": context})
    runner.requests["r"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    shapes, captures, now = [], [], [0.0]
    proposer.clock = lambda: now[0]
    for step in range(8):
        proposer.on_step_start(1, decode_only=True, num_requests=1)
        now[0] += 0.1
        draft = batch.propose(proposer, [[context[-1]]])[0]
        shapes.append(proposer.draft_tree("r", draft) is not None)
        captures.append(proposer.capture_last_top_k)
        context = context + [5 + step % 3]
        batch.set({"r": context})
    # trees first; the shape with fewer timed steps next, counted on the steps timed so
    # far (a step is timed when the next one starts, after it planned its successor)
    assert shapes == [True, True, False, False, False, True, True, True]
    assert captures == [RECYCLE_TOP_K_WITH_TREES if tree else 0 for tree in shapes]
    assert proposer.capture_top_k == max(3, captures[-1])
    # an explicit recycle_top_k is captured in every pass; trees off capture nothing
    assert make_proposer(trees="auto", recycle_top_k=4)[0].capture_last_top_k == 4
    off, _ = make_proposer(trees="off")
    assert not off.trees_on and off.capture_last_top_k == 0
    assert not off.measures_start_cost and make_proposer(trees="auto")[0].measures_start_cost
    with pytest.raises(ValueError, match="'tree_free_tokens' is gone"):
        make_proposer(trees="auto", tree_free_tokens=10)


def test_the_start_up_cost_reads_each_sizes_fastest_pass():
    """Passes on a device where extra tokens are nearly free (a 2 ms pass, 1 us a token
    more), with delays that only ever add time, in three of five rounds: the fastest
    passes find the same free tokens as undisturbed ones; the medians would find 12."""
    from vllm_lookahead.worker.start_cost import EXTRA_TOKENS, REPEATS, SIZES, summarize

    clean = np.array([0.002 + 1e-6 * (n - 1) for n in SIZES])
    rounds = np.tile(clean, (REPEATS, 1))
    rounds[:3, -1] += 0.005  # the longest pass disturbed in three rounds
    rounds[3, 0] += 0.001  # and the one-token pass in another
    cost = summarize(rounds)
    assert cost.size_seconds == pytest.approx(tuple(clean))
    assert cost.free_tokens == pytest.approx((0.002 - 1e-6) / 1e-6)
    median_extra = np.median(rounds[:, -1] - rounds[:, 0]) / EXTRA_TOKENS  # the old reading
    assert round((np.median(rounds[:, 0]) - median_extra) / median_extra) == 12
    # a longest pass measured faster than the one-token pass: tokens are free
    rounds[:, -1] = 0.0019
    assert summarize(rounds).free_tokens == math.inf


def test_a_failed_self_check_turns_auto_trees_and_recycling_off():
    from vllm_lookahead.worker.tree_check import TreeCheck

    proposer, _ = make_proposer(trees="auto", tree_candidates=4)
    assert proposer._sources.recycled is not None  # captured in tree steps
    proposer.on_tree_check(TreeCheck(passed=False, backend="CPU_ATTN", dtype="float32",
                                     max_difference=1.0, tolerance=1e-3))
    assert not proposer.trees_on and proposer._sources.recycled is None
    assert proposer.capture_last_top_k == 0
    assert proposer.stats.tree_check == 0


def test_trees_on_refuse_to_start_when_the_self_check_fails():
    """``trees: "on"`` is what the user asked for: no silent fall-back to linear drafts,
    the engine's start fails with the check's verdict."""
    from vllm_lookahead.worker.tree_check import TreeCheck

    proposer, _ = make_proposer(trees="on")
    failed = TreeCheck(passed=False, backend="FLASH_ATTN", dtype="bfloat16",
                       max_difference=0.96, tolerance=0.05)
    with pytest.raises(RuntimeError, match=r"trees is 'on', but the tree step self-check on FLASH_ATTN"
                                           r".*failed.*Set trees to 'auto'"):
        proposer.on_tree_check(failed)


def test_the_default_window_gives_way_to_short_ngrams():
    assert LookaheadOptions.from_dict({"ngram_size": 2}).tree_window == 0
    assert LookaheadOptions.from_dict({}).tree_window == 4
    assert LookaheadOptions.from_dict({"trees": "off"}).tree_drafts is False
    assert LookaheadOptions.from_dict({"tree_candidates": 0, "tree_window": 0}).tree_drafts \
        is False
