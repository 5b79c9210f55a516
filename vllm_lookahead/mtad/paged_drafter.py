"""MTAD drafting on vLLM's kernels and paged KV cache (``worker/auxiliary_model.py``).

The auxiliary model's keys and values live in the request's own blocks, beside the
target's (other layers, same block ids). One draft is:

1. *catch-up*: one pass over every request's committed tokens not yet in its cache
   (the tokens accepted since its last draft and the one just sampled; the whole
   context for a new or preempted request), all requests in one batch;
2. *beam steps*: each of the ``length - 1`` passes feeds the last token of every beam
   of every request. Beam 0 writes into the request's own blocks past its context
   (vLLM reserves them as lookahead slots, ``worker/scheduler.py``); beams 1..B-1 have
   scratch blocks held back from vLLM's pool, the first a copy of the request's block
   where the beams start. When beams are re-chosen, a child's blocks become a copy
   of its parent's.

Positions past the context are rewritten by the next catch-up, so a rejected draft
needs no rollback. A request that finds no scratch blocks left drafts one beam.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_lookahead.mtad.beams import Beams, BeamSampler, DraftJob
from vllm_lookahead.worker.auxiliary_model import PagedModel, Sequence


class PagedDrafter:
    def __init__(self, model: PagedModel, sampler: BeamSampler):
        self.model = model
        self.sampler = sampler
        self._scratch: list[int] | None = None  # known once the KV cache exists

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Beams | None]:
        """Each job's beams after ``job.length`` steps (fewer if its blocks end
        sooner); None for a job whose block table cannot hold its context yet."""
        own = [self.model.request_blocks(job.row) for job in jobs]
        size = self.model.block_size
        for job, blocks in zip(jobs, own):
            job.length = min(job.length, len(blocks) * size - len(job.context) + 1)
        ready = [i for i, job in enumerate(jobs) if job.length > 0]
        results: list[Beams | None] = [None] * len(jobs)
        if not ready:
            return results
        first_q = self._catch_up([jobs[i] for i in ready], [own[i] for i in ready])
        if self._scratch is None:
            self._scratch = self.model.beam_blocks()
        free = list(self._scratch)
        tails = {}  # job index -> per beam, its block ids from the block holding position n
        for i, q in zip(ready, first_q):
            job, n = jobs[i], len(jobs[i].context)
            root, last = n // size, (n + job.length - 2) // size
            wanted = 1 if job.argmax else self.sampler.beam_width
            per_beam = max(last - root + 1, 0)
            if per_beam * (wanted - 1) > len(free):
                wanted = 1  # out of scratch blocks: the request's own blocks only
            results[i] = self.sampler.start(q, job.argmax, wanted)
            tails[i] = [list(own[i][root:last + 1])]
            for _ in range(results[i].count - 1):
                tails[i].append(free[:per_beam])
                del free[:per_beam]
        self._beam_steps(jobs, own, results, tails)
        return results

    def _catch_up(self, jobs: list[DraftJob], own: list[np.ndarray]) -> torch.Tensor:
        """Next-token distributions after each job's context, having written its
        uncached tokens. Shortest query first: backends batch decodes before prefills."""
        order = sorted(range(len(jobs)),
                       key=lambda i: len(jobs[i].context) - jobs[i].state.length)
        tokens, positions, sequences = [], [], []
        for i in order:
            job = jobs[i]
            n = len(job.context)
            start = min(job.state.length, n - 1)
            tokens.append(job.context[start:n])
            positions.append(np.arange(start, n))
            sequences.append(Sequence(n - start, n, own[i]))
            job.state.length = n
        logits = self.model.forward(np.concatenate(tokens), np.concatenate(positions),
                                    sequences)
        q = self.sampler.distribution(logits)
        return q[torch.from_numpy(np.argsort(order)).to(q.device)]

    def _beam_steps(self, jobs: list[DraftJob], own: list[np.ndarray],
                    results: list[Beams | None], tails: dict[int, list[list[int]]]) -> None:
        size = self.model.block_size
        sources, targets = [], []
        for i, beam_tails in tails.items():  # beams 1.. start from the root block
            n = len(jobs[i].context)
            if n % size and beam_tails[0]:
                for tail in beam_tails[1:]:
                    sources.append(beam_tails[0][0])
                    targets.append(tail[0])
        self.model.copy_blocks(sources, targets)
        steps = max((jobs[i].length for i in tails), default=0)
        for step in range(1, steps):
            active = [i for i in tails if step < jobs[i].length]
            tokens, positions, sequences = [], [], []
            for i in active:
                n = len(jobs[i].context)
                prefix = own[i][: n // size]
                beams = results[i]
                tokens.append(beams.history[:, -1].cpu().numpy())
                positions.append(np.full(beams.count, n + step - 1))
                sequences.extend(Sequence(1, n + step, np.concatenate([prefix, tail]))
                                 for tail in tails[i])
            q = self.sampler.distribution(self.model.forward(
                np.concatenate(tokens), np.concatenate(positions), sequences))
            sources, targets, first = [], [], 0
            for i in active:
                beams = results[i]
                parents = self.sampler.extend(beams, q[first:first + beams.count],
                                              jobs[i].argmax).tolist()
                first += len(parents)
                if step + 1 < jobs[i].length:  # the new beams feed another step
                    for child, parent in enumerate(parents):
                        if parent != child:
                            sources.extend(tails[i][parent])
                            targets.extend(tails[i][child])
            self.model.copy_blocks(sources, targets)
