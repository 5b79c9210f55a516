"""The draft sources without an engine: context and corpus matches, the n-gram pool, live
responses, support bins and first-token rates."""

from __future__ import annotations

import random

import numpy as np
import pytest
from proposers import Batch, make_proposer

from vllm_lookahead.lookahead.sources.context import suffix_match
from vllm_lookahead.lookahead.sources.corpus import LiveResponses, ResponseCorpus
from vllm_lookahead.lookahead.sources.draft import TOKEN_SOURCES, Draft
from vllm_lookahead.lookahead.sources.drafts import CORPUS_MATCH_MARGIN, TokenAcceptance
from vllm_lookahead.lookahead.sources.pool import NgramPool
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
from vllm_lookahead.lookahead.state import RequestState

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


def test_corpus_matches_the_last_token_alone_where_no_bigram_repeats():
    corpus = ResponseCorpus(capacity=100)
    corpus.add([1, 2, 3, 10, 11])
    corpus.add([9, 3, 20, 21])
    assert corpus.match([7, 3], 2, 4, 5)[:2] == (0, [])  # "7 3" never repeats
    assert corpus.match([7, 3], 1, 4, 5)[:2] == (1, [20, 21])  # 3 alone: most recent tie
    assert corpus.match([3], 1, 4, 5)[:2] == (1, [20, 21])
    assert corpus.match([2, 3], 1, 4, 5)[:2] == (2, [10, 11])  # a repeated bigram wins
    assert corpus.match([7, 3], 1, 4, 5, min_prob=0.6)[:2] == (1, [])  # 1 of 2: below
    assert corpus.match([7, 8], 1, 4, 5)[:2] == (0, [])
    live = LiveResponses(capacity=24, max_requests=3)
    live.extend("a", [1, 3, 10])
    live.extend("b", [9, 3, 20])
    assert live.match("c", [7, 3], 1, 4, 5)[:2] == (1, [20])
    assert live.match("b", [7, 3], 1, 4, 5)[:2] == (1, [10])  # not its own


def test_the_corpus_continues_a_token_the_requests_own_text_has_not():
    """Other responses continue the last token alone only where the request's pool has
    no continuation of it; the corpus's measured rate bounds its draft after the first
    token, never the first."""
    proposer, runner = make_proposer(k=3, ngram_size=2)
    batch = Batch(runner, {"a": [1, 2, 3, 40, 41, 42, 43, 44]}, {0: 3})
    batch.propose(proposer, [[44]])
    proposer.on_requests_removed({"a"}, set())  # the corpus: 40 41 42 43 44
    batch.set({"b": [5, 6, 7, 9, 41]}, {0: 4})
    assert batch.propose(proposer, [[41]]) == [[42, 43, 44]]  # "9 41" is new: 41 alone
    batch.set({"c": [5, 41, 50, 6, 41]}, {0: 4})
    assert batch.propose(proposer, [[41]])[0][0] == 50  # its own "41 50", from its pool
    proposer._sources.corpus_acceptance = TokenAcceptance(accepted=0.5, reached=10.0)
    batch.set({"d": [5, 6, 7, 8, 41]}, {0: 4})
    assert batch.propose(proposer, [[41]]) == [[42]]  # rate 0.05 < draft_min_prob 0.1


def test_another_response_drafts_over_the_context_only_where_its_match_is_much_longer():
    """The context's own two-token match (4 5 -> 60) drafts over another response's
    match of four tokens (2 3 4 5 -> 70); one of six (2 + CORPUS_MATCH_MARGIN) wins."""
    assert CORPUS_MATCH_MARGIN == 4  # the contexts below are built for it
    proposer, runner = make_proposer(k=3, ngram_size=2)
    batch = Batch(runner, {"a": [1, 2, 3, 9, 8, 2, 3, 4, 5, 70, 71, 72]}, {0: 3})
    batch.propose(proposer, [[72]])
    proposer.on_requests_removed({"a"}, set())  # the corpus: 9 8 2 3 4 5 70 71 72
    batch.set({"b": [30, 4, 5, 60, 61, 62, 31, 2, 3, 4, 5]}, {0: 6})
    assert batch.propose(proposer, [[5]])[0][0] == 60
    batch.set({"c": [30, 4, 5, 60, 61, 62, 9, 8, 2, 3, 4, 5]}, {0: 6})
    assert batch.propose(proposer, [[5]])[0] == [70, 71, 72]


def test_a_pool_that_does_not_draft_leaves_the_last_token_to_the_corpus():
    """With guess_set_size 0 the pool drafts nothing, so its continuations of the last
    token do not keep the corpus from continuing it."""
    proposer, runner = make_proposer(k=3, ngram_size=2, guess_set_size=0)
    batch = Batch(runner, {"a": [1, 2, 3, 40, 41, 42, 43, 44]}, {0: 3})
    batch.propose(proposer, [[44]])
    proposer.on_requests_removed({"a"}, set())
    batch.set({"c": [5, 41, 50, 6, 41]}, {0: 4})
    assert batch.propose(proposer, [[41]]) == [[42, 43, 44]]


#: Run in a fresh interpreter: the draft sources' start-up, then every compiled path a
#: step takes, with the argument types the proposer passes.
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
        suffix = [rng.randrange(7) for _ in range(rng.randint(1, 8))]
        for min_n in (1, 2):
            assert corpus.match(suffix, min_n, 6, 4)[:2] == brute_force_match(
                corpus.storage[0][: len(corpus)].tolist(), suffix, 6, 4, min_n=min_n)
    assert len(corpus) <= 500
    assert all(a is b for a, b in zip(arrays, corpus.storage))
    assert sum(a.nbytes for a in arrays) == ResponseCorpus.bytes_for(500)


def brute_force_match(tokens, suffix, max_n, max_out, candidates=16, min_n=2):
    """Longest match among the most recent occurrences of the last bigram (with
    ``min_n`` 1 and none: of the last token), and the most frequent continuation of the
    occurrences of that length (ties: most recent)."""
    best_len, best_ends = brute_force_occurrences(tokens, suffix, max_n, candidates)
    if best_len < 2 and min_n <= 1:
        best_ends = [p for p in range(len(tokens) - 1, -1, -1)
                     if tokens[p] == suffix[-1]][:candidates]
        best_len = 1 if best_ends else 0
    if best_len < min_n or not best_len:
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
            if len(suffix) >= 2 and tokens[p - 1 : p + 1] == suffix[-2:]][:candidates]
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
