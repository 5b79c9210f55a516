"""Top-p on CPU from the largest logits, not a sort of the vocabulary.

On CPU, vLLM applies top-p (with or without top-k) by sorting every row of logits: on 2
cores 6.4 ms for one row of a 49k vocabulary and 20.7 ms for Qwen2.5's 152k (about half
that a row in batches of 4 to 8), more than the model's own cost of a verified token. A
speculative step samples one row per draft token and the bonus token, so under top-p the
sort made each draft token cost more than the forward pass did. The nucleus rarely holds
more than a few dozen tokens: the largest ``CANDIDATES`` logits of a row (a partial
selection) decide it whenever they hold at least p of the probability, or contain the
top-k cut. Rows they do not decide, and rows without top-p, go to vLLM's own function.
The rule is vLLM's: a token is kept if the probability of the tokens above it in the
sorted row is below p, among the top-k tokens (ties at the k-th value kept)
renormalized; the sums run from the top instead of from the bottom, so they differ from
vLLM's only in float rounding.
Installed in every engine on CPU, whatever its speculative method (none included).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`` (the sampler's, also for bonus tokens) and ``vllm.v1.sample.rejection_sampler.apply_top_k_top_p`` (its own import, for draft positions) | wrapped, CPU only | rows the largest logits decide skip the sort | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_lookahead import _patching

#: Logits per row selected before deciding its nucleus: at temperature 0.7 and top-p
#: 0.95 it is usually a few dozen tokens; selecting 128 of 152k costs about what 32 do.
CANDIDATES = 128


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    if not current_platform.is_cpu():
        return
    for module in (topk_topp_sampler, rejection_sampler):
        if hasattr(module, "apply_top_k_top_p"):
            _patching.wrap(module, "apply_top_k_top_p", _from_largest_logits)


def _from_largest_logits(original):
    def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                          p: torch.Tensor | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if p is None or logits.device.type != "cpu" or not logits.shape[0]:
            return original(logits, k, p, *args, **kwargs)
        undecided = apply_top_k_top_p_from_largest(logits, k, p)
        if undecided.all():
            return original(logits, k, p, *args, **kwargs)
        if undecided.any():
            rows = undecided.nonzero().view(-1)
            logits[rows] = original(logits[rows], None if k is None else k[rows], p[rows],
                                    *args, **kwargs)
        return logits

    return apply_top_k_top_p


def apply_top_k_top_p_from_largest(logits: torch.Tensor, k: torch.Tensor | None,
                                   p: torch.Tensor, candidates: int = CANDIDATES
                                   ) -> torch.Tensor:
    """Mask, in place, the logits outside each row's top-k and top-p nucleus where the
    row's largest ``candidates`` logits decide it; which rows they did not decide (left
    as they were)."""
    vocab = logits.shape[-1]
    candidates = min(candidates, vocab)
    values, indices = logits.topk(candidates, dim=-1)  # descending
    top_p = p.to(torch.float32)
    if k is None:
        by_top_k = torch.zeros(len(values), dtype=torch.bool, device=values.device)
        kept = torch.ones_like(values, dtype=torch.bool)
    else:
        k = k.to(torch.long)
        by_top_k = k <= candidates  # the k-th largest is among the candidates
        kth = values.gather(1, (k.clamp(1, candidates) - 1).unsqueeze(1))
        kept = ~by_top_k.unsqueeze(1) | (values >= kth)
    # probabilities after top-k: renormalized over the candidates it keeps, or over the
    # whole row where it keeps more than the candidates (k of the vocabulary: none)
    scaled = values.float().masked_fill(~kept, -float("inf"))
    log_total = scaled.logsumexp(-1, keepdim=True)
    if not by_top_k.all():  # the whole row's sum only where it is needed (a full pass)
        whole = (~by_top_k).nonzero().view(-1)
        log_total[whole] = logits[whole].float().logsumexp(-1, keepdim=True)
    probs = (scaled - log_total).exp()
    above = probs.cumsum(-1) - probs
    kept &= above < top_p.unsqueeze(1)
    decided = by_top_k | (probs.sum(-1) >= top_p)
    # a top-k cut whose ties run past the candidates, a top-k that keeps more than the
    # candidates but not the whole vocabulary, and top-p of 1 (vLLM then masks only
    # tokens of probability 0) are vLLM's
    if k is not None:
        decided &= (by_top_k & (values[:, -1] < kth.squeeze(1))) | (~by_top_k & (k >= vocab))
    decided &= top_p < 1
    masked = values.masked_fill(~kept, -float("inf"))
    if decided.all():
        logits.fill_(-float("inf")).scatter_(1, indices, masked)
    elif decided.any():
        rows = decided.nonzero().view(-1)
        logits[rows] = logits[rows].fill_(-float("inf")).scatter_(1, indices[rows],
                                                                  masked[rows])
    return ~decided
