"""Trees ``auto``: whether a step drafts trees, by the tokens a second each shape earns
on this model and host, measured while serving.

A tree step verifies the main draft and, beside it, the pool's candidates, the recycled
top-k and the Jacobi window: it emits every token the main draft alone would have (the
main chain is verified as in a linear step) plus those accepted off it, and takes
longer. Which wins depends on the model and device: on a 2-core CPU, SmolLM2-135M's
tree pass took 56 ms against 38 ms for a linear one while trees raised S 1.48x (a
wash), and Qwen2.5-Coder-1.5B in bf16 on an AMX host gained 11 % from trees where the
start-up pass cost alone had kept them off (issue 93). So the choice is measured, per
batch size:

* ``gain``: tokens emitted by tree steps over the tokens their main drafts alone
  earned (accepted main tokens plus the bonus token), read from the same verifications,
  so the texts' ups and downs cancel out of the ratio;
* ``slowdown``: tree steps' time, each timed from the start of one decode step to the
  next whatever it pays for its shape (drafting, scratch copies, captures, sampling),
  over the time linear steps of their main drafts would have taken: the step-cost
  model's time for that token count (``step_cost.py``, fitted on every decode step),
  or before it has one the mean linear step's. A replayed copy-heavy trace showed why
  not the mean linear step alone: trees tried while long copies were drafted looked
  slow beside linear steps taken in free text, and trees ran 204 of 610 steps where
  they lost (the gain 1.03, the time ratio 1.46).

Trees go on while ``gain >= slowdown``. Both shapes are run ``MIN_STEPS`` times at a
batch size first, alternating; then the shape that lost is run for ``PROBE_STEPS`` now
and then (every ``PROBE_INTERVAL`` steps, backing off while it keeps losing), and older
steps count less (``DECAY`` per step), so the choice follows the workload. What a tree
may cost while it is tried is bounded apart (``trees.grow_trees``). The first
tensor-parallel rank's choice is every rank's (``budget.StepPlan``).
"""

from __future__ import annotations

import numpy as np

from vllm_lookahead.log import get_logger
from vllm_lookahead.worker import runner_state

logger = get_logger(__name__)

#: Steps of each shape at a batch size before the choice is made.
MIN_STEPS = 6
#: Steps of the winning shape between two probes of the other (doubling after each
#: probe that left the choice as it was, up to ``MAX_PROBE_INTERVAL``; back to
#: ``PROBE_INTERVAL`` when the choice turns), and a probe's steps.
PROBE_INTERVAL = 32
MAX_PROBE_INTERVAL = 512
PROBE_STEPS = 2
#: Per-step decay of the sums (about the last 50 steps at a batch size count).
DECAY = 0.98
#: Batch sizes measured apart: 1-4 each, then 5-8, 9-16, ... together.
EXACT_BATCH_SIZES = 4
LINEAR, TREE = 0, 1


def batch_bucket(num_requests: int) -> int:
    """The batch-size class whose steps are compared with each other."""
    if num_requests <= EXACT_BATCH_SIZES:
        return num_requests
    return EXACT_BATCH_SIZES + (num_requests - 1).bit_length() - 2


class ShapeTimes:
    """One batch-size class: decayed sums by shape (time, steps; for tree steps the
    tokens emitted and the tokens their main drafts alone earned) and the probe
    schedule."""

    def __init__(self) -> None:
        self.seconds = np.zeros(2)
        self.steps = np.zeros(2)
        self.counted = np.zeros(2, dtype=np.int64)  # steps measured, undecayed
        self.tree_tokens = 0.0
        self.main_tokens = 0.0
        self.tree_linear_seconds = 0.0  # the tree steps' main drafts, linearly
        self.since_probe = 0
        self.probe_left = 0
        self.probe_interval = PROBE_INTERVAL
        self.choice: int | None = None

    def add(self, shape: int, seconds: float, tokens: int, main_tokens: int,
            linear_seconds: float | None) -> None:
        """Every step decays both shapes' sums alike: after a long run of one shape, a
        probe of the other outweighs what that shape did long ago."""
        if shape == TREE and linear_seconds is None:  # no step-cost estimate
            linear_seconds = (self.seconds[LINEAR] / self.steps[LINEAR]
                              if self.steps[LINEAR] else seconds)
        self.seconds *= DECAY
        self.steps *= DECAY
        self.tree_tokens *= DECAY
        self.main_tokens *= DECAY
        self.tree_linear_seconds *= DECAY
        self.seconds[shape] += seconds
        self.steps[shape] += 1
        self.counted[shape] += 1
        if shape == TREE:
            self.tree_tokens += tokens
            self.main_tokens += main_tokens
            self.tree_linear_seconds += linear_seconds

    @property
    def gain(self) -> float:
        return self.tree_tokens / max(self.main_tokens, 1e-9)

    @property
    def slowdown(self) -> float:
        return float(self.seconds[TREE] / max(self.tree_linear_seconds, 1e-12))

    def next_shape(self) -> tuple[int, int | None]:
        """The shape of the next step, and the choice it replaced (``choice`` unchanged:
        no new choice; None: the first)."""
        if self.counted.min() < MIN_STEPS:  # alternate, trees first
            return int(self.counted[TREE] <= self.counted[LINEAR]), self.choice
        best = TREE if self.gain >= self.slowdown else LINEAR
        before, self.choice = self.choice, best
        if before is not None and best != before:
            self.probe_interval, self.since_probe, self.probe_left = PROBE_INTERVAL, 0, 0
        if self.probe_left:
            self.probe_left -= 1
            return 1 - best, before
        self.since_probe += 1
        if self.since_probe >= self.probe_interval:
            self.since_probe, self.probe_left = 0, PROBE_STEPS - 1
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
            return 1 - best, before
        return best, before


class TreeChoice:
    """Per batch-size class, whether the next step grows trees (``wanted``), from the
    decode steps the proposer reports (``add``)."""

    def __init__(self) -> None:
        self._classes: dict[int, ShapeTimes] = {}

    def _times(self, num_requests: int) -> ShapeTimes:
        bucket = batch_bucket(num_requests)
        if bucket not in self._classes:
            self._classes[bucket] = ShapeTimes()
        return self._classes[bucket]

    def wanted(self, num_requests: int) -> bool:
        times = self._times(num_requests)
        shape, before = times.next_shape()
        if before != times.choice and runner_state.is_first_tp_rank():
            # the first choice at a batch size is news; later turns only while debugging
            log = logger.info if before is None else logger.debug
            log("vllm-lookahead: trees auto, %d request(s) a step: %s (trees emit %.2fx "
                "the tokens of their main drafts, a tree step takes %.2fx a linear one's "
                "time)", num_requests, "trees" if times.choice == TREE else "linear drafts",
                times.gain, times.slowdown)
        return shape == TREE

    def add(self, num_requests: int, tree: bool, seconds: float, tokens: int,
            main_tokens: int, linear_seconds: float | None = None) -> None:
        """A decode step of ``num_requests`` (with trees or not) took ``seconds`` and
        emitted ``tokens``, of which its main drafts alone would have earned
        ``main_tokens`` in a linear step of ``linear_seconds`` (None: not estimated)."""
        self._times(num_requests).add(int(tree), seconds, tokens, main_tokens,
                                      linear_seconds)
