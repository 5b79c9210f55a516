"""What the proposer reads from a verification pass, without an engine: the Jacobi harvest,
rescoring's lattice and the recycled top-k table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from proposers import Batch, capture, make_proposer, top_k

from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.sources.rescoring import rescored
from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.worker.sampler import (
    _observe_last_positions,
    capture_verification,
    row_argmax,
)

def test_jacobi_harvest_reads_predictions_after_the_first_rejection():
    proposer, runner = make_proposer(k=4, ngram_size=3, suffix_match_min=2)
    context = [40, 41, 42, 43, 44, 30, 40, 41]
    batch = Batch(runner, {"a": context})
    draft = batch.propose(proposer, [[41]])[0]
    assert draft == [42, 43, 44, 30]
    # Target: accepts 42, predicts 50 instead of 43, then (conditioned on the
    # rejected draft) 51 after 43, 52 after 44, bonus 53 after 30.
    proposer.on_verification(capture([draft], [[42, 50, 51, 52]], [53]))
    batch.set({"a": context + [42, 50]})
    batch.propose(proposer, [[42, 50]])
    pool = proposer.states.get("a").pool
    assert pool.best(43, 8)[0] == (51, 52)  # Jacobi n-grams past the rejection
    assert pool.best(44, 8)[0] == (52, 53)
    assert proposer.stats.harvested_ngrams == 3  # keys 42, 43, 44; the key-41 window is output


def test_harvest_ignores_dummy_runs_and_foreign_drafts():
    proposer, runner = make_proposer(k=2, ngram_size=2)
    batch = Batch(runner, {"a": [7, 8, 7]})
    assert batch.propose(proposer, [[7]]) == [[8, 7]]
    # vLLM's warm-up dummy sampler run: a different number of rows
    proposer.on_verification(capture([[0], [0]], [[1], [1]], [1, 1]))
    batch.set({"a": [7, 8, 7, 8]})
    batch.propose(proposer, [[8]])
    assert proposer.stats.harvested_ngrams == 0
    # a capture whose drafts are not the ones proposed for this request
    proposer.on_verification(capture([[99, 98]], [[97, 96]], [95]))
    batch.set({"a": [7, 8, 7, 8, 7]})
    batch.propose(proposer, [[7]])
    assert proposer.stats.harvested_ngrams == 0


@pytest.mark.parametrize("rescoring_top_k", [0, 2])
def test_rescoring_drafts_the_lattice_path_after_a_rejection(rescoring_top_k):
    proposer, runner = make_proposer(k=4, ngram_size=3, rescoring_top_k=rescoring_top_k)
    context = [40, 41, 42, 43, 44, 30, 40, 41]
    batch = Batch(runner, {"a": context})
    draft = batch.propose(proposer, [[41]])[0]
    assert draft == [42, 43, 44, 30]
    # accepts 42, corrects 43 to 50; past the rejection the target's top-2 are
    # (60, 61) after 43 and (62, 63) after 44: the lattice for the tokens after 50
    top_ids = [[42, 1], [50, 2], [60, 61], [62, 63]]
    logprobs = [[-0.1, -3.0]] * 4
    proposer.on_verification(capture([draft], [[42, 50, 60, 62]], [64], top_ids, logprobs))
    batch.set({"a": context + [42, 50]})
    # nothing in the context or the pool follows 50
    expected = [60, 62] if rescoring_top_k else []
    assert batch.propose(proposer, [[42, 50]]) == [expected]
    assert proposer.stats.lattice_tokens == len(expected)


def test_rescoring_ranks_pool_entries_by_frequency_and_lattice_probability():
    proposer, _ = make_proposer(k=4, ngram_size=3, rescoring_top_k=2)
    state = RequestState(NgramPool(3, 8, 100), prompt_len=0, next_ngram_start=0)
    for continuation in [(1, 2), (1, 2), (3, 4)]:
        state.pool.add(9, continuation)
    # the lattice is nearly sure of 3 then 4: that beats (1, 2)'s higher count
    state.lattice = [[3, 7], [4, 8]], [[-0.05, -4.0], [-0.05, -4.0]]
    opts = proposer.options
    (best, share, _), from_lattice = rescored(state.pool, state.lattice, 9, opts.guess_set_size,
                                           opts.ngram_size)
    assert best == (3, 4) and not from_lattice  # the lattice's path is a pool entry
    assert 0.5 < share < 1.0
    # an undecided lattice leaves the pool's frequencies in charge
    state.lattice = [[3, 1], [4, 2]], [[-0.69, -0.70], [-0.69, -0.70]]
    assert rescored(state.pool, state.lattice, 9, opts.guess_set_size,
                    opts.ngram_size)[0][0] == (1, 2)


def test_recycled_table_chains_the_targets_most_likely_next_tokens():
    table = RecycledTopK(vocab_size=16, top_k=2)
    ids, logprobs = top_k([[4, 9], [5, 9], [3, 9], [1, 2]],
                          [[.9, .1], [.8, .1], [.5, .4], [.9, .1]])
    table.update(np.array([3, 4, 5, 99]), ids.numpy(), logprobs.numpy())  # 99: not a token
    tokens, prob = table.chain(3, 10, 1.0, 0.3)
    assert tokens == [4, 5, 3, 4] and prob == pytest.approx(.9 * .8 * .5 * .9)
    assert table.chain(3, 2, 1.0, 0.0)[0] == [4, 5]  # the limit
    assert table.chain(7, 4, 1.0, 0.0)[0] == []  # never seen
    table.update(np.array([4]), *(t.numpy() for t in top_k([[6, 5]], [[.7, .2]])))
    assert table.chain(3, 3, 1.0, 0.0)[0] == [4, 6]  # the latest prediction wins


def test_every_input_position_of_a_pass_is_recycled():
    proposer, runner = make_proposer(k=4, ngram_size=3, suffix_match_min=2, recycle_top_k=2)
    context = [40, 41, 42, 43, 44, 30, 40, 41]
    batch = Batch(runner, {"a": context, "b": [5, 6], "c": [1, 2]})
    drafts = batch.propose(proposer, [[41], [6], []])  # c: a partial prefill chunk
    assert drafts == [[42, 43, 44, 30], [], []]
    # the pass: after 41 (the root) the target predicts 42, after 42 50, ... after the
    # last draft token 30, 53 (its last position); b's last position (root 6) says 7
    top_ids = [[42, 1], [50, 1], [51, 1], [52, 1]]
    proposer.on_verification(capture([drafts[0], [], []], [[42, 50, 51, 52]], [53, 7, 9],
                                     top_ids, np.log([[.6, .1]] * 4).tolist()))
    proposer.on_last_top_k(*top_k([[53, 1], [7, 1], [9, 1]], [[.6, .1]] * 3))
    batch.set({"a": context + [42, 50], "b": [5, 6, 7], "c": [1, 2]})
    batch.propose(proposer, [[42, 50], [7], []])
    assert proposer.stats.recycled_rows == 6
    next_tokens, _ = proposer._sources.recycled.storage
    assert next_tokens[[41, 42, 43, 44, 30, 6], 0].tolist() == [42, 50, 51, 52, 53, 7]
    assert next_tokens[2, 0] == -1  # c's position: mid-prompt, no token emitted


@pytest.mark.parametrize("min_prob, expected", [(0.1, [4, 5, 3, 4]), (0.5, [4, 5])])
def test_recycled_top_k_continues_drafts_nothing_else_continues(min_prob, expected):
    proposer, runner = make_proposer(k=4, guess_set_size=0, suffix_match_min=3,
                                     recycle_top_k=2, draft_min_prob=min_prob)
    context = [1, 2, 3]
    batch = Batch(runner, {"a": context})
    assert batch.propose(proposer, [[3]]) == [[]]
    # plain decoding passes: after 3 the target's top token is 4 (p .9), after 4 5, after 5 3
    for successor, prob in [(4, .9), (5, .8), (3, .5)]:
        proposer.on_last_top_k(*top_k([[successor, 0]], [[prob, .01]]))
        context = context + [successor]
        batch.set({"a": context})
        draft = batch.propose(proposer, [[successor]])
    assert draft == [expected]
    assert proposer.stats.recycled_tokens == len(expected)


def test_last_position_top_k_is_taken_before_the_sampler_changes_the_logits():
    class Drafter:
        capture_last_top_k = 2

        def on_last_top_k(self, top_ids, top_logprobs):
            self.seen = top_ids.tolist(), top_logprobs

    class Sampler:
        def forward(self, logits, sampling_metadata):
            logits[:, 0] = 100.0  # vLLM processes logits in place (temperature, penalties)
            return "sampled"

    sampler, drafter = Sampler(), Drafter()
    _observe_last_positions(sampler, drafter)
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    assert sampler.forward(logits=logits, sampling_metadata=None) == "sampled"
    expected_logprobs, expected_ids = torch.log_softmax(
        torch.tensor([[0.0, 2.0, 1.0, -1.0]]), -1).topk(2, -1)
    assert drafter.seen[0] == expected_ids.tolist() == [[1, 2]]
    assert torch.allclose(drafter.seen[1], expected_logprobs)


def test_the_captured_argmax_is_torchs_first_largest_value():
    """Tree rows emit the capture's argmax: on the CPU it is numpy's, which must pick
    what torch's does, ties (the first), infinities and NaN (the first NaN) included."""
    rows = torch.randn(6, 4099, generator=torch.Generator().manual_seed(0))
    rows[0, [7, 900, 4000]] = 50.0  # a tie: the first
    rows[1] = -torch.inf
    rows[2, [3, 11]] = torch.nan
    rows[3, [5, 6]] = torch.tensor([0.0, -0.0]) + 99.0
    rows[4, 4098] = torch.inf
    for logits in (rows, rows[::2], rows[:, :4000], rows[:0]):
        captured = capture_verification(torch.zeros(len(logits), dtype=torch.long),
                                        [len(logits)], logits, torch.tensor([[0]]))
        assert captured.target_argmax.dtype == torch.int64
        assert captured.target_argmax.tolist() == logits.argmax(-1).tolist()
    assert row_argmax(rows.half()).tolist() == rows.half().argmax(-1).tolist()


def test_capture_top_k_log_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    result = capture_verification(torch.tensor([1, 0]), [2], logits, torch.tensor([[2]]),
                                  top_k=2)
    expected_logprobs, expected_ids = torch.log_softmax(logits, -1).topk(2, -1)
    assert result.target_top_ids.tolist() == expected_ids.tolist() == [[1, 2], [0, 3]]
    assert torch.allclose(result.target_top_logprobs, expected_logprobs)
    assert capture_verification(torch.tensor([1, 0]), [2], logits,
                                torch.tensor([[2]])).target_top_ids is None
