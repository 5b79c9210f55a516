"""What one more verified token costs the target on this device, measured once at
start-up where the drafter asks (trees ``auto``; ``start_up.check_at_start``).

A GPU at small batch computes a pass of 30 tokens in about the time of one, a small
CPU takes a few percent more per token. Before the first request, each worker times
forward passes of the target with ``SIZES`` query tokens, through the serving model,
metadata builders, kernels and dtype (eager, as tree steps run), in KV blocks no
request holds yet; the first tensor-parallel rank's numbers count for all ranks. The
cost-aware cut starts from the curve through all sizes (not a line: on a 2-core AVX2
CPU 3 and 5 tokens cost alike, 9 a quarter more) and the online cost model
(``lookahead/step_cost.py``) then keeps deciding per step, under load too; the free
tokens (the cost of one token against ``1 + EXTRA_TOKENS``) are reported. Whether
steps grow trees is measured while serving (``lookahead/tree_choice.py``): the pass's
cost alone kept trees off where they paid (issue 93).

| vLLM attribute | use | why | verified on |
|---|---|---|---|
| what ``tree_check.forward_sequence`` calls (its table) | called | the passes timed | 0.32.0, 0.26.0 (CPU) |
| ``runner.device``, ``runner.model_config.get_vocab_size()`` | read | where to synchronize; token ids | 0.32.0, 0.26.0 (CPU) |
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker import tree_check
from vllm_lookahead.worker.scratch import kv_block_size

#: Query tokens the longest pass adds (about a tree's nodes).
EXTRA_TOKENS = 32
#: Query tokens of the passes timed (powers of two apart, past a draft's first few).
SIZES = (1, 2, 3, 5, 9, 17, 1 + EXTRA_TOKENS)
#: Timed rounds of passes, each size once a round (after one untimed round); the
#: fastest pass of each size counts. On a device nothing else uses, a pass's time only
#: ever grows (launch jitter, a collection pause, a clock change): on an H100, where a
#: pass of 33 tokens takes about what one does, the medians of three rounds found 1210
#: free tokens in one engine and 11 in the next (benchmarks/README.md, run (bq)).
REPEATS = 5


@dataclass(frozen=True)
class StartCost:
    pass_seconds: float  # a pass of one query token (nan: not measured)
    token_seconds: float  # each query token more, on average up to 1 + EXTRA_TOKENS
    reason: str = ""  # why it could not be measured
    sizes: tuple[int, ...] = ()  # query tokens of the passes timed
    size_seconds: tuple[float, ...] = ()  # their fastest times

    @property
    def fixed_seconds(self) -> float:
        """The pass's time less its one token's: t(n) = fixed_seconds + token_seconds n."""
        return self.pass_seconds - self.token_seconds

    @property
    def free_tokens(self) -> float:
        """The pass's fixed cost in units of one more token's (0 if not measured)."""
        if self.reason or math.isnan(self.pass_seconds):
            return 0.0
        if self.token_seconds <= 0:
            return math.inf
        return max(self.fixed_seconds, 0.0) / self.token_seconds

    def describe(self) -> str:
        if self.reason:
            return f"start-up cost not measured ({self.reason})"
        return (f"a forward pass takes {self.pass_seconds * 1e3:.2f} ms and each token "
                f"more {self.token_seconds * 1e3:.3f} ms here: {self.free_tokens:.0f} "
                "free tokens")


@torch.inference_mode()
def measure(runner: Any) -> StartCost:
    """Time the target's passes on ``runner`` (every rank runs them: tensor-parallel
    passes are collective); the first rank's result."""
    try:
        cost = _timed_passes(runner)
    except Exception as exc:  # noqa: BLE001 - no measurement: the cut learns online
        cost = StartCost(math.nan, math.nan, f"{type(exc).__name__}: {exc}")
    return runner_state.broadcast_from_first_tp_rank(cost)


def _timed_passes(runner: Any) -> StartCost:
    block_size = kv_block_size(runner)
    longest = SIZES[-1]
    blocks = tree_check.free_blocks(runner)[: -(-longest // block_size)]
    if len(blocks) * block_size < longest or runner.max_model_len < longest:
        raise tree_check.CannotRun("the KV cache has too few free blocks")
    table = np.array([blocks], dtype=np.int32)
    tokens = np.random.default_rng(0).integers(runner.model_config.get_vocab_size(),
                                               size=longest)

    def seconds(size: int) -> float:
        positions = np.arange(size)
        _synchronize(runner.device)
        start = time.perf_counter()
        tree_check.forward_sequence(runner, tokens[:size], positions, table, seq_len=size,
                                    slots=tree_check.slots_of(table, positions, block_size))
        _synchronize(runner.device)
        return time.perf_counter() - start

    for size in SIZES:  # warm-up: kernels are chosen, and compiled, by shape
        seconds(size)
    return summarize(np.array([[seconds(size) for size in SIZES] for _ in range(REPEATS)]))


def summarize(rounds: np.ndarray) -> StartCost:
    """The cost read from timed ``rounds`` (one row a round, one column per size of
    ``SIZES``): each size's fastest pass; one token more costs the difference between
    the longest and the one-token pass, spread over its ``EXTRA_TOKENS``."""
    fastest = rounds.min(axis=0)
    extra = max(float(fastest[-1] - fastest[0]), 0.0) / EXTRA_TOKENS
    return StartCost(pass_seconds=float(fastest[0]), token_seconds=extra, sizes=SIZES,
                     size_seconds=tuple(fastest.tolist()))


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
