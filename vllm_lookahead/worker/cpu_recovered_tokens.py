"""Recovered tokens on CPU from one uniform number a request, not a vocabulary of noise.

Where vLLM's rejection sampler rejects a sampled request's draft token, it emits a
*recovered* token, drawn from the target's distribution at that position without the
draft token. vLLM draws it by the Gumbel trick: exponential noise over the whole
vocabulary for every request with a draft (``q.exponential_()``), then the argmax of
p / q. torch's CPU exponential draw took 1.2 ms of a 32 ms SmolLM2-135M step on a
2-core AMD EPYC (49152 tokens; run (ek)), every drafted step of a sampled request:
nearly a third of what a drafted step cost more than an undrafted one. Inverse
transform sampling draws the same distribution from one uniform number: a cumulative
sum (in float64) and a binary search. Like vLLM, a request's positions share their
random number (only its first rejected position's token is ever emitted); a seeded
request's number comes from its generator.
Installed in every engine on CPU, whatever its speculative method.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.sample.rejection_sampler.sample_recovered_tokens`` | wrapped, CPU only; drafts without probabilities (``draft_probs`` None: every n-gram or lookahead draft) | one uniform number a request instead of exponential noise over the vocabulary | 0.32.0, 0.26.0 (CPU); 0.33.0 not read |
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_lookahead import _patching


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if current_platform.is_cpu():
        _patching.wrap(rejection_sampler, "sample_recovered_tokens", _by_inverse_transform)


def _by_inverse_transform(original):
    def sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                                draft_token_ids, draft_probs, target_probs,
                                sampling_metadata, *args, **kwargs):
        if draft_probs is not None or target_probs.device.type != "cpu":
            return original(max_spec_len, num_draft_tokens, cu_num_draft_tokens,
                            draft_token_ids, draft_probs, target_probs, sampling_metadata,
                            *args, **kwargs)
        return recovered_tokens(list(num_draft_tokens), draft_token_ids, target_probs,
                                sampling_metadata.generators)

    return sample_recovered_tokens


def recovered_tokens(num_draft_tokens: list[int], draft_token_ids: torch.Tensor,
                     target_probs: torch.Tensor,
                     generators: dict[int, Any]) -> torch.Tensor:
    """At each draft position, a token drawn from ``target_probs`` without the draft
    token (a placeholder -1: from all of them), renormalized (a row whose whole mass is
    on its draft token, which is then always accepted, gets the last token).
    ``num_draft_tokens`` by request; its positions share one uniform number, from the
    request's generator if it has one."""
    uniform = torch.rand(len(num_draft_tokens), dtype=torch.float64)
    for row, generator in generators.items():
        if num_draft_tokens[row] > 0:
            uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = target_probs.to(torch.float64, copy=True)
    # -1: vLLM's placeholder for a padded draft position (always rejected): its token
    # comes from the whole target distribution, as vLLM's kernel draws it
    drafted = torch.nonzero(draft_token_ids.view(-1) >= 0).view(-1)
    cdf[drafted, draft_token_ids.view(-1)[drafted].long()] = 0.0
    cdf = cdf.cumsum_(-1)
    targets = uniform.repeat_interleave(torch.tensor(num_draft_tokens)) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).view(-1)
    return tokens.clamp_(max=cdf.shape[-1] - 1).to(draft_token_ids.dtype)
