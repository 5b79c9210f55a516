"""Draft budget under load: the cost fit and the choice of draft tokens to keep."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from vllm_lookahead.lookahead.budget import (
    ACCEPTED_TOKEN_WORTH,
    NUM_SAMPLING_CLASSES,
    AcceptanceByDepth,
    affordable_draft_lengths,
    any_token_affordable,
    cut_to_budget,
    sampling_class,
)
from vllm_lookahead.lookahead.step_cost import (
    BASELINE_INTERVAL,
    MIN_BASELINE_TIMES,
    MIN_SAMPLES,
    REFIT_INTERVAL,
    WINDOW,
    CostCurve,
    StepCostModel,
)


def test_cost_model_recovers_fixed_and_per_token_cost():
    model = StepCostModel()
    rng = np.random.default_rng(0)
    for n in rng.integers(1, 200, size=MIN_SAMPLES - 1):
        model.add(int(n), 0.030 + 0.0005 * n)
    assert math.isinf(model.free_tokens())  # too few passes timed yet
    model.add(100, 0.030 + 0.0005 * 100)
    assert model.free_tokens() == pytest.approx(60.0)


def test_a_start_up_measurement_stands_in_until_the_fit():
    model = StepCostModel()
    assert not model.has_estimate
    model.set_prior(0.020, 0.001)  # the target's passes alone, at start-up
    assert model.has_estimate and model.free_tokens() == pytest.approx(20.0)
    for _ in range(MIN_SAMPLES):  # one token count: nothing to fit, the prior stays
        model.add(10, 0.040)
    assert model.free_tokens() == pytest.approx(20.0)
    for n in range(1, MIN_SAMPLES + 1):  # whole steps: a larger fixed cost
        model.add(n, 0.030 + 0.001 * n)
    model.add(60, 0.090)
    assert model.free_tokens() == pytest.approx(30.0, rel=0.02)


def test_cost_model_ignores_passes_slowed_down_by_other_work():
    """Passes 1.5-4x slower, 30 % of them: over seeds 0-39 a plain least-squares fit of
    these passes put the free tokens at 0.56x to 2.2x the truth, this fit within 12 %."""
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for _ in range(WINDOW):
        n = int(rng.choice([1, 2, 3, 4, 5, 8, 12, 25],
                           p=[0.3, 0.2, 0.15, 0.1, 0.1, 0.07, 0.05, 0.03]))
        slowdown = rng.uniform(1.5, 4.0) if rng.random() < 0.3 else 1.0
        model.add(n, (0.030 + 0.0011 * n) * slowdown * rng.lognormal(0, 0.05))
    assert model.free_tokens() == pytest.approx(0.030 / 0.0011, rel=0.15)


@pytest.mark.parametrize("seconds", [lambda n: 0.05, lambda n: 0.05 - 1e-5 * n])
def test_cost_model_cuts_nothing_when_tokens_look_free(seconds):
    model = StepCostModel()
    for n in range(1, 2 * MIN_SAMPLES):
        model.add(n, seconds(n))
    assert math.isinf(model.free_tokens())
    assert affordable_draft_lengths(np.array([5, 7]), np.array([0.1, 0.2]), np.ones(8),
                                    model.curve()).tolist() == [5, 7]


def linear_cost(free_tokens: float) -> CostCurve:
    """A step costing ``free_tokens`` plus its tokens, in units of one token's cost."""
    return CostCurve.linear(free_tokens, 1.0)


def check_drafts(depth: AcceptanceByDepth, lengths: list[int], matched: list[int]) -> None:
    """Drafts of ``lengths`` whose first ``matched`` tokens the text then confirmed."""
    for length, count in zip(lengths, matched):
        depth.add(0, min(count + 1, length), count)


def test_acceptance_by_depth_conditions_on_the_tokens_before():
    depth = AcceptanceByDepth(max_depth=4, decay=1.0)
    # copied spans: all or nothing; 10 drafts of 4, half fully accepted, half rejected at 1
    check_drafts(depth, [4] * 10, [4, 0] * 5)
    survival = depth.survival()
    # position 2: 5 of 5 accepted, smoothed towards 0.5 by 2 pseudo-verifications;
    # the deeper ones smoothed towards the rate before them
    rates = [(5 + 2 * 0.5) / 7]
    rates += [(5 + 2 * rates[-1]) / 7]
    rates += [(5 + 2 * rates[-1]) / 7]
    assert survival[0] == 1.0
    assert survival[1:] == pytest.approx(np.cumprod(rates))
    check_drafts(depth, [4], [1])  # a rejection at the second position lowers it
    assert depth.survival()[1] == pytest.approx((5 + 2 * 0.5) / 8)


def test_sparse_deep_positions_do_not_vanish():
    depth = AcceptanceByDepth(max_depth=24, decay=1.0)
    check_drafts(depth, [4] * 20 + [24], [0] * 20 + [24])  # one long span among rejections
    # one span seen: 0.33 at position 24 (smoothed towards 0.5 at each position: 1e-4)
    assert depth.survival()[23] > 0.3


def test_acceptance_is_kept_per_source_of_each_draft_token():
    """Drafts of a matched span (source 0) continued from the pool (source 1): the
    span's tokens are confirmed, the pool's are not; each source has its own rates."""
    depth = AcceptanceByDepth(max_depth=6, num_classes=2, decay=1.0)
    sources = np.array([0, 0, 0, 1, 1, 1])
    for _ in range(20):
        depth.add(0, 4, 3, sources)  # three matched tokens right, the first pool token wrong
    for _ in range(20):
        depth.add(0, 1, 0, np.array([1] * 6))  # pool-only drafts: the first token wrong
    rates = depth.conditional_rates()
    assert rates[0, 1] > 0.9 and rates[0, 2] > 0.9  # the span's 2nd and 3rd tokens
    assert rates[1, 3] < 0.1  # a pool token after the span
    assert depth.first_token_rate(0) > 0.9 and depth.first_token_rate(1) < 0.1
    assert depth.first_token_rate() == pytest.approx((20 + 1) / (40 + 2))
    mixed = depth.survival(sources)
    assert mixed[2] > 0.8 and mixed[3] < 0.1 * mixed[2]
    # a fourth token from the span (never seen there) keeps the span's rate
    assert depth.survival(np.zeros(6, dtype=np.int64))[3] > 0.8


def test_a_class_is_calibrated_within_its_sources_group():
    """Two groups (sources) of two classes (support bins): in the first, tokens every
    occurrence agreed on are right and tokens seen once are wrong; a class never seen
    takes its group's rate, not the prior's."""
    depth = AcceptanceByDepth(max_depth=4, num_classes=4, decay=1.0, group_size=2)
    for _ in range(30):
        depth.add(0, 2, 2, np.array([0, 0, 0, 0]))  # unanimous: right at 1 and 2
        depth.add(0, 1, 0, np.array([1, 1, 1, 1]))  # seen once: wrong at once
        depth.add(0, 1, 0, np.array([2, 2, 2, 2]))  # the second group: wrong
    assert depth.first_token_rate(0) > 0.9 and depth.first_token_rate(1) < 0.1
    assert depth.first_token_rate(3) < 0.1  # never seen: its group's (all wrong)
    group = (30 + 2 * 0.5) / (60 + 2)
    assert depth.first_token_rate(0) == pytest.approx((30 + 2 * group) / (30 + 2))
    rates = depth.conditional_rates()
    assert rates[0, 1] > 0.9 and rates[0, 1] > rates[1, 1]
    with pytest.raises(ValueError, match="groups of 2"):
        AcceptanceByDepth(max_depth=4, num_classes=3, group_size=2)


def test_the_cut_keeps_matched_tokens_deeper_than_pool_guesses():
    depth = AcceptanceByDepth(max_depth=8, num_classes=2, decay=1.0)
    for _ in range(30):
        depth.add(0, 8, 8, np.zeros(8, dtype=np.int64))  # matched spans: right
        depth.add(0, 2, 1, np.array([0] + [1] * 7))  # pool tokens: wrong
    matched = depth.survival(np.zeros(8, dtype=np.int64))
    guessed = depth.survival(np.array([0] + [1] * 7))
    kept = affordable_draft_lengths(np.array([8, 8]), np.array([0.9, 0.9]),
                                    np.stack([matched, guessed]), linear_cost(6.0))
    assert kept[0] == 8 and kept[1] <= 1


def expected_rate(kept, probs, step_cost, worth=1.0):
    expected = len(kept) + worth * sum(sum(p[:keep]) for keep, p in zip(kept, probs))
    return expected / float(step_cost(np.array([len(kept) + sum(kept)]))[0])


#: Step seconds measured by token count on a 2-core AVX2 CPU (SmolLM2-135M float32,
#: benchmarks/README.md (bd)): flat from 3 to 5 tokens, steep from 5 to 9.
AVX2_STEP = CostCurve(np.array([1.0, 2, 3, 5, 9, 17, 25]),
                      np.array([80.2, 87.1, 92.7, 92.7, 115.5, 129.5, 148.8]) * 1e-3, 2.4e-3)


@pytest.mark.parametrize("worth", [1.0, ACCEPTED_TOKEN_WORTH])
@pytest.mark.parametrize("seed", range(40))
def test_kept_drafts_maximize_expected_tokens_per_cost(seed, worth):
    """Against every choice of prefixes, under a line and under a measured curve."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, size=rng.integers(1, 5))
    first_rates = rng.uniform(0.05, 0.95, size=len(lengths))
    survival = np.cumprod(np.concatenate(([1.0], rng.uniform(0.2, 1.0, size=4))))
    for step_cost in (linear_cost(float(rng.choice([0.0, 2.0, 10.0, 50.0]))), AVX2_STEP):
        kept = affordable_draft_lengths(lengths, first_rates, survival, step_cost,
                                        worth=worth)
        assert all(0 <= k <= n for k, n in zip(kept, lengths))
        probs = [rate * survival[:n] for rate, n in zip(first_rates, lengths)]
        best = max(expected_rate(choice, probs, step_cost, worth)
                   for choice in itertools.product(*(range(n + 1) for n in lengths)))
        assert expected_rate(kept, probs, step_cost, worth) == pytest.approx(best)


def test_the_cut_keeps_only_tokens_that_save_more_than_they_cost():
    """64 requests on a line of 20 free tokens: a token pays at acceptance 64 / 84 (0.76)
    if an accepted token saved a whole share of a step; the cut counts it at
    ``ACCEPTED_TOKEN_WORTH`` of that (a batch may drain), so one accepted at 0.85 is cut
    and one at 0.98 kept."""
    step = linear_cost(20.0)
    assert affordable_draft_lengths(np.ones(64, dtype=np.int64), np.full(64, 0.85),
                                    np.ones(1), step).sum() == 64  # at worth 1.0
    for acceptance, kept in ((0.85, 0), (0.98, 1)):
        drafts = [[7] for _ in range(64)]
        estimates = [np.array([acceptance])] * 64
        cut = cut_to_budget(drafts, estimates, step)
        assert (cut, sum(map(len, drafts))) == (64 * (1 - kept), 64 * kept)


def test_a_step_where_no_certain_token_pays_keeps_no_draft():
    """``any_token_affordable``: 64 requests on a line of 10 free tokens cannot pay for a
    token even were it certain (each costs 74 / 64 of a request's share of the step, an
    accepted one saves ``ACCEPTED_TOKEN_WORTH`` of it); on 20 they can. It says no
    exactly where the cut keeps no certain token, and then the cut keeps no token of
    any drafts within the bounds, whatever their estimates."""
    bounds = np.full(64, 24)
    assert not any_token_affordable(bounds, linear_cost(10.0))
    assert any_token_affordable(bounds, linear_cost(20.0))
    assert not any_token_affordable(np.zeros(3, dtype=np.int64), linear_cost(20.0))
    rng = np.random.default_rng(0)
    for free_tokens in np.linspace(0.0, 40.0, 41):
        step = linear_cost(float(free_tokens))
        certain = [[7] * 24 for _ in range(64)]
        kept = 64 * 24 - cut_to_budget(certain, [np.ones(24)] * 64, step)
        assert any_token_affordable(bounds, step) == (kept > 0)
        if not kept:
            lengths = rng.integers(0, 25, size=64)
            drafts = [[7] * int(n) for n in lengths]
            estimates = [np.sort(rng.uniform(0.0, 1.0, size=int(n)))[::-1] for n in lengths]
            assert cut_to_budget(drafts, estimates, step) == lengths.sum()


def test_the_cut_follows_the_measured_curve_where_a_line_would_not():
    """A lone request's 8-token draft: a line through the same passes keeps 6 tokens;
    the curve keeps the 4 before the steep part, or all 8 when they are sure enough."""
    survival = 0.7 ** np.arange(8)
    line = CostCurve.linear(77.5e-3, 2.7e-3)
    assert affordable_draft_lengths(np.array([8]), np.array([0.5]), survival,
                                    line).tolist() == [6]
    assert affordable_draft_lengths(np.array([8]), np.array([0.5]), survival,
                                    AVX2_STEP).tolist() == [4]
    assert affordable_draft_lengths(np.array([8]), np.array([0.95]), 0.97 ** np.arange(8),
                                    AVX2_STEP).tolist() == [8]


def test_the_cost_curve_follows_each_token_counts_quiet_time():
    """Steps of a CPU whose time jumps between 5 and 9 tokens, 30 % of them slowed by
    other work; the curve is non-decreasing, near each count's time, and continued past
    the counts timed by the start-up measurement's rises."""
    rng = np.random.default_rng(0)
    truth = AVX2_STEP
    model = StepCostModel()
    model.set_prior(0.070, 0.0027, tuple(truth.tokens), tuple(truth.seconds - 0.010))
    start_up = model.curve()  # until the steps are timed
    assert start_up(truth.tokens) == pytest.approx(truth.seconds - 0.010)
    for _ in range(WINDOW):
        n = int(rng.choice([1, 2, 3, 4, 5, 6, 7, 9]))
        slowdown = rng.uniform(1.5, 4.0) if rng.random() < 0.3 else 1.0
        model.add(n, float(truth(np.array([n]))[0]) * slowdown * rng.lognormal(0, 0.03))
    curve = model.curve()
    assert np.all(np.diff(curve.seconds) >= 0)
    counts = np.arange(1, 10)
    assert curve(counts) == pytest.approx(truth(counts), rel=0.05)
    # past 9 tokens: the timed 9 plus the start-up rises, not the line's slope
    assert curve(np.array([17, 40])) == pytest.approx(truth(np.array([17, 40])), rel=0.05)


def verifying_step(num_tokens: int, num_requests: int = 16) -> float:
    """A 2-core CPU's step of 16 sampled requests (run (fu)'s step log, rounded): 68 ms
    without drafts; with any, 3 ms of verification and 1.7 ms a draft token more."""
    drafts = num_tokens - num_requests
    return 0.068 + 0.0017 * (num_requests - 16) + (0.003 + 0.0017 * drafts if drafts else 0.0)


def model_drafting_every_step() -> StepCostModel:
    """Steps of 16 requests that each verified 1-4 draft tokens, as when every step
    drafts: no step of 16 tokens timed."""
    model = StepCostModel()
    for n in list(range(17, 21)) * (MIN_SAMPLES // 4):
        model.add(n, verifying_step(n), 16)
    return model


def test_not_drafting_is_priced_by_steps_timed_without_drafts():
    """With every step drafted the curve prices a step of 16 tokens from its drafted
    neighbours, so the first draft token looks as cheap as the next (1.7 ms against
    4.7); once steps without drafts are timed at 16 requests, they price not drafting,
    and a step of another request count does not bend the drafted steps' curve."""
    model = model_drafting_every_step()
    blind = model.step_curve(16)
    assert blind(np.array([17]))[0] - blind(np.array([16]))[0] == pytest.approx(0.0017)
    for _ in range(MIN_BASELINE_TIMES):
        model.add(16, verifying_step(16), 16)
    for _ in range(REFIT_INTERVAL):  # 18 requests, no draft: not a drafted step of 18
        model.add(18, 0.001, 18)
    priced = model.step_curve(16)
    assert model.baseline(16) == pytest.approx(0.068) and model.baseline(17) is None
    assert priced(np.arange(16, 21)) == pytest.approx([verifying_step(n)
                                                        for n in range(16, 21)])
    assert model.step_curve(16) is priced  # reused while nothing changed
    assert model.step_curve(17) is model.curve()  # no baseline at 17 requests


def test_a_lone_draft_token_must_pay_for_the_verification_too():
    """One request of 16 has a one-token draft, accepted six times in ten: it saves
    0.8 x 0.6 of a request's 4.25 ms share (2.0 ms), more than the token's 1.7 ms but
    less than the 4.7 ms the step pays for verifying any draft."""
    model = model_drafting_every_step()
    drafts = [[7]] + [[] for _ in range(15)]
    estimates = [np.array([0.6])] + [np.zeros(0)] * 15
    assert cut_to_budget([list(d) for d in drafts], estimates, model.step_curve(16)) == 0
    for _ in range(MIN_BASELINE_TIMES):
        model.add(16, verifying_step(16), 16)
    assert cut_to_budget(drafts, estimates, model.step_curve(16)) == 1


def test_a_request_count_without_a_baseline_times_one_now_and_then():
    model = StepCostModel()
    assert not model.wants_baseline(16)  # nothing fitted yet: no curve to compare with
    model = model_drafting_every_step()
    asked = [model.wants_baseline(16)]
    for n in range(2 * BASELINE_INTERVAL):
        model.add(17, verifying_step(17), 16)
        asked.append(model.wants_baseline(16))
    assert asked == ([True] + [False] * (BASELINE_INTERVAL - 1)) * 2 + [True]
    for _ in range(MIN_BASELINE_TIMES):
        model.add(16, verifying_step(16), 16)
    assert not any(model.wants_baseline(16) for _ in range(BASELINE_INTERVAL + 1))


def test_the_report_lists_each_token_counts_passes_against_the_curve():
    model = StepCostModel()
    for n, seconds in [(1, 0.010), (1, 0.012), (1, 0.030), (1, 0.011), (4, 0.020)] * 8:
        model.add(n, seconds)
    one, four = model.by_token_count()
    assert (one["tokens"], one["passes"], four["passes"]) == (1, 32, 8)
    assert one["quiet"] == 0.010 and one["mean"] == pytest.approx(0.01575)
    assert one["curve"] == pytest.approx(0.010) and four["curve"] == pytest.approx(0.020)


def test_the_cost_curve_pools_a_count_that_looks_cheaper_than_fewer_tokens():
    model = StepCostModel()
    for _ in range(MIN_SAMPLES):
        for n, seconds in ((1, 0.080), (2, 0.090), (3, 0.085), (4, 0.100)):
            model.add(n, seconds)
    assert model.curve()(np.arange(1, 5)) == pytest.approx([0.080, 0.0875, 0.0875, 0.100])


def test_load_cuts_drafts_and_confident_requests_keep_more():
    lengths, rates = np.full(32, 8), np.where(np.arange(32) < 16, 0.9, 0.4)
    survival = 0.8 ** np.arange(8)
    alone = affordable_draft_lengths(lengths[:1], rates[:1], survival, linear_cost(20.0))
    loaded = affordable_draft_lengths(lengths, rates, survival, linear_cost(20.0))
    assert alone.tolist() == [8]
    assert loaded[:16].min() > loaded[16:].max()
    assert loaded.sum() < lengths.sum() / 2


def test_sampling_classes_part_greedy_temperatures_and_top_p():
    from vllm import SamplingParams

    assert sampling_class(None) == sampling_class(SamplingParams(temperature=0)) == 0
    classes = [sampling_class(SamplingParams(temperature=t, top_p=p))
               for t in (0.3, 0.7, 1.5) for p in (0.5, 1.0)]
    assert len(set(classes)) == len(classes) == NUM_SAMPLING_CLASSES - 1
    assert 0 not in classes


def test_each_request_is_cut_by_its_own_classes_acceptance_by_depth():
    lengths, rates = np.array([8, 8]), np.array([0.9, 0.9])
    survival = np.stack([0.95 ** np.arange(8), 0.5 ** np.arange(8)])  # greedy, sampled
    kept = affordable_draft_lengths(lengths, rates, survival, linear_cost(6.0))
    shared = affordable_draft_lengths(lengths, rates, survival[0], linear_cost(6.0))
    assert kept[0] > kept[1]
    assert shared[0] == shared[1]
