"""The auxiliary model on transformers, for where vLLM cannot run it (tensor
parallelism: vLLM would shard it over the ranks, while MTAD drafts on the first rank
only; or a model vLLM cannot load). ``paged_drafter.py`` is the normal path.

One dense cache per request holds its committed context only; the beams of all
requests run on a scratch copy (one row per beam, left-padded) that is dropped after
drafting, so a rejected draft needs no rollback.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lookahead.mtad.beams import AuxiliaryState, Beams, BeamSampler, DraftJob


def load_auxiliary_model(name: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).eval()


class TransformersDrafter:
    """Beam sampling with a transformers model; the beam steps of all requests of a
    vLLM step run as one batch."""

    def __init__(self, model: Any, sampler: BeamSampler):
        self.model = model
        self.sampler = sampler
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Beams]:
        """Each job's beams after ``job.length`` steps."""
        beams = [self.sampler.start(self._extend(job.state, job.context), job.argmax)
                 for job in jobs]
        steps = max((job.length for job in jobs), default=0)
        if steps > 1:
            self._beam_steps(jobs, beams, steps)
        return beams

    def _extend(self, state: AuxiliaryState, context: np.ndarray) -> torch.Tensor:
        """Feed the request's new committed tokens; the next-token distribution."""
        if state.cache is None:
            from transformers import DynamicCache

            state.cache = DynamicCache(config=self.model.config)
        new_tokens = torch.as_tensor(context[state.length:], device=self.device)[None]
        logits = self.model(input_ids=new_tokens, past_key_values=state.cache,
                            use_cache=True, logits_to_keep=1).logits[0, -1]
        state.length = len(context)
        return self.sampler.distribution(logits)

    def _beam_steps(self, jobs: list[DraftJob], beams: list[Beams], steps: int) -> None:
        """Steps 2..``steps`` of every job's beams, as one batch over a scratch cache
        (each request's cache repeated per beam, left-padded to the longest); a job
        whose draft is complete keeps its beams while the others go on."""
        rows, first = [], 0
        for b in beams:
            rows.append(slice(first, first + b.count))
            first += b.count
        cache, mask, positions = self._scratch_cache(jobs, rows)
        for step in range(1, steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            last = torch.cat([b.history[:, -1:] for b in beams])
            logits = self.model(input_ids=last, attention_mask=mask,
                                position_ids=positions + step - 1, past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1]
            q_all = self.sampler.distribution(logits)
            order = []
            for job, b, own in zip(jobs, beams, rows):
                own_rows = torch.arange(own.start, own.stop, device=self.device)
                if step >= job.length:
                    order.append(own_rows)
                    continue
                order.append(own_rows[self.sampler.extend(b, q_all[own], job.argmax)])
            if step < steps - 1:
                cache.reorder_cache(torch.cat(order))

    def _scratch_cache(self, jobs: list[DraftJob], rows: list[slice]):
        """(cache, attention mask, next positions) for all beams, left-padded."""
        from transformers import DynamicCache

        count = rows[-1].stop
        longest = max(job.state.length for job in jobs)
        mask = torch.zeros(count, longest, dtype=torch.long, device=self.device)
        positions = torch.zeros(count, 1, dtype=torch.long, device=self.device)
        for job, own in zip(jobs, rows):
            mask[own, longest - job.state.length:] = 1
            positions[own] = job.state.length
        scratch = DynamicCache(config=self.model.config)
        for index, layer in enumerate(jobs[0].state.cache.layers):
            padded = []
            for part in ("keys", "values"):
                heads, _, dim = getattr(layer, part).shape[1:]
                out = getattr(layer, part).new_zeros(count, heads, longest, dim)
                for job, own in zip(jobs, rows):
                    cached = getattr(job.state.cache.layers[index], part)
                    out[own, :, longest - job.state.length:] = cached[0]
                padded.append(out)
            scratch.update(*padded, index)
        return scratch, mask, positions
