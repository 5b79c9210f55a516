"""The cost-aware cut's estimates recalibrated by what the tokens it kept were worth
(``lookahead/calibration.py``): no model, no clock."""

from __future__ import annotations

import numpy as np

from vllm_lookahead.lookahead.budget import StepPlan, WorkerEstimates
from vllm_lookahead.lookahead.calibration import AcceptanceCalibration, calibrated
from vllm_lookahead.lookahead.cut import CostAwareCut
from vllm_lookahead.lookahead.hindsight import Hindsight
from vllm_lookahead.lookahead.sources.draft import NUM_TOKEN_CLASSES, SUPPORT_BINS, Draft
from vllm_lookahead.lookahead.sources.pool import NgramPool
from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.lookahead.step_cost import CostCurve, StepCostModel
from vllm_lookahead.metrics import ProposerStats

K = 8


def calibrate(calibration: AcceptanceCalibration, estimates: np.ndarray) -> np.ndarray:
    """The cut's calibration of one draft's estimates."""
    return calibrated(estimates, calibration.factors())


def test_without_evidence_estimates_are_kept():
    estimates = np.array([0.95, 0.9, 0.6, 0.2])
    np.testing.assert_allclose(calibrate(AcceptanceCalibration(0.99), estimates), estimates)


def test_an_over_estimated_bin_is_scaled_to_what_it_matched():
    calibration = AcceptanceCalibration(0.99)
    for _ in range(200):  # tokens estimated at 0.95 matched half the time
        calibration.add(np.array([0.95, 0.95]), np.array([True, False]))
    assert 0.45 < calibrate(calibration, np.array([0.95]))[0] < 0.55
    assert calibrate(calibration, np.array([0.6]))[0] == 0.6  # no evidence in its bin


def test_estimates_are_never_raised_and_stay_non_increasing_along_a_draft():
    calibration = AcceptanceCalibration(0.99)
    for _ in range(200):
        calibration.add(np.array([0.95]), np.array([False]))  # top bin: never matched
        calibration.add(np.array([0.35]), np.array([True]))  # 0.3 bin: always
    fitted = calibrate(calibration, np.array([0.97, 0.35]))
    assert fitted[0] < 0.1
    assert fitted[1] <= fitted[0]  # not raised, and not above the token before


def test_without_new_evidence_the_prior_returns():
    calibration = AcceptanceCalibration(0.9)
    for _ in range(200):
        calibration.add(np.array([0.95]), np.array([False]))
    before = calibrate(calibration, np.array([0.95]))[0]
    for _ in range(100):
        calibration.decay()
    assert before < 0.2 and calibrate(calibration, np.array([0.95]))[0] > 0.9


def context_draft(tokens: list[int]) -> Draft:
    """A draft of well-supported context tokens."""
    return Draft(list(tokens), matched=len(tokens), bins=[SUPPORT_BINS - 1] * len(tokens))


def cut_for(estimates: WorkerEstimates, drafts: list[list[int]],
            free_tokens: float = 10.0, stats: ProposerStats | None = None,
            time_baseline: bool = False) -> list[int]:
    """The cut's kept lengths for context ``drafts``, on a step whose tokens each cost
    ``1 / free_tokens`` of its fixed part (offered to time its baseline or not)."""
    cut = CostAwareCut(estimates, StepCostModel(), stats or ProposerStats())
    states = [RequestState(NgramPool(3, 8, 100), prompt_len=0, next_ngram_start=0,
                           max_draft=K, draft_limit=K) for _ in drafts]
    main = [context_draft(tokens) for tokens in drafts]
    cut.apply(main, states, np.full(len(drafts), 100), StepPlan(free_tokens, CostCurve.linear(
        1.0, 1 / free_tokens), fill=False, time_baseline=time_baseline))
    return [len(draft.tokens) for draft in main]


def test_a_step_offered_to_time_its_baseline_drops_only_drafts_that_gain_little():
    """Guards ``CostAwareCut._timing_baseline``: 16 trusted copies of 8 tokens, each
    token costing a fifth of the step's fixed part, raise its expected tokens a second
    by 2 %: offered to time its baseline, the step drops them (counted); at a tenth
    they gain 38 % and are kept; not offered, every draft is kept whole."""
    drafts = [list(range(1, K + 1)) for _ in range(16)]
    trusted = WorkerEstimates(K, NUM_TOKEN_CLASSES, SUPPORT_BINS)
    trust(trusted, drafts[0])
    for _ in range(40):  # the kept tokens matched as estimated
        trusted.calibrations[0].add(np.full(K, 0.97), np.ones(K, bool))
    stats = ProposerStats()
    assert sum(cut_for(trusted, drafts, 5.0, stats)) == 16 * K
    assert sum(cut_for(trusted, drafts, 5.0, stats, time_baseline=True)) == 0
    assert stats.baseline_steps == 1
    assert sum(cut_for(trusted, drafts, 10.0, stats, time_baseline=True)) == 16 * K
    assert stats.baseline_steps == 1


def test_the_cut_drops_tokens_whose_estimates_did_not_hold():
    """Guards the calibration in ``CostAwareCut.apply``: with it removed (the raw
    estimates cut), the over-estimated tokens are all kept."""
    drafts = [list(range(1, K + 1)) for _ in range(16)]
    trusted = WorkerEstimates(K, NUM_TOKEN_CLASSES, SUPPORT_BINS)
    trust(trusted, drafts[0])
    for _ in range(40):  # the kept tokens matched as estimated
        trusted.calibrations[0].add(np.full(K, 0.97), np.ones(K, bool))
    assert sum(cut_for(trusted, drafts)) == 16 * K
    for _ in range(400):  # ... but then only a third of the time
        trusted.calibrations[0].add(np.full(K, 0.97), np.arange(K) < 3)
    assert sum(cut_for(trusted, drafts)) < 16 * K / 2


def trust(estimates: WorkerEstimates, draft: list[int]) -> None:
    """Acceptance by depth as if drafts like ``draft`` were always right so far."""
    for depth_acceptance in estimates.depth_acceptance:
        for _ in range(200):
            depth_acceptance.add(0, K, K, context_draft(draft).token_classes())


def test_a_burst_of_untested_drafts_is_verified_a_little_at_a_time():
    """Guards the exposure bound in ``CostAwareCut.apply``: without it, all 64 drafts
    are kept whole on estimates no kept token has been checked against."""
    from vllm_lookahead.lookahead.cut import MIN_EXPOSURE

    drafts = [list(range(1, K + 1)) for _ in range(64)]
    estimates = WorkerEstimates(K, NUM_TOKEN_CLASSES, SUPPORT_BINS)
    trust(estimates, drafts[0])
    # 30 free tokens: a token sure to be accepted pays at batch 64
    assert sum(cut_for(estimates, drafts, free_tokens=30)) == MIN_EXPOSURE
    assert cut_for(estimates, drafts[:1]) == [K]  # a request alone is never held back
    assert sum(cut_for(estimates, drafts, free_tokens=600)) == 64 * K  # nor free tokens
    for _ in range(60):  # 480 kept tokens checked, as estimated
        estimates.calibrations[0].add(np.full(K, 0.97), np.ones(K, bool))
    assert sum(cut_for(estimates, drafts, free_tokens=30)) == 240
    for _ in range(100):  # ... and once enough were, the cut decides alone
        estimates.calibrations[0].add(np.full(K, 0.97), np.ones(K, bool))
    assert sum(cut_for(estimates, drafts, free_tokens=30)) == 64 * K


def test_the_report_compares_kept_estimates_with_the_text():
    report = AcceptanceCalibration()
    report.add(np.array([0.95, 0.85, 0.15]), np.array([True, False, False]))
    rows = {row["estimate_from"]: row for row in report.table()}
    assert rows[0.9]["tokens"] == 1 and rows[0.9]["matched_rate"] == 1.0
    assert rows[0.8]["matched_rate"] == 0.0 and rows[0.1]["mean_estimate"] == 0.15


def test_hindsight_hands_over_a_draft_once_every_token_is_settled():
    hindsight = Hindsight()
    kept = (np.array([0.9, 0.8]), np.array([0.5, 0.4]))
    hindsight.propose(start=2, tokens=np.array([5, 6, 7]), classes=np.zeros(3, int), kept=2,
                      max_pending=4, first_estimate=0.9, kept_estimates=kept)
    context = np.array([1, 2, 5, 6, 9, 9])
    (first,) = hindsight.settle(context, num_tokens=3)  # only the first token generated
    assert first.settled is None
    (second,) = hindsight.settle(context, num_tokens=6)  # 6 matched, 7 did not
    assert second.settled is not None and second.settled.kept_estimates is kept
    assert second.settled.hits().tolist() == [True, True, False]


def test_the_compiled_counts_and_estimates_equal_their_numpy_statement():
    """Guards the compiled kernels that count settled drafts and estimate the cut's
    tokens (``calibration.py``, ``budget.py``, ``cut.py``): equal to the numpy they
    replaced, to the bit, at the bins' edges too (the proposer's decisions must not
    move)."""
    from vllm_lookahead.lookahead.budget import AcceptanceByDepth, survival_along
    from vllm_lookahead.lookahead.cut import _draft_estimates

    rng = np.random.default_rng(0)
    estimates = np.concatenate(([0.0, 0.1, 0.3, 0.7, 0.9, 1.0], rng.random(200)))
    hits = rng.random(len(estimates)) < 0.5
    calibration = AcceptanceCalibration()
    for start in range(0, len(estimates), 7):  # drafts of 7 tokens, one after another
        calibration.add(estimates[start:start + 7], hits[start:start + 7])
    bins = np.minimum((estimates * 10).astype(np.int64), 9)
    for counted, values in ((calibration.tokens, 1.0), (calibration.expected, estimates),
                            (calibration.matched, hits)):
        reference = np.zeros(10)
        np.add.at(reference, bins, values)
        assert np.array_equal(counted, reference)
    factors = calibration.factors()
    assert np.array_equal(calibrated(estimates, factors),
                          np.minimum.accumulate(estimates * factors[bins]))

    classes = rng.integers(0, NUM_TOKEN_CLASSES, K)
    depth = AcceptanceByDepth(K, NUM_TOKEN_CLASSES, group_size=SUPPORT_BINS)
    reached, accepted = np.zeros((NUM_TOKEN_CLASSES, K)), np.zeros((NUM_TOKEN_CLASSES, K))
    for first, compared, confirmed in ((0, 3, 2), (1, 7, 7), (2, 4, 0), (0, 8, 5)):
        depth.add(first, compared, confirmed, classes)
        checked = np.arange(first, first + compared)
        np.add.at(reached, (classes[checked], checked), 1)
        np.add.at(accepted, (classes[checked][:confirmed], checked[:confirmed]), 1)
    assert np.array_equal(depth._reached, reached)
    assert np.array_equal(depth._accepted, accepted)
    rates = depth.conditional_rates()
    raw, fitted = _draft_estimates(classes, 0.7, rates, factors)
    assert np.array_equal(raw, 0.7 * survival_along(rates, classes))
    assert np.array_equal(fitted, np.minimum.accumulate(raw * factors[np.minimum(
        (raw * 10).astype(np.int64), 9)]))

