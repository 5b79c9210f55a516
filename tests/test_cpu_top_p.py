"""Top-p on CPU from the largest logits (``worker/cpu_top_p.py``) keeps what vLLM's
sort-based top-k / top-p keeps."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops import topk_topp_sampler

from vllm_lookahead.worker.cpu_top_p import (
    CANDIDATES,
    _from_largest_logits,
    apply_top_k_top_p_from_largest,
)

# vLLM's own function, whether or not the plugin has wrapped it in this process
VLLM_TOP_K_TOP_P = getattr(topk_topp_sampler.apply_top_k_top_p, "__wrapped__",
                           topk_topp_sampler.apply_top_k_top_p)
FROM_LARGEST = _from_largest_logits(VLLM_TOP_K_TOP_P)


def peaked_logits(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """A language model's shape: a few dozen likely tokens over a long flat tail."""
    logits = torch.randn(rows, vocab, generator=generator) * 2
    head = torch.rand(rows, 40, generator=generator) * 12
    logits[:, torch.randperm(vocab, generator=generator)[:40]] += head
    return logits / 0.7


def both(logits, k, p):
    def clone(t):
        return None if t is None else t.clone()

    return VLLM_TOP_K_TOP_P(clone(logits), clone(k), clone(p)), \
        FROM_LARGEST(clone(logits), clone(k), clone(p))


@pytest.mark.parametrize("vocab", [49152, 151936, 300])
@pytest.mark.parametrize("with_top_k", [False, True])
def test_keeps_what_vllm_keeps(vocab, with_top_k):
    generator = torch.Generator().manual_seed(vocab + with_top_k)
    rows = 24
    logits = peaked_logits(rows, vocab, generator)
    logits[: rows // 4] = torch.randn(rows // 4, vocab, generator=generator)  # flat rows
    p = torch.rand(rows, generator=generator) * 0.9 + 0.05
    p[3] = 1.0  # no top-p on this row (another request's in the batch)
    k = None
    if with_top_k:
        k = torch.randint(1, CANDIDATES, (rows,), generator=generator, dtype=torch.int32)
        k[::5] = vocab  # no top-k on these rows
        k[1] = CANDIDATES + 50  # more than the candidates: vLLM's
        k = k.clamp(max=vocab)
    want, got = both(logits, k, p)
    assert torch.equal(want, got)
    # the rows the largest logits decided (not vLLM's function) are most of them
    undecided = apply_top_k_top_p_from_largest(logits.clone(), k, p)
    assert int(undecided.sum()) <= rows // 2
    assert undecided[3]


def test_every_row_decided_and_every_row_not():
    generator = torch.Generator().manual_seed(1)
    p = torch.full((6,), 0.95)
    peaked = peaked_logits(6, 49152, generator)
    assert not apply_top_k_top_p_from_largest(peaked.clone(), None, p).any()
    flat = torch.randn(6, 49152, generator=generator)
    assert apply_top_k_top_p_from_largest(flat.clone(), None, p).all()
    for logits in (peaked, flat):
        want, got = both(logits, None, p)
        assert torch.equal(want, got)


def test_ties_keep_as_many_tokens_of_the_same_values():
    """Equal logits (common in bfloat16) at the nucleus' edge: which of them vLLM keeps
    depends on its sort; the kept values are the same."""
    generator = torch.Generator().manual_seed(2)
    logits = (peaked_logits(16, 4096, generator) * 2).round() / 2
    p = torch.rand(16, generator=generator) * 0.9 + 0.05
    k = torch.randint(1, 60, (16,), generator=generator)
    for top_k in (None, k):
        want, got = both(logits, top_k, p)
        for w, g in zip(want, got):
            assert torch.equal(w.sort().values, g.sort().values)


def test_top_k_only_and_no_sampling_constraints_stay_vllms():
    generator = torch.Generator().manual_seed(3)
    logits = peaked_logits(4, 1000, generator)
    k = torch.tensor([5, 50, 1000, 1])
    assert torch.equal(*both(logits, k, None))
    assert torch.equal(FROM_LARGEST(logits.clone(), None, None), logits)


def test_installed_on_cpu_in_both_places_vllm_applies_top_p():
    from vllm.v1.sample import rejection_sampler

    from vllm_lookahead.worker import cpu_top_p

    cpu_top_p.install()
    cpu_top_p.install()  # idempotent: one wrapper around vLLM's function
    for module in (topk_topp_sampler, rejection_sampler):
        assert module.apply_top_k_top_p.__wrapped__ is VLLM_TOP_K_TOP_P
