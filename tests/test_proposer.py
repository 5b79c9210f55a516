"""Proposer and pool logic without an engine: drafts, bounds, harvest, request lifecycle."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import fake_vllm_config

from vllm_lookahead.lookahead.options import LookaheadOptions, request_overrides
from vllm_lookahead.lookahead.proposer import LookaheadProposer
from vllm_lookahead.lookahead.sources.context import suffix_match
from vllm_lookahead.lookahead.sources.corpus import LiveResponses, ResponseCorpus
from vllm_lookahead.lookahead.sources.draft import TOKEN_SOURCES, Draft
from vllm_lookahead.lookahead.sources.drafts import TokenAcceptance
from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.sources.rescoring import rescored
from vllm_lookahead.lookahead.sources.support import (
    COPIED,
    LONG_MATCH,
    MAJORITY,
    MINORITY,
    SEEN_ONCE,
    SUPPORT_BINS,
    UNANIMOUS,
    support_bin,
)
from vllm_lookahead.lookahead.state import DRAFT_LIMIT_MARGIN, RequestState
from vllm_lookahead.lookahead.step_cost import MIN_SAMPLES
from vllm_lookahead.metrics import ACCEPTED_SOURCES
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.worker.start_cost import StartCost
from vllm_lookahead.worker.runner import is_decode_only
from vllm_lookahead.worker.sampler import _observe_last_positions, capture_verification
from vllm_lookahead.tree import path_by_tokens
from vllm_lookahead.worker.hooks import VerificationCapture

MAX_LEN = 64


def make_proposer(k=4, max_model_len=MAX_LEN, **options):
    """A bound proposer; linear unless the test names tree options (no worker here to
    decide trees ``auto``)."""
    tree_options = {"tree_candidates", "tree_window"} & set(options)
    options.setdefault("trees", "on" if tree_options else "off")
    config = fake_vllm_config(
        k, max_model_len, {ADDITIONAL_CONFIG_KEY: {"method": "lookahead", **options}})
    proposer = LookaheadProposer(config)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(8, np.int32)),
        requests={},
        model=torch.nn.Sequential(),  # no attention layer: tree drafts are not refused
    )
    proposer.bind_model_runner(runner)
    proposer.load_model(None)
    return proposer, runner


class Batch:
    """The runner's token buffer, as vLLM hands it to ``propose``."""

    def __init__(self, runner, contexts: dict[str, list[int]], prompt_lens=None):
        self.runner = runner
        self.tokens = np.zeros((8, MAX_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(8, dtype=np.int32)
        self.set(contexts, prompt_lens)

    def set(self, contexts, prompt_lens=None):
        self.runner.input_batch.req_ids = list(contexts)
        self.runner.requests.update(dict.fromkeys(contexts))
        for row, context in enumerate(contexts.values()):
            self.tokens[row, : len(context)] = context
            self.num_tokens[row] = len(context)
            self.runner.input_batch.num_prompt_tokens[row] = (prompt_lens or {}).get(row, 1)

    def propose(self, proposer, sampled):
        return proposer.propose(sampled, self.num_tokens, self.tokens)


def referencesuffix_match(tokens, min_n, max_n, max_out, min_prob):
    """Longest suffix (min_n..max_n); follow its occurrences' most frequent continuation
    (ties: most recent) while the product of the frequencies stays >= min_prob."""
    n = len(tokens)
    for length in range(max_n, min_n - 1, -1):
        suffix = tokens[n - length :]
        ends = [e for e in range(n - 2, length - 2, -1) if tokens[e - length + 1 : e + 1] == suffix]
        if length < n and ends:
            break
    else:
        return []
    draft, prob = [], 1.0
    while len(draft) < max_out:
        ends = [e for e in ends if e + 1 + len(draft) < n]
        if not ends:
            break
        nexts = [tokens[e + 1 + len(draft)] for e in ends]
        token = max(nexts, key=lambda t: (nexts.count(t), -nexts.index(t)))
        if prob * nexts.count(token) / len(nexts) < min_prob:
            break
        prob *= nexts.count(token) / len(nexts)
        ends = [e for e in ends if tokens[e + 1 + len(draft)] == token]
        draft.append(token)
    return draft


@pytest.mark.parametrize("min_prob", [0.0, 0.3, 0.6])
def test_suffix_match_agrees_with_reference(min_prob):
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 40)
        tokens = [rng.randint(0, 4) for _ in range(n)]
        out, bins = np.zeros(5, dtype=np.int32), np.zeros(5, dtype=np.int8)
        count, _, _ = suffix_match(np.array(tokens, np.int32), n, 2, 4, 5, min_prob, out,
                                   bins)
        assert out[:count].tolist() == referencesuffix_match(tokens, 2, 4, 5, min_prob), tokens


def test_suffix_match_follows_the_most_frequent_continuation():
    # "1 2 3" occurred three times: followed by 9, 7, 7 (most recent last)
    tokens = np.array([1, 2, 3, 9, 5, 1, 2, 3, 7, 6, 1, 2, 3, 7, 8, 1, 2, 3], np.int32)
    out, bins = np.zeros(6, dtype=np.int32), np.zeros(6, dtype=np.int8)
    assert suffix_match(tokens, len(tokens), 2, 4, 6, 0.0, out, bins)[:2] == (5, 3)
    assert out[:5].tolist() == [7, 8, 1, 2, 3]  # 7 (2 of 3), then 8 (tie: most recent)
    # 7: 2 of 3 occurrences; 8: 1 of the 2 left (a tie); then the one occurrence left
    assert bins[:5].tolist() == [MAJORITY, MINORITY, SEEN_ONCE, SEEN_ONCE, SEEN_ONCE]
    count, _, prob = suffix_match(tokens, len(tokens), 2, 4, 6, 0.5, out, bins)
    assert (count, prob) == (1, pytest.approx(2 / 3))  # 2/3 * 1/2 < 0.5 stops after 7


def test_a_single_occurrence_of_a_long_match_is_a_copy():
    tokens = np.array([*range(10, 22), 5, *range(10, 16)], np.int32)
    out, bins = np.zeros(6, dtype=np.int32), np.zeros(6, dtype=np.int8)
    count, length, _ = suffix_match(tokens, len(tokens), 2, 16, 6, 0.0, out, bins)
    assert (count, length) == (6, 6) and out.tolist() == [16, 17, 18, 19, 20, 21]
    # the match and the draft before each token: 6, 7 tokens, then LONG_MATCH and more
    assert bins.tolist() == [SEEN_ONCE, SEEN_ONCE] + [COPIED] * 4


def test_pool_lru_bounds_and_ranking():
    pool = NgramPool(ngram_size=3, max_per_key=2, max_keys=2)
    pool.add(1, (2, 3))
    pool.add(1, (4, 5))
    pool.add(1, (4, 5))
    assert pool.best(1, guess_set_size=2) == ((4, 5), 2 / 3, MAJORITY)  # its share, support
    pool.add(1, (6, 7))  # evicts (2, 3), the least recently used
    assert pool.num_entries == 2
    assert pool.best(1, guess_set_size=1) == ((6, 7), 1.0, SEEN_ONCE)  # only the newest
    pool.add(2, (1, 1))
    pool.add(3, (1, 1))  # third key: evicts key 1, the least recently used
    assert pool.best(1, 2) is None and pool.num_entries == 2
    assert pool.best(2, 0) is None  # G = 0 disables pool drafts


def test_corpus_finds_the_longest_most_recent_repeat():
    corpus = ResponseCorpus(capacity=100)
    corpus.add([1, 2, 3, 10, 11])
    corpus.add([9, 2, 3, 20, 21, 22])
    corpus.add([5, 6])
    assert corpus.match([7, 2, 3], 2, 4, 5)[:2] == (2, [20, 21, 22])  # most recent of the ties
    assert corpus.match([1, 2, 3], 2, 4, 5)[:2] == (3, [10, 11])  # longer beats more recent
    assert corpus.match([22, 5, 6], 2, 4, 5)[:2] == (2, [])  # nothing after it: no crossing
    assert corpus.match([3, 4], 2, 4, 5)[:2] == (0, [])
    corpus.add([8, 2, 3, 10, 12])  # now 10 follows "2 3" twice, 20 once
    assert corpus.match([7, 2, 3], 2, 4, 5)[:2] == (2, [10, 12])  # most frequent, then recent
    assert corpus.match([7, 2, 3], 2, 4, 5, min_prob=0.5)[:2] == (2, [10])  # 2/3, then 1/2
    assert corpus.match([7, 2, 3], 2, 4, 5, min_prob=0.7)[:2] == (2, [])  # 2 of 3: below
    assert corpus.match([7, 2, 3], 2, 4, 5)[2] == [MAJORITY, MINORITY]  # 2 of 3, 1 of 2
    corpus.add([8, 2, 3, 10, 12])
    assert corpus.match([7, 2, 3], 2, 4, 5) == (2, [10, 12], [MAJORITY, MAJORITY])  # 3/4, 2/3
    assert corpus.match([1, 2, 3], 2, 4, 5) == (3, [10, 11], [SEEN_ONCE, SEEN_ONCE])


#: Run in a fresh interpreter: the draft sources' start-up, then every compiled path a
#: step takes, with the argument types the proposer passes.
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


def test_corpus_keeps_the_newest_responses_within_capacity():
    corpus = ResponseCorpus(capacity=12)
    for first in range(10, 60, 10):
        corpus.add([first, first + 1, first + 2, first + 3])
    assert len(corpus) <= 12
    assert corpus.match([50, 51], 2, 4, 5)[:2] == (2, [52, 53])
    assert corpus.match([10, 11], 2, 4, 5)[:2] == (0, [])


def test_corpus_matches_a_brute_force_search_and_keeps_fixed_memory():
    """Hash chains find what scanning the kept tokens finds (the 16 most recent
    occurrences of the last bigram), through many drops of the oldest half."""
    rng = random.Random(7)
    corpus = ResponseCorpus(capacity=500)
    arrays = corpus.storage
    for _ in range(400):
        corpus.add([rng.randrange(6) for _ in range(rng.randint(1, 30))])
        suffix = [rng.randrange(6) for _ in range(rng.randint(2, 8))]
        assert corpus.match(suffix, 2, 6, 4)[:2] == brute_force_match(
            corpus.storage[0][: len(corpus)].tolist(), suffix, 6, 4)
    assert len(corpus) <= 500
    assert all(a is b for a, b in zip(arrays, corpus.storage))
    assert sum(a.nbytes for a in arrays) == ResponseCorpus.bytes_for(500)


def brute_force_match(tokens, suffix, max_n, max_out, candidates=16):
    """Longest match among the most recent occurrences of the last bigram, and the most
    frequent continuation of the occurrences of that length (ties: most recent)."""
    best_len, best_ends = brute_force_occurrences(tokens, suffix, max_n, candidates)
    if best_len < 2:
        return 0, []
    draft = []
    while len(draft) < max_out:
        best_ends = [e for e in best_ends if e + 1 + len(draft) < len(tokens)
                     and tokens[e + 1 + len(draft)] != ResponseCorpus.SEPARATOR]
        if not best_ends:
            break
        nexts = [tokens[e + 1 + len(draft)] for e in best_ends]
        draft.append(max(nexts, key=lambda t: (nexts.count(t), -nexts.index(t))))
        best_ends = [e for e in best_ends if tokens[e + len(draft)] == draft[-1]]
    return best_len, draft


def brute_force_occurrences(tokens, suffix, max_n, candidates=16):
    """(longest match length, end positions of the occurrences that long, most recent
    first) among the ``candidates`` most recent occurrences of the last bigram."""
    ends = [p for p in range(len(tokens) - 1, 0, -1)
            if tokens[p - 1 : p + 1] == suffix[-2:]][:candidates]
    lengths = []
    for end in ends:
        length = 2
        while (length < min(max_n, len(suffix)) and end - length >= 0
               and tokens[end - length] == suffix[-1 - length]):
            length += 1
        lengths.append(length)
    best_len = max(lengths, default=0)
    return best_len, [end for end, length in zip(ends, lengths) if length == best_len]


def test_finished_outputs_help_later_requests_but_preempted_ones_do_not():
    proposer, runner = make_proposer(k=3, ngram_size=2, guess_set_size=0)
    prompt = [1, 2, 3]
    batch = Batch(runner, {"a": prompt + [40, 41, 42, 43, 44]}, {0: 3})
    batch.propose(proposer, [[44]])
    batch.set({"b": [7, 8, 9, 60, 61, 62]}, {0: 3})
    batch.propose(proposer, [[62]])
    proposer.on_requests_removed({"a"}, {"b"})  # a finished, b was preempted
    batch.set({"c": [5, 41, 42]}, {0: 2})
    assert batch.propose(proposer, [[42]]) == [[43, 44]]  # a's output, via the corpus
    batch.set({"d": [5, 60, 61]}, {0: 2})
    assert batch.propose(proposer, [[61]]) == [[]]  # b's partial output was not kept
    assert proposer.stats.corpus_tokens == 2


def test_live_responses_serve_the_other_requests_and_forget_released_ones():
    live = LiveResponses(capacity=24, max_requests=3)  # 8 cells a request: 7 tokens
    live.extend("a", [1, 2, 3, 10, 11])
    live.extend("b", [9, 2, 3, 20])
    live.extend("b", [9, 2, 3, 20, 21, 22, 23, 24, 25])  # only what is new; 7 kept
    assert len(live) == 12
    assert live.match("c", [7, 2, 3], 2, 4, 5)[:2] == (2, [20, 21, 22, 23])  # most recent
    assert live.match("c", [1, 2, 3], 2, 4, 5)[:2] == (3, [10, 11])
    assert live.match("b", [7, 2, 3], 2, 4, 5)[:2] == (2, [10, 11])  # not its own
    assert live.match("a", [22, 23], 2, 4, 9)[:2] == (2, [])  # b's 7 kept: nothing after
    assert live.match("a", [11, 9], 2, 4, 5)[:2] == (0, [])  # no match across slots
    live.release({"b"})
    assert live.match("a", [7, 2, 3], 2, 4, 5)[:2] == (0, [])
    live.extend("d", [5, 2, 3, 30])  # reuses b's slot
    assert live.match("a", [7, 2, 3], 2, 4, 5)[:2] == (2, [30])
    live.keep_only({"d"})
    assert live.match("d", [1, 2, 3], 2, 4, 5)[:2] == (0, []) and len(live) == 4
    for req_id in "efgh":  # more requests than slots: the extra one is not shared
        live.extend(req_id, [6, 6, 6])
    assert len(live) == 10


def test_live_responses_match_a_brute_force_search_of_the_other_slots():
    rng = random.Random(3)
    live = LiveResponses(capacity=4 * 31, max_requests=4)
    outputs: dict[str, list[int]] = {r: [] for r in "abcd"}
    for _ in range(60):
        req_id = rng.choice("abcd")
        outputs[req_id] += [rng.randrange(12) for _ in range(rng.randint(1, 4))]
        live.extend(req_id, outputs[req_id])
        asking = rng.choice("abcd")
        suffix = [rng.randrange(12) for _ in range(rng.randint(2, 6))]
        length, continuation, _ = live.match(asking, suffix, 2, 6, 4)
        others = [outputs[r][:30] for r in "abcd" if r != asking]
        found = [brute_force_occurrences(o, suffix, 6) for o in others]
        longest = max(f[0] for f in found)
        if longest < 2:
            assert (length, continuation) == (0, [])
            continue
        assert length == longest
        # the continuation is that of one of the longest occurrences (the most
        # frequent one: which slot wins a tie depends on the order tokens came in)
        assert any(o[e + 1 : e + 1 + len(continuation)] == continuation
                   for o, (n, ends) in zip(others, found) if n == length for e in ends)


@pytest.mark.parametrize("options", [{}, {"live_corpus_tokens": 0}, {"corpus_tokens": 0}])
def test_live_outputs_help_the_requests_decoding_beside_them(options):
    proposer, runner = make_proposer(k=3, ngram_size=2, guess_set_size=0, **options)
    batch = Batch(runner, {"a": [1, 2, 3, 40, 41, 42, 43, 44], "b": [5, 6, 7]},
                  {0: 3, 1: 3})
    batch.propose(proposer, [[44], [7]])
    batch.set({"a": [1, 2, 3, 40, 41, 42, 43, 44, 45], "b": [5, 6, 7, 41, 42]},
              {0: 3, 1: 3})
    draft = batch.propose(proposer, [[45], [41, 42]])[1]
    if options:  # cross-request memory of live responses off
        assert draft == []
        return
    assert draft == [43, 44, 45]  # a's, live
    assert proposer.stats.corpus_tokens == 3
    proposer.on_requests_removed(set(), {"a"})  # preempted: a's output is not kept
    batch.set({"b": [5, 6, 7, 41, 42, 9, 41, 42]}, {0: 3})
    assert batch.propose(proposer, [[9, 41, 42]]) == [[9, 41, 42]]  # b's own repeat


def test_a_live_match_with_a_continuation_beats_an_equal_finished_one_without():
    proposer, runner = make_proposer(k=3, ngram_size=2, guess_set_size=0)
    batch = Batch(runner, {"a": [1, 2, 3, 41, 42]}, {0: 3})
    batch.propose(proposer, [[42]])
    proposer.on_requests_removed({"a"}, set())  # the corpus ends a response with 41 42
    batch.set({"b": [5, 6, 7, 41, 42, 43, 44], "c": [8, 9, 41, 42]}, {0: 3, 1: 2})
    assert batch.propose(proposer, [[44], [42]])[1] == [43, 44]  # b's, live


def test_support_bins_tell_a_guess_from_a_consensus_and_a_copy():
    assert support_bin(1, 1, 3) == SEEN_ONCE
    assert support_bin(1, 1, LONG_MATCH) == COPIED
    assert support_bin(3, 3, 2) == UNANIMOUS
    assert support_bin(2, 3, 2) == MAJORITY
    assert support_bin(1, 2, 2) == MINORITY and support_bin(2, 5, 2) == MINORITY


def test_each_draft_token_is_classed_by_its_source_and_support():
    draft = Draft([5, 6, 7, 8, 9], "corpus", matched=2, from_pool=2,
                  bins=[UNANIMOUS, SEEN_ONCE, MAJORITY, MAJORITY, SEEN_ONCE])
    source = {name: i * SUPPORT_BINS for i, name in enumerate(TOKEN_SOURCES)}
    assert draft.token_classes().tolist() == [
        source["corpus"] + UNANIMOUS, source["corpus"] + SEEN_ONCE,
        source["pool"] + MAJORITY, source["pool"] + MAJORITY, source["recycled"] + SEEN_ONCE]
    del draft.tokens[3:]  # the cut keeps a prefix
    assert len(draft.token_classes()) == 3


def test_a_requests_first_token_rate_scales_its_class_estimate_by_its_record():
    right, wrong = (RequestState(NgramPool(3, 8, 100), prompt_len=0, next_ngram_start=0)
                    for _ in range(2))
    assert right.first_token_rate(0.3) == pytest.approx(0.3)  # no record: the estimate
    for _ in range(20):  # estimated at 0.4 each
        right.count_first_token(True, 0.4)
        wrong.count_first_token(False, 0.4)
    assert right.first_token_rate(0.4) > 0.8 and right.first_token_rate(0.9) == 1.0
    assert wrong.first_token_rate(0.4) < 0.1
    # a surer class keeps its edge for the same request
    assert wrong.first_token_rate(0.9) > wrong.first_token_rate(0.4)


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
    assert proposer._planner.step_plan(False) == (None, None, False)  # no estimate: nothing is cut
    proposer.on_start_cost(measured)
    assert not proposer.trees_on  # 29 free tokens (or none measured): below 150
    free_tokens, step_cost, _ = proposer._planner.step_plan(False)
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


def capture(drafts, predictions, bonus, top_ids=None, top_logprobs=None):
    flat = [t for d in drafts for t in d]
    return VerificationCapture(
        num_draft_tokens=[len(d) for d in drafts],
        draft_token_ids=torch.tensor(flat),
        target_argmax=torch.tensor([t for p in predictions for t in p]),
        bonus_token_ids=torch.tensor(bonus),
        target_top_ids=None if top_ids is None else torch.tensor(top_ids),
        target_top_logprobs=None if top_logprobs is None else torch.tensor(top_logprobs),
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


def top_k(ids, probs):
    """Top-k ids and log-probabilities as the sampler hooks capture them."""
    return torch.tensor(ids), torch.tensor(probs).log()


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


def test_capture_top_k_log_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    result = capture_verification(torch.tensor([1, 0]), [2], logits, torch.tensor([[2]]),
                                  top_k=2)
    expected_logprobs, expected_ids = torch.log_softmax(logits, -1).topk(2, -1)
    assert result.target_top_ids.tolist() == expected_ids.tolist() == [[1, 2], [0, 3]]
    assert torch.allclose(result.target_top_logprobs, expected_logprobs)
    assert capture_verification(torch.tensor([1, 0]), [2], logits,
                                torch.tensor([[2]])).target_top_ids is None


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
    assert (proposer.stats.cut_tokens > 0) == cost_aware


def test_unbound_runner_fails_at_load_model():
    config = fake_vllm_config(2, MAX_LEN)
    with pytest.raises(RuntimeError, match="not bound"):
        LookaheadProposer(config).load_model(None)


def test_decode_only_steps_are_told_apart_from_prefill_steps():
    def step(scheduled, drafts):
        return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts)

    assert is_decode_only(step({"a": 1, "b": 4}, {"b": [7, 8, 9]}))
    assert not is_decode_only(step({"a": 1, "b": 64}, {}))  # b's prompt chunk


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


def test_trees_auto_follow_the_start_up_cost_and_take_recycling_with_them():
    from vllm_lookahead.lookahead.options import AUTO_TREE_FREE_TOKENS, RECYCLE_TOP_K_WITH_TREES
    from vllm_lookahead.worker.start_cost import StartCost

    cheap = StartCost(pass_seconds=0.010, token_seconds=0.00002)  # 499 free tokens
    dear = StartCost(pass_seconds=0.030, token_seconds=0.001)  # 29
    assert round(cheap.free_tokens) == 499 and round(dear.free_tokens) == 29
    proposer, _ = make_proposer(trees="auto", rescoring_top_k=3)
    assert proposer.trees_need_free_tokens == AUTO_TREE_FREE_TOKENS and proposer.trees_on
    proposer.on_start_cost(cheap)
    assert proposer.trees_on and proposer.stats.start_free_tokens == cheap.free_tokens
    assert proposer.capture_last_top_k == RECYCLE_TOP_K_WITH_TREES
    assert proposer.capture_top_k == RECYCLE_TOP_K_WITH_TREES

    proposer, _ = make_proposer(trees="auto", rescoring_top_k=3)
    proposer.on_start_cost(dear)
    assert not proposer.trees_on  # and the recycled top-k, which pays only with trees
    assert proposer.capture_last_top_k == 0 and proposer.capture_top_k == 3
    # an explicit recycle_top_k stays; no measurement (a failed one) counts as dear
    proposer, _ = make_proposer(trees="auto", recycle_top_k=4, tree_free_tokens=10)
    proposer.on_start_cost(StartCost(float("nan"), float("nan"), "ValueError: no blocks"))
    assert not proposer.trees_on and proposer.capture_last_top_k == 4
    # trees on / off are not measured; off also means no recycling by default
    assert make_proposer(trees="on")[0].trees_need_free_tokens is None
    off, _ = make_proposer(trees="off")
    assert off.trees_need_free_tokens is None and not off.trees_on
    assert off.capture_last_top_k == 0


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
    assert proposer.capture_last_top_k > 0
    proposer.on_tree_check(TreeCheck(passed=False, backend="CPU_ATTN", dtype="float32",
                                     max_difference=1.0, tolerance=1e-3))
    assert not proposer.trees_on and proposer.capture_last_top_k == 0
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
