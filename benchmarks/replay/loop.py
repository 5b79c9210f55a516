"""The replay loop: recorded greedy generations verified against a proposer's drafts,
a batch of requests at a time, on an optional simulated clock."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.replay.replayers import Replayer, accepted_length


@dataclass
class Request:
    dataset: str
    category: str
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class StepCost:
    """A simulated decode pass, seconds: ``fixed`` + ``per_token`` x its requests +
    ``per_draft`` x its draft tokens (``per_token`` where None), + ``verify`` if it has
    any draft token (vLLM's rejection sampler and its metadata)."""

    fixed: float
    per_token: float
    per_draft: float | None = None
    verify: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        """``FIXED_MS,TOKEN_MS[,DRAFT_MS[,VERIFY_MS]]``, e.g. ``30,1.1``, ``16,1.07,0.8``
        or ``40,1.7,1.7,3``."""
        try:
            values = [float(item) for item in text.split(",")]
            if not 2 <= len(values) <= 4:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(
                "--step-cost expects FIXED_MS,TOKEN_MS[,DRAFT_MS[,VERIFY_MS]] (e.g. "
                f"30,1.1), got {text!r}") from None
        if (not all(map(math.isfinite, values)) or min(values[:1] + values[3:]) < 0
                or min(values[1:3]) <= 0):
            raise argparse.ArgumentTypeError(
                "--step-cost: FIXED_MS and VERIFY_MS must be >= 0, TOKEN_MS and DRAFT_MS "
                f"> 0 (finite), got {text!r}")
        return cls(*(value / 1e3 for value in values))

    @property
    def draft_token(self) -> float:
        """Seconds a draft token adds."""
        return self.per_token if self.per_draft is None else self.per_draft

    def __call__(self, num_tokens: int, num_requests: int | None = None) -> float:
        """A pass of ``num_tokens``, ``num_requests`` of them requests' own (None: all)."""
        requests = num_tokens if num_requests is None else num_requests
        return self.fixed + self.per_token * requests + (self.draft_token * (
            num_tokens - requests) + self.verify if num_tokens > requests else 0.0)

    @property
    def label(self) -> str:
        per_token = (f"{self.per_token * 1e3:g} ms/token" if self.per_draft is None else
                     f"{self.per_token * 1e3:g} ms/request + {self.per_draft * 1e3:g} "
                     "ms/draft token")
        verify = f" + {self.verify * 1e3:g} ms with drafts" if self.verify else ""
        return (f"{self.fixed * 1e3:g} ms + {per_token}{verify} "
                f"({self.fixed / self.draft_token:.0f} free tokens)")


class SimulatedClock:
    """The time a replayed proposer reads, moved by the replay loop."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Running:
    """A request in the batch: its place in the trace, its output, and its counts so
    far (its first token came from the prefill pass)."""

    index: int
    output: list[int]
    sampled: list[int]
    done: int = 1
    passes: int = 1
    drafted: int = 0
    seconds: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.done < len(self.output)


def replay(make_replayer: Callable[[], Replayer], trace: list[Request],
           step_cost: StepCost | None = None, oracle_cut: bool = False
           ) -> list[tuple[int, int, int, float]]:
    """(generated tokens, forward passes, draft tokens verified, simulated decode
    seconds) per request, in the trace's order; the seconds are 0 without
    ``step_cost``. ``oracle_cut``: each draft is verified as far as it will be
    accepted, no further.

    Requests run as many at a time as the replayer has rows (``batch_size``), like a
    server at that concurrency: each decode pass verifies the draft of every request in
    the batch, and a finished request's row goes to the next request of the trace that
    may start (a conversation's next turn only once its last turn has finished). A
    pass's simulated time is shared among its requests by their tokens in it. Each
    dataset gets a fresh proposer, as each gets a fresh engine in benchmarks.run
    (Spec-Bench repeats MT-Bench's questions: a shared memory would see the answers).
    The prefill pass counts as one forward pass (it yields the first token), not as
    decode time.
    """
    results: list = [None] * len(trace)
    clock = SimulatedClock()
    for dataset in dict.fromkeys(request.dataset for request in trace):
        replayer = make_replayer()
        if step_cost is not None:
            replayer.use_clock(clock, step_cost)
        waiting = [i for i, request in enumerate(trace) if request.dataset == dataset]
        previous_turns = _previous_turns(waiting, trace)
        rows: list[_Running | None] = [None] * replayer.batch_size
        while waiting or any(rows):
            for row, running in enumerate(rows):
                ready = (i for i in waiting if previous_turns.get(i) is None
                         or results[previous_turns[i]] is not None)  # that turn finished
                if running is None and (index := next(ready, None)) is not None:
                    waiting.remove(index)
                    rows[row] = _admit(replayer, row, index, trace)
            if any(running and running.decoding for running in rows):
                _decode_pass(replayer, rows, step_cost, oracle_cut, clock)
            for row, running in enumerate(rows):
                if running is not None and not running.decoding:
                    replayer.finish(row)
                    results[running.index] = (len(running.output), running.passes,
                                              running.drafted, running.seconds)
                    rows[row] = None
    return results


def _previous_turns(indices: list[int], trace: list[Request]) -> dict[int, int]:
    """Each request's previous turn in its conversation: the latest earlier request
    whose prompt begins its own prompt (a chat template repeats the conversation so
    far)."""
    previous = {}
    for n, i in enumerate(indices):
        prompt = trace[i].prompt
        for j in reversed(indices[:n]):
            earlier = trace[j].prompt
            if len(earlier) < len(prompt) and prompt[: len(earlier)] == earlier:
                previous[i] = j
                break
    return previous


def _admit(replayer: Replayer, row: int, index: int, trace: list[Request]) -> _Running:
    """The request takes the row; its prefill pass yields its first token."""
    request = trace[index]
    replayer.start(row, f"replay-{index}", request.prompt, request.output)
    replayer.append(row, request.output[:1])
    return _Running(index, request.output, request.output[:1])


def _decode_pass(replayer: Replayer, rows: list[_Running | None], step_cost: StepCost | None,
                 oracle_cut: bool, clock: SimulatedClock) -> None:
    """Every decoding request's draft verified in one pass: each gets the accepted
    tokens and one more."""
    decoding = [running if running and running.decoding else None for running in rows]
    drafts = replayer.propose([running.sampled if running else [] for running in decoding])
    drafts = [draft[: replayer.k] for draft in drafts]
    if oracle_cut:
        drafts = [draft[: accepted_length(draft, running.output, running.done)] if running
                  else [] for draft, running in zip(drafts, decoding)]
    num_requests = sum(running is not None for running in decoding)
    num_tokens = num_requests + sum(len(draft) for draft in drafts)
    seconds = 0.0
    if step_cost is not None:
        replayer.before_pass(num_tokens, num_requests)
        seconds = step_cost(num_tokens, num_requests)
        clock.now += seconds
    for row, (running, draft) in enumerate(zip(decoding, drafts)):
        if running is None:
            continue
        running.drafted += len(draft)
        running.seconds += seconds * (1 + len(draft)) / num_tokens
        accepted = replayer.accepted(row, draft, running.output, running.done)
        running.sampled = running.output[running.done : running.done + accepted + 1]
        replayer.append(row, running.sampled)
        running.done += len(running.sampled)
        running.passes += 1


def summarize(trace: list[Request], results: list[tuple[int, int, int, float]]
              ) -> dict[str, tuple[float, float, float | None]]:
    """(S, draft tokens per pass, simulated decode tokens/s or None where passes were
    not timed) for all requests, per dataset and per category."""
    totals: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(5))
    for request, counts in zip(trace, results):
        for key in ("all", request.dataset, f"{request.dataset}/{request.category}"):
            totals[key] += (*counts, 1)
    return {key: (tokens / passes, drafted / passes,
                  # each request's first token comes from its prefill pass
                  (tokens - requests) / seconds if seconds else None)
            for key, (tokens, passes, drafted, seconds, requests) in sorted(totals.items())}
