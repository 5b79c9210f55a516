"""The auxiliary model and its beam-sampling drafts (MTAD's ``generate_draft``).

The auxiliary model runs outside vLLM's paged KV cache, as a plain transformers
model with one dense cache per request: beam sampling needs B different histories
at the same positions, which vLLM's one-chain draft machinery cannot hold. A
request's cache holds its committed context only; the beams of all requests run on
a scratch copy (one row per beam, left-padded) that is dropped after drafting, so a
rejected draft needs no rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def load_auxiliary_model(name: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).eval()


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
    """A request's auxiliary KV cache over its first ``length`` context tokens."""

    cache: Any = None
    length: int = 0


@dataclass
class DraftJob:
    """One request's draft: ``length`` tokens after ``context`` (its committed tokens)."""

    state: AuxiliaryState
    context: np.ndarray
    length: int
    argmax: bool  # greedy request: the auxiliary model's greedy chain


@dataclass
class _Beams:
    rows: slice  # this job's rows in the batch
    score: torch.Tensor  # [beams] normalized beam scores
    history: torch.Tensor  # [beams, steps] tokens
    logq: torch.Tensor  # [beams, steps] log q of each token


class BeamDrafter:
    """Beam sampling in the auxiliary model; greedy requests get its greedy chain (one
    argmax beam: exact-match verification accepts that chain more often than the most
    likely beam). The beam steps of all requests of a vLLM step run as one batch."""

    def __init__(self, model: Any, beam_width: int, temperature: float, top_k: int,
                 top_p: float, seed: int):
        self.model = model
        self.beam_width = beam_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.device = next(model.parameters()).device
        # one generator per process: every TP rank would draw the same beams, but
        # only the first rank drafts (proposer.py), so this is not relied upon
        self.generator = torch.Generator(self.device).manual_seed(seed)

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[tuple[list[int], list[float]]]:
        """Per job, the best beam and the auxiliary log-probability of each of its
        tokens (log q(x_t | x_<t), not the beam score)."""
        beams, first_row = [], 0
        for job in jobs:
            q = self._extend(job.state, job.context)
            count = 1 if job.argmax else self.beam_width
            tokens = self._choose(q, count, job.argmax)
            picked = q[tokens]
            beams.append(_Beams(slice(first_row, first_row + count), picked / picked.sum(),
                                tokens[:, None], picked.log()[:, None]))
            first_row += count
        steps = max((job.length for job in jobs), default=0)
        if steps > 1:
            self._beam_steps(jobs, beams, steps)
        results = []
        for b in beams:
            best = int(b.score.argmax())
            results.append((b.history[best].tolist(), b.logq[best].tolist()))
        return results

    def _extend(self, state: AuxiliaryState, context: np.ndarray) -> torch.Tensor:
        """Feed the request's new committed tokens; the next-token distribution."""
        if state.cache is None:
            from transformers import DynamicCache

            state.cache = DynamicCache(config=self.model.config)
        new_tokens = torch.as_tensor(context[state.length:], device=self.device)[None]
        logits = self.model(input_ids=new_tokens, past_key_values=state.cache,
                            use_cache=True, logits_to_keep=1).logits[0, -1]
        state.length = len(context)
        return sampling_distribution(logits, self.temperature, self.top_k, self.top_p)

    def _beam_steps(self, jobs: list[DraftJob], beams: list[_Beams], steps: int) -> None:
        """Steps 2..``steps`` of every job's beams, as one batch over a scratch cache
        (each request's cache repeated per beam, left-padded to the longest); a job
        whose draft is complete keeps its beams while the others go on."""
        cache, mask, positions = self._scratch_cache(jobs, beams)
        for step in range(1, steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last = torch.cat([b.history[:, -1:] for b in beams])
            logits = self.model(input_ids=last, attention_mask=mask,
                                position_ids=positions + step - 1, past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1]
            q_all = sampling_distribution(logits, self.temperature, self.top_k, self.top_p)
            order = []
            for job, b in zip(jobs, beams):
                rows = torch.arange(b.rows.start, b.rows.stop, device=self.device)
                if step >= job.length:
                    order.append(rows)
                    continue
                q = q_all[b.rows]
                joint = (b.score[:, None] * q).flatten()
                picks = self._choose(joint, len(rows), job.argmax)
                parent, token = picks // q.shape[-1], picks % q.shape[-1]
                b.score = joint[picks] / joint[picks].sum()
                b.history = torch.cat([b.history[parent], token[:, None]], dim=1)
                b.logq = torch.cat([b.logq[parent], q[parent, token].log()[:, None]], dim=1)
                order.append(rows[parent])
            if step < steps - 1:
                cache.reorder_cache(torch.cat(order))

    def _scratch_cache(self, jobs: list[DraftJob], beams: list[_Beams]):
        """(cache, attention mask, next positions) for all beams, left-padded."""
        from transformers import DynamicCache

        rows = beams[-1].rows.stop
        longest = max(job.state.length for job in jobs)
        mask = torch.zeros(rows, longest, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        for job, b in zip(jobs, beams):
            mask[b.rows, longest - job.state.length:] = 1
            positions[b.rows] = job.state.length
        scratch = DynamicCache(config=self.model.config)
        for index, layer in enumerate(jobs[0].state.cache.layers):
            padded = []
            for part in ("keys", "values"):
                heads, _, dim = getattr(layer, part).shape[1:]
                out = getattr(layer, part).new_zeros(rows, heads, longest, dim)
                for job, b in zip(jobs, beams):
                    own = getattr(job.state.cache.layers[index], part)
                    out[b.rows, :, longest - job.state.length:] = own[0]
                padded.append(out)
            scratch.update(*padded, index)
        return scratch, mask, positions

    def _choose(self, weights: torch.Tensor, beams: int, argmax: bool) -> torch.Tensor:
        if argmax:
            return torch.topk(weights, beams).indices
        return torch.multinomial(weights, beams, replacement=True, generator=self.generator)
