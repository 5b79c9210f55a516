"""The proposer without an engine: drafts, bounds, the cut under load, the request
lifecycle and what is compiled at start-up."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import fake_vllm_config
from proposers import MAX_LEN, Batch, make_proposer

from vllm_lookahead.lookahead.proposer import LookaheadProposer
from vllm_lookahead.lookahead.sources.drafts import TokenAcceptance
from vllm_lookahead.lookahead.state import DRAFT_LIMIT_MARGIN
from vllm_lookahead.lookahead.step_cost import MIN_SAMPLES
from vllm_lookahead.worker.start_cost import StartCost
from vllm_lookahead.worker.runner import is_decode_only

COMPILED_AT_START_UP = """
import sys
import numpy as np
from numba.core.registry import CPUDispatcher
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.drafts import DraftSources

def compiled():
    return {module + "." + name: len(value.signatures)
            for module in list(sys.modules) if module.startswith("vllm_lookahead")
            for name, value in vars(sys.modules[module]).items()
            if isinstance(value, CPUDispatcher)}

sources = DraftSources(LookaheadOptions(corpus_tokens=12, live_corpus_tokens=16), 4, 2, 16, 2)
at_start_up = compiled()
for first in range(10, 60, 10):  # the corpus also drops its oldest responses
    sources.corpus.add([first, first + 1, first + 2, first + 3])
sources.corpus.match([50, 51], 2, 4, 4, 0.1)
sources.live.extend("a", [1, 2, 3])
sources.live.match("b", [1, 2], 2, 4, 4, 0.1)
sources.recycled.update(np.array([1, 2]), np.array([[2, 3], [3, 4]]),
                        np.zeros((2, 2), np.float32))
sources.recycled.chain(1, 4, float(np.float64(0.5)), 0.1)
from vllm_lookahead.lookahead.sources.pool import NgramPool
pool = NgramPool(3, 4, 8)
pool.add_ngrams([1, 2, 3, 1, 2], 3)
pool.best(1, 2)
print({name: (at_start_up.get(name), count) for name, count in compiled().items()
       if at_start_up.get(name) != count})
"""


def test_every_compiled_path_of_a_step_is_compiled_at_start_up():
    """Nothing a step calls compiles mid-serving (an omitted default argument, another
    argument type, a function first called from Python): on a fresh install that was
    0.2 s of one request's latency (the corpus's append at the first finished request,
    the recycled chain and the pool's support bin at their first draft)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", COMPILED_AT_START_UP],
                            capture_output=True, text=True, timeout=600, check=True)
    assert result.stdout.strip().splitlines()[-1] == "{}", result.stdout


def test_corpus_drafts_are_as_long_as_their_measured_acceptance_affords():
    acceptance = TokenAcceptance()
    assert acceptance.tokens_above(0.1) == 8  # the prior, 3/4 per token: 0.75^8 >= 0.1
    for _ in range(30):  # one of two reached corpus tokens accepted
        acceptance.add(reached=2, accepted=1)
    assert 0.5 < acceptance.rate < 0.55 and acceptance.tokens_above(0.1) == 3
    for _ in range(200):
        acceptance.add(reached=10, accepted=10)
    assert acceptance.tokens_above(0.1) > 24


def test_rejected_corpus_drafts_shorten_the_next_ones():
    proposer, runner = make_proposer(k=12, ngram_size=2, guess_set_size=0,
                                     cost_aware_drafts=False, adaptive_draft_length=False)
    batch = Batch(runner, {"a": [1, 2, 3] + list(range(40, 60))}, {0: 3})
    batch.propose(proposer, [[59]])
    proposer.on_requests_removed({"a"}, set())
    drafts = []
    for i in range(8):  # requests the corpus drafts for; the target rejects its 2nd token
        request, context = f"c{i}", [1 + i, 40, 41]
        batch.set({request: context}, {0: 2})
        drafts.append(batch.propose(proposer, [[41]])[0])
        batch.set({request: context + [42, 7]}, {0: 2})
        batch.propose(proposer, [[42, 7]])
        proposer.on_requests_removed(set(), {request})  # preempted: not in the corpus
    assert drafts[0] == list(range(42, 50))  # 8 tokens at the prior
    assert drafts[-1] == [42, 43, 44]


@pytest.mark.parametrize("measured", [
    StartCost(0.030, 0.001),
    StartCost(0.030, 0.001, sizes=(1, 5, 33), size_seconds=(0.030, 0.031, 0.062)),
    StartCost(math.nan, math.nan, "too few free blocks")])
def test_the_start_up_measurement_sets_the_cut_until_steps_are_timed(measured):
    proposer, _ = make_proposer(trees="auto", tree_candidates=4)
    assert proposer._planner.step_plan(False, 1) == (None, None, False, False, False)  # no cut
    proposer.on_start_cost(measured)
    assert proposer.trees_on  # the measurement no longer decides trees (tree_choice does)
    free_tokens, step_cost, _, _, _ = proposer._planner.step_plan(False, 1)
    if measured.reason:
        assert free_tokens is None and step_cost is None
        return
    assert free_tokens == pytest.approx(29.0)
    line = [0.030 + 0.001 * (n - 1) for n in (1, 5, 33)]
    sized = measured.size_seconds or line
    assert step_cost(np.array([1, 5, 33])) == pytest.approx(sized)


def test_draft_prefers_context_match():
    proposer, runner = make_proposer(k=4, ngram_size=3)
    # the suffix "7 8 9" occurred before, followed by "10 11 20 7"
    batch = Batch(runner, {"a": [11, 12, 13, 7, 8, 9, 10, 11, 20, 7, 8, 9]})
    assert batch.propose(proposer, [[9]]) == [[10, 11, 20, 7]]


def test_short_context_match_is_filled_by_chained_pool_lookups():
    proposer, runner = make_proposer(k=6, ngram_size=3)
    # "20 21" matches at the start, leaving 4 tokens; the pool continues 21 -> (22, 9)
    batch = Batch(runner, {"a": [20, 21, 22, 9, 20, 21]})
    assert batch.propose(proposer, [[21]]) == [[22, 9, 20, 21, 22, 9]]
    assert proposer.stats.suffix_tokens == 4 and proposer.stats.pool_tokens == 2


def test_accepted_tokens_are_counted_by_the_source_that_drafted_them():
    proposer, runner = make_proposer(k=6, ngram_size=3, cost_aware_drafts=False)
    context = [20, 21, 22, 9, 20, 21]
    batch = Batch(runner, {"a": context})
    assert batch.propose(proposer, [[21]]) == [[22, 9, 20, 21, 22, 9]]  # 4 context, 2 pool
    emitted = [22, 9, 20, 21, 22, 5]  # five accepted (the first pool token), a bonus token
    batch.set({"a": context + emitted})
    batch.propose(proposer, [emitted])
    stats = proposer.stats
    assert (stats.accepted_context_tokens, stats.accepted_pool_tokens) == (4, 1)
    assert stats.accepted_corpus_tokens == stats.accepted_lattice_tokens == 0


def test_empty_draft_when_nothing_matches():
    proposer, runner = make_proposer(k=4)
    batch = Batch(runner, {"a": [1, 2, 3, 4]})
    assert batch.propose(proposer, [[4]]) == [[]]


def test_draft_stops_where_its_probability_estimate_falls_below_draft_min_prob():
    # no suffix repeat; the pool saw key 5 followed by (6, 7) and by (8, 9): share 1/2 each
    context = [5, 6, 7, 1, 5, 8, 9, 2, 5]
    for min_prob, expected in [(0.0, [8, 9, 2, 5]), (0.4, [8, 9, 2, 5]), (0.6, [])]:
        proposer, runner = make_proposer(k=4, ngram_size=3, draft_min_prob=min_prob)
        assert Batch(runner, {"a": context}).propose(proposer, [[5]]) == [expected], min_prob


@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_length_follows_recent_acceptance(adaptive):
    proposer, runner = make_proposer(k=8, adaptive_draft_length=adaptive)
    context = [1, 2, 3] * 4
    batch = Batch(runner, {"a": context})
    lengths = [len(batch.propose(proposer, [[3]])[0])]
    for sampled in ([1, 2, 3], [1, 2, 3, 1, 2, 3]):  # 2 of 8 accepted, then 5 of 5
        context = context + sampled
        batch.set({"a": context})
        lengths.append(len(batch.propose(proposer, [sampled])[0]))
    assert lengths == ([8, 2 + DRAFT_LIMIT_MARGIN, 8] if adaptive else [8, 8, 8])


def test_per_request_overrides_bound_the_draft():
    proposer, runner = make_proposer(k=8)
    periodic = [1, 2, 3] * 10
    batch = Batch(runner, {"off": periodic, "short": periodic, "bad": periodic, "plain": periodic})
    for req_id, extra in [("off", {"lookahead_num_speculative_tokens": 0}),
                          ("short", {"lookahead_num_speculative_tokens": 2}),
                          ("bad", {"lookahead_num_speculative_tokens": 9})]:  # > K: ignored
        runner.requests[req_id] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))
    drafts = batch.propose(proposer, [[3]] * 4)
    assert list(map(len, drafts)) == [0, 2, 8, 8]


def test_drafts_never_exceed_k_or_max_model_len():
    proposer, runner = make_proposer(k=4)
    periodic = [1, 2, 3] * 25
    batch = Batch(runner, {"a": periodic[:30], "b": periodic[: MAX_LEN - 3]})
    drafts = batch.propose(proposer, [[3], [3]])
    assert len(drafts[0]) == 4
    assert len(drafts[1]) == 2  # MAX_LEN - num_tokens - 1


def test_partial_prefill_rows_get_no_draft():
    proposer, runner = make_proposer()
    batch = Batch(runner, {"a": [1, 2, 1, 2, 1, 2], "b": [1, 2, 1, 2, 1, 2]})
    drafts = batch.propose(proposer, [[], [2]])
    assert drafts[0] == [] and drafts[1]


def test_state_freed_on_finish_or_preemption_and_rebuilt_on_resume():
    proposer, runner = make_proposer(ngram_size=2)
    batch = Batch(runner, {"a": [5, 6, 5, 6, 5], "b": [1, 2, 3], "c": [7, 8]})
    batch.propose(proposer, [[5], [3], [8]])
    assert set(proposer.states) == {"a", "b", "c"}
    proposer.on_requests_removed(set(), {"a"})  # preempted: the runner keeps its state
    batch.set({"b": [1, 2, 3, 4]})  # c is only unscheduled this step: its state stays
    batch.propose(proposer, [[4]])
    assert set(proposer.states) == {"b", "c"}
    batch.set({"b": [1, 2, 3, 4, 1], "a": [5, 6, 5, 6, 5, 6]})  # a resumed
    drafts = batch.propose(proposer, [[1], [6]])
    assert drafts[1][:2] == [5, 6]
    del runner.requests["c"]  # finished while unscheduled: the safety net frees it
    batch.propose(proposer, [[1], [6]])
    assert set(proposer.states) == {"a", "b"}
    assert proposer.stats.active_requests == 2


def test_pool_from_prompt_off_ignores_prompt_ngrams():
    prompt = [3, 4, 5, 9, 9, 3]
    on, runner_on = make_proposer(k=3, ngram_size=3, suffix_match_min=3)
    off, runner_off = make_proposer(k=3, ngram_size=3, suffix_match_min=3,
                                    pool_from_prompt=False)
    assert Batch(runner_on, {"a": prompt}, {0: 6}).propose(on, [[3]]) == [[4, 5, 9]]
    assert Batch(runner_off, {"a": prompt}, {0: 6}).propose(off, [[3]]) == [[]]


@pytest.mark.parametrize("cost_aware", [True, False])
def test_expensive_tokens_cut_drafts_under_load(cost_aware):
    now = [0.0]  # the proposer's clock, moved by the test
    proposer, runner = make_proposer(k=4, cost_aware_drafts=cost_aware,
                                     adaptive_draft_length=False)
    proposer.clock = lambda: now[0]
    periodic = [1, 2, 3] * 6
    batch = Batch(runner, {str(i): periodic for i in range(8)})
    assert list(map(len, batch.propose(proposer, [[3]] * 8))) == [4] * 8
    # steps timed at 10 ms per token and no fixed cost: a draft token pays only if
    # accepted at least as often as a step yields tokens per token computed (1 here)
    for n in range(2 * MIN_SAMPLES):
        proposer.on_step_start(8 + n, decode_only=True)
        now[0] += 0.01 * (8 + n)
        batch.propose(proposer, [[3]] * 8)
        if n % 4 == 0:  # a prefill step, and the decode step before it: not timed
            proposer.on_step_start(500, decode_only=False)
            now[0] += 0.5
            batch.propose(proposer, [[3]] * 8)
    proposer.on_step_start(8, decode_only=True)
    lengths = list(map(len, batch.propose(proposer, [[3]] * 8)))
    assert lengths == ([0] * 8 if cost_aware else [4] * 8)
    # no token pays here even if certain: those steps are not drafted at all
    assert (proposer.stats.undrafted_steps > 0) == cost_aware


def test_unbound_runner_fails_at_load_model():
    config = fake_vllm_config(2, MAX_LEN)
    with pytest.raises(RuntimeError, match="not bound"):
        LookaheadProposer(config).load_model(None)


def test_decode_only_steps_are_told_apart_from_prefill_steps():
    def step(scheduled, drafts):
        return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts)

    assert is_decode_only(step({"a": 1, "b": 4}, {"b": [7, 8, 9]}))
    assert not is_decode_only(step({"a": 1, "b": 64}, {}))  # b's prompt chunk
