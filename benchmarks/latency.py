"""Batch-1 latency measurement that counts target forward passes itself.

Requests run one after another through the engine's step loop (engine_loop.py).
Every step that returns a request's new tokens is one forward pass of the target
for it, so the compression ratio S = generated tokens / forward passes is counted
the same way for every method (no speculation, vLLM's ngram and suffix, ours), not
inferred from a method's own statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.engine_loop import drive


@dataclass
class LatencyResult:
    outputs: list[list[int]] = field(default_factory=list)
    generated_tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def compression(self) -> float:
        """S: generated tokens per target forward pass (prefill included)."""
        return self.generated_tokens / self.forward_passes


def run_one_by_one(llm, prompts: list[list[int]], sampling_params) -> LatencyResult:
    """Generate each token-id prompt alone (batch size 1), timing only the generation."""
    loop = drive(llm.llm_engine, lambda i, answers: None if answers else prompts[i],
                 len(prompts), sampling_params, max_in_flight=1)
    result = LatencyResult()
    for record in sorted(loop.records, key=lambda r: r.conversation):
        result.outputs.append(record.output)
        result.generated_tokens += len(record.output)
        result.forward_passes += record.forward_passes
        result.seconds += record.finished - record.started
    return result
