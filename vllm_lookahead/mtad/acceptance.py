"""MTAD's joint-probability acceptance, in the place of vLLM's ``rejection_sample``.

For a sampled request with draft x_1..x_n and the auxiliary model's per-token
log-probabilities log q(x_t | x_<t), the rule accepts the *longest* prefix d whose
joint ratio passes the threshold,

    sum_{t<=d} log p(x_t | x_<t) - sum_{t<=d} log q(x_t | x_<t) > log tau,

(a shorter prefix may fail while a longer one passes), then appends one token
sampled from the target's distribution p after x_d, or vLLM's bonus token when
d = n. p is vLLM's processed distribution (temperature, top-k, top-p), so a token
the request's own settings exclude is never accepted. It is not lossless: it
favours sequences the target finds likely (the point of MTAD). Greedy requests
are verified exactly as vLLM does (longest prefix equal to the target's argmax).
"""

from __future__ import annotations

import math

import torch

PLACEHOLDER_TOKEN_ID = -1  # vLLM's padding after a request's last output token


def joint_accept(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    draft_logq: torch.Tensor,
    is_greedy: list[bool],
    threshold: float,
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """Output tokens ``[rows, max_spec_len + 1]`` (int32, -1 padded), as vLLM's sampler.

    ``target_logits`` are the processed logits at the draft positions (``[T, V]``),
    ``draft_logq`` the auxiliary log-probabilities of the draft tokens (``[T]``),
    ``bonus_token_ids`` vLLM's samples after each full draft (``[rows]``).
    """
    rows = len(num_draft_tokens)
    device = target_logits.device
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    drafts = draft_token_ids.long()
    log_ratio = logp.gather(1, drafts[:, None]).squeeze(1) - draft_logq.float().to(device)
    argmax = target_logits.argmax(dim=-1)
    # one host copy of the small per-token vectors; the [T, V] logits stay put
    drafts_cpu = drafts.tolist()
    ratio_cpu = log_ratio.cpu()
    argmax_cpu = argmax.tolist()
    bonus_cpu = bonus_token_ids.view(-1).tolist()
    log_tau = math.log(threshold)
    generators = generators or {}

    output = torch.full((rows, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    start = 0
    for row, count in enumerate(num_draft_tokens):
        draft = drafts_cpu[start:start + count]
        if is_greedy[row]:
            accepted = next((i for i, (d, a) in enumerate(
                zip(draft, argmax_cpu[start:start + count])) if d != a), count)
        else:
            passing = torch.nonzero(ratio_cpu[start:start + count].cumsum(0) > log_tau)
            accepted = int(passing[-1]) + 1 if len(passing) else 0
        if accepted == count:
            last = bonus_cpu[row]
        elif is_greedy[row]:
            last = argmax_cpu[start + accepted]
        else:
            probs = torch.softmax(target_logits[start + accepted].float(), dim=-1)
            last = int(torch.multinomial(probs, 1, generator=generators.get(row)))
        output[row, :accepted] = torch.tensor(draft[:accepted], dtype=torch.int32)
        output[row, accepted] = last
        start += count
    return output.to(device)
