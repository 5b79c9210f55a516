"""MTAD's beam sampling (the paper's ``generate_draft``), whatever runs the auxiliary
model: a request's B beams, each step's choice of B (parent, token) pairs in proportion
to beam score times q, and what a drafter needs to feed the next step.

Greedy requests get the auxiliary model's greedy chain (one argmax beam): exact-match
verification accepts that chain more often than the most likely beam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int,
                          top_p: float) -> torch.Tensor:
    """Rows of ``logits`` as probabilities after temperature, top-k and top-p.

    With top-k, top-p is applied among the k survivors only: no sort of the whole
    vocabulary (150k entries for Qwen) on every beam step.
    """
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kept, index = torch.topk(logits, top_k, dim=-1)  # sorted, largest first
        kept = _cut_top_p(kept, top_p)
        return torch.zeros_like(logits).scatter(-1, index, kept.softmax(dim=-1))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        logits = logits.scatter(-1, order, _cut_top_p(sorted_logits, top_p))
    return logits.softmax(dim=-1)


def _cut_top_p(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Descending logits with the tail beyond probability mass ``top_p`` set to -inf
    (a token is dropped when the tokens before it already cover top_p)."""
    if top_p >= 1.0:
        return sorted_logits
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    return sorted_logits.masked_fill(drop, float("-inf"))


@dataclass
class AuxiliaryState:
    """A request's auxiliary KV cache covers its first ``length`` context tokens
    (``cache``: a dense transformers cache; None where the cache is vLLM's paged one)."""

    cache: Any = None
    length: int = 0


@dataclass
class DraftJob:
    """One request's draft: ``length`` tokens after ``context`` (its committed tokens)."""

    state: AuxiliaryState
    context: np.ndarray
    length: int
    argmax: bool  # greedy request: the auxiliary model's greedy chain
    row: int = 0  # its input-batch row (its block table, for the paged cache)


@dataclass
class Beams:
    """One request's beams after some steps."""

    score: torch.Tensor  # [beams] normalized beam scores
    history: torch.Tensor  # [beams, steps] tokens
    logq: torch.Tensor  # [beams, steps] log q(token | its beam's earlier tokens)

    @property
    def count(self) -> int:
        return self.history.shape[0]

    def best(self) -> tuple[list[int], list[float]]:
        """The highest-scoring beam: its tokens and the log q of each."""
        best = int(self.score.argmax())
        return self.history[best].tolist(), self.logq[best].tolist()

    def ranked(self) -> list[tuple[list[int], list[float]]]:
        """Every distinct beam, best first."""
        seen, result = set(), []
        for beam in torch.argsort(self.score, descending=True).tolist():
            tokens = tuple(self.history[beam].tolist())
            if tokens not in seen:
                seen.add(tokens)
                result.append((list(tokens), self.logq[beam].tolist()))
        return result


class BeamSampler:
    """Chooses beams from the auxiliary model's distributions. One generator per
    process: only one tensor-parallel rank drafts (``proposer.py``)."""

    def __init__(self, beam_width: int, temperature: float, top_k: int, top_p: float,
                 seed: int, device: torch.device):
        self.beam_width = beam_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator(device).manual_seed(seed)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_distribution(logits, self.temperature, self.top_k, self.top_p)

    def start(self, q: torch.Tensor, argmax: bool, beams: int | None = None) -> Beams:
        """First step from the next-token distribution ``q`` (``[vocab]``): ``beams``
        beams (default B; 1 for a greedy request)."""
        count = 1 if argmax else (beams or self.beam_width)
        tokens = self._choose(q, count, argmax)
        picked = q[tokens]
        return Beams(picked / picked.sum(), tokens[:, None], picked.log()[:, None])

    def extend(self, beams: Beams, q: torch.Tensor, argmax: bool) -> torch.Tensor:
        """One more step from each beam's next-token distribution (``q``: ``[beams,
        vocab]``); returns the parent of each new beam."""
        joint = (beams.score[:, None] * q).flatten()
        picks = self._choose(joint, beams.count, argmax)
        parent, token = picks // q.shape[-1], picks % q.shape[-1]
        beams.score = joint[picks] / joint[picks].sum()
        beams.history = torch.cat([beams.history[parent], token[:, None]], dim=1)
        beams.logq = torch.cat([beams.logq[parent], q[parent, token].log()[:, None]], dim=1)
        return parent

    def _choose(self, weights: torch.Tensor, count: int, argmax: bool) -> torch.Tensor:
        if argmax:
            return torch.topk(weights, count).indices
        return torch.multinomial(weights, count, replacement=True, generator=self.generator)
