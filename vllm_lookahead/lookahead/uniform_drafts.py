"""Drafts filled to K tokens, so that a decode step replays a full CUDA graph.

vLLM's model runner replays its full CUDA graph of a decode step only for a *uniform*
batch: every request computes exactly 1 + K tokens. Any other speculative step runs
piecewise, its attention launched layer by layer from Python, which for a small model
at a small batch costs more than the whole graph (H200, SmolLM2-135M at batch 1: a
plain decode step 1.5 ms, a speculative one 4.3-5.5 ms; benchmarks/README.md, run
(bk)). Lookahead's drafts stop where its estimates do, so its steps are rarely
uniform; where the runner has such graphs it can fill every draft to K with its next
best guesses: those tokens are nearly free there, sometimes accepted, and the target's
predictions at them feed the pool like a Jacobi window.

Whether filling pays is measured, not assumed: step times are kept by batch size for
uniform and other decode steps, filling stays on while uniform steps are no slower,
and the shape that lost is tried again every ``PROBE_INTERVAL`` steps. Filling never
removes a token the drafts had, so equal step times mean at least as many tokens.
Each shape is judged by the median of its recent steps: the first filled steps pay
one-time costs (numba compiling the sources' new paths), and on an H100 one such step
of about 0.4 s made a mean of eleven 37 ms where the step took 3 ms, which kept
filling off for a whole run (benchmarks/README.md, run (bp)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the sources compile with numba, which options.py must not import
    from vllm_lookahead.lookahead.sources.pool import NgramPool
    from vllm_lookahead.lookahead.sources.recycled import RecycledTopK

#: Steps of a shape (uniform or not) timed at a batch size before their times are
#: compared; and the most recent steps whose median stands for the shape.
MIN_TIMED = 4
TIME_MEMORY = 20
#: Steps at a batch size between two tries of the shape that was slower.
PROBE_INTERVAL = 32


class UniformDrafts:
    """When to fill the step's drafts to K.

    ``mode``: ``on`` fills whenever the batch can be uniform (every request decoding,
    none bounded below K); ``auto`` only where the runner replays a full graph for a
    uniform batch of that size and uniform steps were measured no slower; ``off``
    never."""

    def __init__(self, mode: str, num_speculative_tokens: int):
        self.mode = mode
        self.query_len = 1 + num_speculative_tokens
        #: most requests whose uniform step replays a full graph (None: not read yet)
        self.graph_requests: int | None = None
        self._keep_times(0)

    def set_graph_requests(self, max_requests: int) -> None:
        self.graph_requests = max_requests
        self._keep_times(max_requests)

    def _keep_times(self, max_requests: int) -> None:
        """Room, by [batch size, uniform], for the last TIME_MEMORY step times (a ring),
        their median, and how many steps were timed."""
        self._seconds = np.zeros((max_requests + 1, 2, TIME_MEMORY))
        self._median_seconds = np.zeros((max_requests + 1, 2))
        self._timed = np.zeros((max_requests + 1, 2), dtype=np.int64)
        self._since_probe = np.zeros(max_requests + 1, dtype=np.int64)

    @property
    def may_fill(self) -> bool:
        """Some step may be filled (``on``, or ``auto`` where the runner has the graphs)."""
        return self.mode == "on" or (self.mode == "auto" and bool(self.graph_requests))

    def wanted(self, num_rows: int, num_decoding: int, bounds: np.ndarray) -> bool:
        """Fill this step's drafts: ``num_rows`` input rows, of which ``num_decoding``
        draft (the others are prompt chunks), whose drafts may hold ``bounds`` tokens
        (K, less near ``max_model_len`` or by a request's own K)."""
        if not self.may_fill or not num_decoding or num_decoding != num_rows \
                or int(bounds.min()) != self.query_len - 1:
            return False
        if self.mode == "on":
            return True
        if num_rows > self.graph_requests:
            return False
        timed = self._timed[num_rows]
        if timed.min() < MIN_TIMED:  # time both shapes first, uniform first
            return bool(timed[1] < MIN_TIMED)
        median = self._median_seconds[num_rows]
        uniform_wins = bool(median[1] <= median[0])
        self._since_probe[num_rows] += 1
        if self._since_probe[num_rows] >= PROBE_INTERVAL:
            self._since_probe[num_rows] = 0
            return not uniform_wins
        return uniform_wins

    def timed(self, num_requests: int, num_tokens: int, seconds: float) -> bool:
        """A decode step of ``num_requests`` computing ``num_tokens`` took ``seconds``;
        False if its time says nothing about its token count (a uniform step that
        replayed a full graph): the step-cost fit must not take it."""
        if not self.graph_requests or not 0 < num_requests <= self.graph_requests:
            return True
        uniform = int(num_tokens == num_requests * self.query_len)
        count = int(self._timed[num_requests, uniform])
        recent = self._seconds[num_requests, uniform]
        recent[count % TIME_MEMORY] = seconds
        self._timed[num_requests, uniform] = count + 1
        # the lower median: one outlier among MIN_TIMED steps never decides
        window = recent[: min(count + 1, TIME_MEMORY)]
        middle = (len(window) - 1) // 2
        self._median_seconds[num_requests, uniform] = np.partition(window, middle)[middle]
        return not uniform


def fill_draft(tokens: list[int], pending_token: int, length: int, pool: NgramPool,
               guess_set_size: int, recycled: RecycledTopK | None) -> int:
    """Extend ``tokens`` (a request's draft after ``pending_token``) to ``length`` with
    its next best guesses, whatever their estimated probability: the pool's most
    frequent continuation of the last token, then the target's recycled most likely
    next tokens, then the last token repeated (runs of spaces, newlines, brackets).
    Returns the tokens added."""
    start = len(tokens)
    key = tokens[-1] if tokens else pending_token
    while len(tokens) < length:
        best = pool.best(key, guess_set_size)
        if best is None:
            break
        tokens.extend(best[0])
        key = tokens[-1]
    if recycled is not None and len(tokens) < length:
        chain, _ = recycled.chain(key, length - len(tokens), 1.0, 0.0)
        tokens.extend(chain)
        key = tokens[-1] if tokens else key
    tokens.extend([key] * (length - len(tokens)))
    del tokens[length:]
    return len(tokens) - start
