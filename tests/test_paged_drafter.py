"""MTAD's paged drafting (``mtad/paged_drafter.py``) against a fake paged model whose
next-token distribution is a function of exactly what its KV blocks hold for a
sequence: wrong slots, a missing root-block copy or a wrong parent copy would change
the beams' log q, so every beam must score as a plain pass over its own history."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from vllm_lookahead.mtad.beams import AuxiliaryState, BeamSampler, DraftJob
from vllm_lookahead.mtad.paged_drafter import PagedDrafter
from vllm_lookahead.worker.auxiliary_model import Sequence

VOCAB, BLOCK = 12, 4


def distribution_after(context: list[int]) -> torch.Tensor:
    """A fixed random distribution per context (what a model computes from its KV)."""
    seed = int.from_bytes(hashlib.sha256(str(context).encode()).digest()[:4], "little")
    logits = torch.from_numpy(np.random.default_rng(seed).normal(size=VOCAB) * 2)
    return logits.float()


class FakePagedModel:
    """Blocks of ``BLOCK`` slots holding one token each, in place of keys and values."""

    block_size = BLOCK

    def __init__(self, num_blocks: int, own: dict[int, list[int]], beam_blocks: list[int]):
        self.slots = np.full(num_blocks * BLOCK, -1)
        self.own, self._beam_blocks = own, beam_blocks

    def request_blocks(self, row: int) -> np.ndarray:
        return np.asarray(self.own[row])

    def beam_blocks(self) -> list[int]:
        return self._beam_blocks

    def forward(self, tokens, positions, sequences: list[Sequence]) -> torch.Tensor:
        first, rows = 0, []
        for s in sequences:
            for token, position in zip(tokens[first:first + s.query_len],
                                       positions[first:first + s.query_len]):
                self.slots[s.blocks[position // BLOCK] * BLOCK + position % BLOCK] = token
            first += s.query_len
            rows.append(distribution_after([int(self.slots[s.blocks[p // BLOCK] * BLOCK
                                                           + p % BLOCK])
                                            for p in range(s.seq_len)]))
        return torch.stack(rows)

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        copies = [self.slots[b * BLOCK:(b + 1) * BLOCK].copy() for b in sources]
        for target, copy in zip(targets, copies):
            self.slots[target * BLOCK:(target + 1) * BLOCK] = copy


def plain_logq(context: list[int], draft: list[int]) -> list[float]:
    return [float(torch.log_softmax(distribution_after(context + draft[:t]), -1)[token])
            for t, token in enumerate(draft)]


def make_drafter(own, beam_blocks, beam_width=3):
    sampler = BeamSampler(beam_width, temperature=1.0, top_k=0, top_p=1.0, seed=0,
                          device=torch.device("cpu"))
    model = FakePagedModel(64, own, beam_blocks)
    return PagedDrafter(model, sampler), model


def test_every_beam_scores_as_a_plain_pass_over_its_history():
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, VOCAB, size=n).tolist() for n in (9, 4, 14)]
    # own blocks cover context + lookahead; beams 1.. take scratch blocks 40..
    own = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8], 2: [9, 10, 11, 12, 13, 14]}
    drafter, _ = make_drafter(own, list(range(40, 64)))
    states = [AuxiliaryState() for _ in contexts]
    for round_ in range(3):  # later rounds catch up from the committed cache
        jobs = [DraftJob(state, np.asarray(context), 4, argmax=False, row=row)
                for row, (state, context) in enumerate(zip(states, contexts))]
        for context, beams in zip(contexts, drafter.draft(jobs)):
            assert beams.count == 3 and beams.history.shape[1] == 4
            for tokens, logq in beams.ranked():
                assert logq == pytest.approx(plain_logq(context, tokens), abs=1e-5)
        for context in contexts:  # two accepted tokens and one sampled, say
            context.extend(rng.integers(0, VOCAB, size=3 - round_ % 2).tolist())


def test_without_scratch_blocks_a_request_drafts_one_beam():
    context = list(range(6))
    drafter, _ = make_drafter({0: [1, 2, 3]}, beam_blocks=[40])  # beams 1, 2 need 2 each
    (beams,) = drafter.draft([DraftJob(AuxiliaryState(), np.asarray(context), 3, False, 0)])
    assert beams.count == 1
    (tokens, logq), = beams.ranked()
    assert logq == pytest.approx(plain_logq(context, tokens), abs=1e-5)


def test_the_draft_stops_where_the_requests_blocks_end():
    context = list(range(9))  # blocks 1-3 hold 12 slots: positions up to 11
    drafter, _ = make_drafter({0: [1, 2, 3]}, list(range(40, 64)))
    (beams,) = drafter.draft([DraftJob(AuxiliaryState(), np.asarray(context), 8, False, 0)])
    assert beams.history.shape[1] == 12 - 9 + 1  # the last token needs no slot
    drafter, _ = make_drafter({0: [1, 2]}, [])
    assert drafter.draft([DraftJob(AuxiliaryState(), np.asarray(context), 4, False, 0)]) == [None]
