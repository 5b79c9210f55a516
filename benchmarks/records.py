"""Raw numbers the harness keeps: one record per request, and vLLM's spec-decode counters.

Both the offline step loop and the HTTP client fill the same `RequestRecord`, so
every mode counts tokens, forward passes and times the same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from vllm_lookahead.metrics import (
    ACCEPTED_SOURCES,
    ACCEPTED_TOKENS,
    COUNTERS,
    LOOKAHEAD_COUNTERS,
    LOOKAHEAD_GAUGES,
)

SPEC_DECODE_PREFIX = "vllm:spec_decode_"
DRAFTS = SPEC_DECODE_PREFIX + "num_drafts"
DRAFT_TOKENS = SPEC_DECODE_PREFIX + "num_draft_tokens"
ACCEPTED = SPEC_DECODE_PREFIX + "num_accepted_tokens"
ACCEPTED_PER_POS = SPEC_DECODE_PREFIX + "num_accepted_tokens_per_pos"
#: The proposer's counters a measurement reports (``proposer_delta``).
PROPOSER_FIELDS = ("steps", "seconds", "kept_tokens_expected", "kept_tokens_matched",
                   "cut_tokens", "cut_tokens_confirmed", "undrafted_steps", "resting_drafts",
                   "baseline_steps", "tree_steps", "tree_nodes")
#: The cut's fitted step cost at the end of a measurement (gauges).
STEP_COST_FIELDS = ("step_fixed_seconds", "step_token_seconds")


@dataclass
class RequestRecord:
    """One request (one turn of a conversation), times from time.perf_counter()."""

    conversation: int
    turn: int
    prompt_tokens: int
    started: float
    output: list[int] = field(default_factory=list)
    forward_passes: int = 0  # engine steps (offline) or stream chunks (server) carrying tokens
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    spec_decode: SpecDecodeCounters | None = None  # only where one request ran at a time

    def add_tokens(self, now: float, tokens: list[int]) -> None:
        """Tokens that one forward pass of the target produced for this request."""
        if not tokens:
            return
        self.output.extend(tokens)
        self.forward_passes += 1
        if self.first_token is None:
            self.first_token = now
        self.last_token = now

    def to_json(self, sample_id: str, category: str) -> dict:
        first = self.first_token if self.first_token is not None else self.finished
        last = self.last_token if self.last_token is not None else self.finished
        return {
            "id": sample_id,
            "category": category,
            "turn": self.turn + 1,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output,
            "forward_passes": self.forward_passes,
            "seconds": self.finished - self.started,
            "ttft": first - self.started,
            "decode_seconds": last - first,  # first token to last token
            "spec_decode": asdict(self.spec_decode) if self.spec_decode else None,
        }


@dataclass
class SpecDecodeCounters:
    """vLLM's cumulative spec-decode counters; subtract two snapshots for a run's share."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, 1)

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(before, -1)

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine, theirs = (_padded(c.accepted_per_pos, width) for c in (self, other))
        return SpecDecodeCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [a + sign * b for a, b in zip(mine, theirs)],
        )

    @classmethod
    def from_step_stats(cls, stats) -> SpecDecodeCounters:
        """From one step's `SpecDecodingStats` (what the engine hands its stat loggers)."""
        return cls(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                   list(stats.num_accepted_tokens_per_pos))

    @classmethod
    def from_prometheus(cls, text: str) -> SpecDecodeCounters:
        """From the server's /metrics text (names with `_total`; summed over label sets)."""
        counters = cls()
        per_pos: dict[int, int] = {}
        for name, labels, text_value in prometheus_samples(text):
            if not name.startswith(SPEC_DECODE_PREFIX):  # other gauges may be NaN or +Inf
                continue
            value = int(float(text_value))
            if name == DRAFTS + "_total":
                counters.drafts += value
            elif name == DRAFT_TOKENS + "_total":
                counters.draft_tokens += value
            elif name == ACCEPTED + "_total":
                counters.accepted += value
            elif name == ACCEPTED_PER_POS + "_total":
                position = int(re.search(r'position="(\d+)"', labels)[1])
                per_pos[position] = per_pos.get(position, 0) + value
        counters.accepted_per_pos = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
        return counters


PROMETHEUS_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def prometheus_samples(text: str) -> Iterator[tuple[str, str, str]]:
    """(name, labels, value) of each sample line of a /metrics text, as written."""
    for line in text.splitlines():
        match = PROMETHEUS_SAMPLE.match(line)
        if match:
            yield match["name"], match["labels"] or "", match["value"]


def proposer_counters(text: str) -> dict[str, float]:
    """The proposer's counters from the server's /metrics text, by ``ProposerStats``
    field (summed over label sets; empty for methods that export none), with the cut's
    fitted step cost. The workers' counters reach /metrics at most once a second while
    drafting (vllm_lookahead.metrics), so the last second may be missing."""
    fields = {f"{name}_total": field for name, field, _ in (*COUNTERS, *LOOKAHEAD_COUNTERS)}
    fields.update((name, field) for name, field, _ in LOOKAHEAD_GAUGES
                  if field in STEP_COST_FIELDS)
    counts: dict[str, float] = {}
    for name, labels, value in prometheus_samples(text):
        if name == f"{ACCEPTED_TOKENS[0]}_total":
            field = ACCEPTED_SOURCES[re.search(r'source="([^"]*)"', labels)[1]]
        elif name in fields:
            field = fields[name]
        else:
            continue
        counts[field] = counts.get(field, 0) + float(value)
    return counts


def proposer_delta(before: dict | None, after: dict | None) -> dict | None:
    """A measurement's share of the proposer's counters (``ProposerStats`` fields, or
    ``proposer_counters``): steps, seconds, the cut's kept tokens (estimated, matched),
    its cut tokens (all, and those the text then matched), the steps it did not draft,
    the steps with trees and their nodes off the main drafts, lookahead's accepted tokens
    by draft source; and the step cost the cut fitted by the end."""
    if not before or not after:
        return None
    delta = {field: after[field] - before.get(field, 0) for field in PROPOSER_FIELDS
             if field in after}
    delta.update((field, after[field]) for field in STEP_COST_FIELDS if field in after)
    if any(field in after for field in ACCEPTED_SOURCES.values()):
        delta["accepted_by_source"] = {
            source: after.get(field, 0) - before.get(field, 0)
            for source, field in ACCEPTED_SOURCES.items()}
    return delta


def _padded(values: list[int], width: int) -> list[int]:
    return list(values) + [0] * (width - len(values))


def round_json(conversations: range, wall_seconds: float,
               records: list[RequestRecord]) -> dict:
    """One round of an interleaved measurement, for paired speedups (metrics.py)."""
    return {"conversations": [conversations.start, conversations.stop],
            "wall_seconds": wall_seconds,
            "output_tokens": sum(len(record.output) for record in records)}


def measurement_json(mode: str, dataset: str, concurrency: int, wall_seconds: float,
                     engine_steps: int | None, spec_decode: SpecDecodeCounters,
                     proposer: dict | None, records: list[RequestRecord], samples,
                     startup_seconds: float) -> dict:
    """One measurement as stored in the results JSON; `samples[i]` is conversation i."""
    ordered = sorted(records, key=lambda r: (r.conversation, r.turn))
    return {
        "mode": mode,
        "dataset": dataset,
        "concurrency": concurrency,
        "wall_seconds": wall_seconds,
        "engine_steps": engine_steps,  # steps that returned tokens (offline modes)
        "spec_decode": asdict(spec_decode),
        "proposer": proposer,
        "startup_seconds": startup_seconds,
        "requests": [r.to_json(samples[r.conversation].id, samples[r.conversation].category)
                     for r in ordered],
    }
