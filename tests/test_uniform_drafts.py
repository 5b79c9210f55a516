"""Drafts filled to K for a full CUDA graph: when (by mode, batch and measured step
times), with what, and how the proposer counts and times them (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from proposers import Batch, make_proposer

from vllm_lookahead.lookahead.sources.draft import Draft
from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.uniform_drafts import (
    MIN_TIMED,
    PROBE_INTERVAL,
    UniformDrafts,
    fill_draft,
)
from vllm_lookahead.metrics import ACCEPTED_SOURCES
from vllm_lookahead.worker.runner_state import uniform_graph_requests

K = 4


def full_k(rows):
    return np.full(rows, K)


def test_on_fills_only_batches_that_can_be_uniform():
    uniform = UniformDrafts("on", K)
    uniform.set_graph_requests(0)  # no graphs: `on` fills anyway
    assert uniform.wanted(3, 3, full_k(3))
    assert not uniform.wanted(3, 2, full_k(2))  # a prompt chunk in the step
    assert not uniform.wanted(2, 2, np.array([K, K - 1]))  # near max_model_len, or own K
    assert not UniformDrafts("off", K).wanted(1, 1, full_k(1))


def test_auto_fills_only_where_the_runner_replays_full_graphs():
    uniform = UniformDrafts("auto", K)
    uniform.set_graph_requests(0)
    assert not uniform.wanted(1, 1, full_k(1))
    uniform.set_graph_requests(4)
    assert uniform.wanted(4, 4, full_k(4))
    assert not uniform.wanted(5, 5, full_k(5))  # no graph for 5 requests


def time_steps(uniform, requests, filled, seconds, count):
    for _ in range(count):
        tokens = requests * (1 + K) if filled else requests * 2
        assert uniform.timed(requests, tokens, seconds) is not filled


@pytest.mark.parametrize("uniform_faster", [True, False])
def test_auto_keeps_the_shape_measured_faster_and_probes_the_other(uniform_faster):
    uniform = UniformDrafts("auto", K)
    uniform.set_graph_requests(8)
    # uniform steps are timed first, then the others
    assert uniform.wanted(2, 2, full_k(2))
    time_steps(uniform, 2, True, 0.002 if uniform_faster else 0.004, MIN_TIMED)
    assert not uniform.wanted(2, 2, full_k(2))
    time_steps(uniform, 2, False, 0.003, MIN_TIMED)
    choices = [uniform.wanted(2, 2, full_k(2)) for _ in range(2 * PROBE_INTERVAL)]
    assert choices.count(not uniform_faster) == 2  # one probe each interval
    assert choices[PROBE_INTERVAL - 1] is not uniform_faster
    # another batch size has its own times
    assert uniform.wanted(3, 3, full_k(3))


def test_a_changed_machine_turns_filling_off():
    uniform = UniformDrafts("auto", K)
    uniform.set_graph_requests(1)
    time_steps(uniform, 1, True, 0.002, MIN_TIMED)
    time_steps(uniform, 1, False, 0.003, MIN_TIMED)
    assert uniform.wanted(1, 1, full_k(1))
    time_steps(uniform, 1, True, 0.006, 40)  # uniform steps got slower
    assert not uniform.wanted(1, 1, full_k(1))


def test_a_one_time_cost_in_the_first_filled_steps_does_not_decide():
    """H100, run (bp): one first filled step of about 0.4 s (numba compiling) among
    eleven made their mean 37 ms where the step took 3 ms, against 7.6 ms unfilled."""
    uniform = UniformDrafts("auto", K)
    uniform.set_graph_requests(1)
    time_steps(uniform, 1, True, 0.4, 1)
    time_steps(uniform, 1, True, 0.003, MIN_TIMED - 1)
    time_steps(uniform, 1, False, 0.0076, MIN_TIMED)
    assert uniform.wanted(1, 1, full_k(1))
    time_steps(uniform, 1, False, 0.5, 1)  # nor one slow step of the other shape
    assert uniform.wanted(1, 1, full_k(1))


def test_steps_without_full_graphs_all_reach_the_cost_fit():
    uniform = UniformDrafts("auto", K)
    uniform.set_graph_requests(0)
    assert uniform.timed(2, 2 * (1 + K), 0.01)
    uniform.set_graph_requests(2)
    assert uniform.timed(3, 3 * (1 + K), 0.01)  # larger than any graph
    assert uniform.timed(0, 1 + K, 0.01)  # request count not told


def test_fill_follows_the_pool_then_the_recycled_top_k_then_repeats():
    pool = NgramPool(3, 4, 16)
    pool.add(7, (8, 9))
    recycled = RecycledTopK(32, 2)
    recycled.update(np.array([9, 10]), np.array([[10, 1], [11, 2]]),
                    np.log(np.array([[0.1, 0.05], [0.01, 0.005]])))
    tokens = [5, 7]
    assert fill_draft(tokens, 4, 8, pool, 4, recycled) == 6
    assert tokens == [5, 7, 8, 9, 10, 11, 11, 11]  # recycled ignores draft_min_prob here
    empty = []
    assert fill_draft(empty, 3, 3, NgramPool(3, 4, 16), 4, None) == 3
    assert empty == [3, 3, 3]  # nothing known: the pending token repeated
    cycle = [1]
    pool.add(1, (1, 1))
    fill_draft(cycle, 0, 4, pool, 4, None)
    assert cycle == [1, 1, 1, 1]  # never past the length


def test_padding_is_its_own_source():
    draft = Draft([1, 2, 3, 4, 5, 6], matched=2, from_pool=2, padded=1)
    assert draft.tokens_by_source() == {"context": 2, "lattice": 0, "pool": 2,
                                        "recycled": 1, "padding": 1}
    assert draft.tokens_by_source(5)["padding"] == 0
    assert draft.tokens_by_source(6)["padding"] == 1


def graph_runner(max_requests, mixed_full=False):
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    full = {BatchDescriptor(num_tokens=n * (1 + K), num_reqs=n, uniform=True)
            for n in range(1, max_requests + 1)}
    if mixed_full:
        full.add(BatchDescriptor(num_tokens=8, num_reqs=8))
    return SimpleNamespace(cudagraph_dispatcher=SimpleNamespace(
        cudagraph_keys={CUDAGraphMode.FULL: full, CUDAGraphMode.PIECEWISE: set()}))


def test_uniform_graph_requests_read_from_the_dispatcher():
    assert uniform_graph_requests(SimpleNamespace()) == 0  # CPU runner: no dispatcher keys
    assert uniform_graph_requests(graph_runner(0)) == 0
    assert uniform_graph_requests(graph_runner(3)) == 3
    # every batch replays a full graph anyway: nothing to fill for
    assert uniform_graph_requests(graph_runner(3, mixed_full=True)) == 0


def test_proposer_fills_to_k_counts_padding_and_times_uniform_steps_apart():
    now = [0.0]
    proposer, runner = make_proposer(k=K, uniform_drafts="auto")
    runner.cudagraph_dispatcher = graph_runner(2).cudagraph_dispatcher
    proposer.clock = lambda: now[0]
    batch = Batch(runner, {"a": [1, 2, 3, 1, 2], "b": [9, 8]})
    drafts = batch.propose(proposer, [[2], [8]])
    assert list(map(len, drafts)) == [K, K]  # untimed yet: uniform steps first
    assert drafts[0][:2] == [3, 1]  # the context match comes first
    stats = proposer.stats
    assert stats.filled_steps == 1 and stats.padding_tokens > 0
    assert stats.draft_tokens == 2 * K
    # a uniform step (2 x (1 + K) tokens) is timed apart from the cost fit
    proposer.on_step_start(2 * (1 + K), decode_only=True, num_requests=2)
    now[0] += 0.01
    proposer.on_step_start(4, decode_only=True, num_requests=2)
    assert proposer._uniform._timed[2].tolist() == [0, 1]
    assert proposer.cost_model._count == 0
    now[0] += 0.02
    proposer.on_step_start(4, decode_only=True, num_requests=2)
    assert proposer.cost_model._count == 1


def test_a_filled_step_grows_no_trees():
    """Tree steps run eagerly; where filling was chosen, the full graph beat them."""
    from vllm import SamplingParams

    # nothing follows 9: the main draft is empty even at draft_min_prob 0, so the step
    # has room for a tree (the window's guesses) or for the filler
    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 9]
    nodes = {}
    for mode in ("on", "off"):
        proposer, runner = make_proposer(k=12, ngram_size=3, tree_candidates=2,
                                         tree_window=2, cost_aware_drafts=False,
                                         draft_min_prob=0.3, uniform_drafts=mode)
        batch = Batch(runner, {"a": context})
        runner.requests["a"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
        draft, = batch.propose(proposer, [[9]])
        nodes[mode] = proposer.stats.tree_nodes
        assert (proposer.stats.filled_steps, len(draft) == 12) == \
            ((1, True) if mode == "on" else (0, False))
    assert nodes["on"] == 0 and nodes["off"] > 0


def test_a_filled_step_after_a_tree_step_is_read_as_the_filled_draft():
    """A step's tree ends with it: the next step's filled draft is what its pass
    verifies, so its accepted tokens count by the filled draft's sources, none as tree
    nodes (an H200 run alternating the two counted half its accepted tokens)."""
    from vllm import SamplingParams

    context = [5, 1, 2, 5, 1, 3, 5, 1, 4, 9]
    proposer, runner = make_proposer(k=12, ngram_size=3, tree_candidates=2, tree_window=2,
                                     cost_aware_drafts=False, draft_min_prob=0.3,
                                     uniform_drafts="on")
    fill = [False]
    proposer._uniform.wanted = lambda *args: fill[0]
    batch = Batch(runner, {"a": context})
    runner.requests["a"] = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    batch.propose(proposer, [[9]])
    assert proposer.stats.tree_nodes > 0
    context += [7]  # no node accepted
    batch.set({"a": context})
    fill[0] = True
    draft, = batch.propose(proposer, [[7]])
    assert len(draft) == 12 and proposer.stats.filled_steps == 1
    emitted = [*draft[:2], 8]  # two accepted, a bonus token
    batch.set({"a": context + emitted})
    batch.propose(proposer, [emitted])
    counted = {source: getattr(proposer.stats, field)
               for source, field in ACCEPTED_SOURCES.items()}
    assert sum(counted.values()) == 2 and counted["tree"] == 0


@pytest.mark.parametrize("recycle_top_k", ["auto", 3])
def test_passes_verifying_filled_drafts_capture_no_top_k_for_auto_recycling(recycle_top_k):
    """Recycling ``auto`` serves trees: only a pass that verifies a tree captures the
    top-k (rescoring's stays), so a filled step, which grows none, skips it; an
    explicit ``recycle_top_k`` (a linear source) keeps it in every pass."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_lookahead.lookahead.options import RECYCLE_TOP_K_WITH_TREES

    proposer, runner = make_proposer(k=K, tree_candidates=2, uniform_drafts="on",
                                     rescoring_top_k=2, recycle_top_k=recycle_top_k)
    wanted = RECYCLE_TOP_K_WITH_TREES if recycle_top_k == "auto" else recycle_top_k
    paused = recycle_top_k == "auto"
    assert proposer.capture_last_top_k == (0 if paused else wanted)  # no tree verified yet
    greedy = SimpleNamespace(sampling_params=SamplingParams(temperature=0))
    batch = Batch(runner, {"a": [1, 2, 3, 1, 2]})
    runner.requests["a"] = greedy
    assert len(batch.propose(proposer, [[2]])[0]) == K and proposer.stats.filled_steps == 1
    assert proposer.capture_last_top_k == (0 if paused else wanted)
    assert proposer.capture_top_k == (2 if paused else wanted)
    # a prompt chunk joins: the step cannot be uniform, drafts are not filled: a tree
    batch.set({"a": [1, 2, 3, 1, 2, 3], "b": [7, 8]})
    runner.requests["a"] = greedy
    draft, _ = batch.propose(proposer, [[3], []])
    assert proposer.stats.filled_steps == 1
    assert proposer.draft_tree("a", draft) is not None
    assert proposer.capture_last_top_k == proposer.capture_top_k == wanted


def test_proposer_without_graphs_drafts_as_before():
    drafts = []
    for mode in ("auto", "off"):  # auto on a runner without graphs (CPU)
        proposer, runner = make_proposer(k=K + 4, uniform_drafts=mode)
        drafts.append(Batch(runner, {"a": [1, 2, 3, 1, 2]}).propose(proposer, [[2]]))
        assert proposer.stats.filled_steps == proposer.stats.padding_tokens == 0
    assert drafts[0] == drafts[1]


@pytest.mark.parametrize("mode_name,graph_requests", [
    ("FULL_AND_PIECEWISE", 8), ("FULL_DECODE_ONLY", 8), ("PIECEWISE", 0), ("FULL", 0)])
def test_filled_steps_replay_the_full_graph_vllm_captured(mode_name, graph_requests):
    """Through vLLM's own dispatcher and batch planner (``test_tree_graph_mode``): where
    only uniform decode steps replay a full graph, lookahead's filled drafts make the
    step uniform, and its unfilled drafts would have run it piecewise."""
    from test_tree_graph_mode import runner_with_graphs

    from vllm.config import CUDAGraphMode

    graphs = runner_with_graphs(CUDAGraphMode[mode_name])
    assert uniform_graph_requests(graphs) == graph_requests
    contexts = {"a": [1, 2, 3, 4, 5, 6, 1, 2], "b": [7, 8, 9, 10]}  # b: nothing to draft
    picked = {}
    for fill in ("auto", "off"):
        proposer, runner = make_proposer(k=K, uniform_drafts=fill)
        runner.cudagraph_dispatcher = graphs.cudagraph_dispatcher
        drafts = Batch(runner, contexts).propose(proposer, [[2], [10]])
        scheduled = np.array([1 + len(draft) for draft in drafts])
        picked[fill] = graphs._determine_batch_execution_and_padding(
            num_tokens=int(scheduled.sum()), num_reqs=2, num_scheduled_tokens_np=scheduled,
            max_num_scheduled_tokens=int(scheduled.max()), use_cascade_attn=False)[0]
    if graph_requests:
        assert picked == {"auto": CUDAGraphMode.FULL,
                          "off": CUDAGraphMode[mode_name].mixed_mode()}
    else:
        assert picked["auto"] == picked["off"]  # nothing to fill for
