"""MTAD's joint-probability acceptance, in the place of vLLM's ``rejection_sample``.

For a sampled request with draft x_1..x_n and the auxiliary model's per-token
log-probabilities log q(x_t | x_<t), the rule accepts the *longest* prefix d whose
joint ratio passes the threshold,

    sum_{t<=d} log p(x_t | x_<t) - sum_{t<=d} log q(x_t | x_<t) > log tau,

(a shorter prefix may fail while a longer one passes), then appends one token
sampled from the target's distribution p after x_d, or vLLM's bonus token when x_d
is the draft's last node. A tree draft (all beams, the paper's multi-candidate MTAD)
is judged path by path, root to each leaf, and the path with the longest passing
prefix wins (the first, i.e. the best beam, on a tie). p is vLLM's processed
distribution (temperature, top-k, top-p), so a token the request's own settings
exclude is never accepted. It is not lossless: it favours sequences the target finds
likely (the point of MTAD). Greedy requests are verified exactly as vLLM does
(longest path equal to the target's argmax).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_lookahead.tree import accepted_path

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
    parents: list[np.ndarray | None] | None = None,
) -> torch.Tensor:
    """Output tokens ``[rows, max_spec_len + 1]`` (int32, -1 padded), as vLLM's sampler.

    ``target_logits`` are the processed logits at the draft positions (``[T, V]``; row
    i of a request: the target's distribution after its node i, the root being node
    0), ``draft_logq`` the auxiliary log-probabilities of the draft tokens (``[T]``),
    ``bonus_token_ids`` vLLM's samples after each draft's last node (``[rows]``).
    ``parents[row]``: the parent of each node of the row's tree (root first, -1); None,
    or no ``parents``, for a linear draft. A tree may cover fewer nodes than the row
    drafted (a tree verified linearly is judged on its first chain only).
    """
    rows = len(num_draft_tokens)
    device = target_logits.device
    parents = parents or [None] * rows
    logp = torch.log_softmax(target_logits.float(), dim=-1)
    starts = np.concatenate([[0], np.cumsum(num_draft_tokens)]).astype(np.int64)
    chains = [np.arange(-1, count) if p is None else np.asarray(p)
              for p, count in zip(parents, num_draft_tokens)]
    # each node's log p given its parent, minus its log q: one gather for the batch
    node_rows = np.concatenate([starts[r] + chains[r][1:] for r in range(rows)] or [[]])
    node_cols = np.concatenate([starts[r] + np.arange(len(chains[r]) - 1)
                                for r in range(rows)] or [[]])
    drafts = draft_token_ids.long()
    node_rows_t = torch.as_tensor(node_rows, dtype=torch.long, device=device)
    node_cols_t = torch.as_tensor(node_cols, dtype=torch.long, device=device)
    log_ratio = (logp[node_rows_t, drafts[node_cols_t]]
                 - draft_logq.float().to(device)[node_cols_t]).cpu().numpy()
    # one host copy of the small per-token vectors; the [T, V] logits stay put
    drafts_cpu = drafts.tolist()
    argmax_cpu = target_logits.argmax(dim=-1).tolist()
    bonus_cpu = bonus_token_ids.view(-1).tolist()
    log_tau = math.log(threshold)
    generators = generators or {}

    output = torch.full((rows, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    offset = 0
    for row, count in enumerate(num_draft_tokens):
        begin, tree = int(starts[row]), chains[row]
        size = len(tree) - 1
        tokens = [-1, *drafts_cpu[begin:begin + size]]
        ratios = log_ratio[offset:offset + size]
        offset += size
        if is_greedy[row]:
            after_last = bonus_cpu[row] if size == count else argmax_cpu[begin + size]
            path = accepted_path(tree, tokens, argmax_cpu[begin:begin + size] + [after_last])
        else:
            path = _longest_passing_path(tree, ratios, log_tau)
        end = path[-1] if path else 0
        if end == count:
            last = bonus_cpu[row]
        elif is_greedy[row]:
            last = argmax_cpu[begin + end]
        else:
            probs = torch.softmax(target_logits[begin + end].float(), dim=-1)
            last = int(torch.multinomial(probs, 1, generator=generators.get(row)))
        emitted = [tokens[node] for node in path] + [last]
        output[row, :len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
    return output.to(device)


def _longest_passing_path(parents: np.ndarray, ratios: np.ndarray, log_tau: float
                          ) -> list[int]:
    """Nodes (root excluded) of the longest root-down prefix whose summed log ratio
    passes, over the paths to every leaf; leaves in node order decide ties."""
    size = len(parents) - 1
    has_child = np.zeros(size + 1, dtype=bool)
    has_child[parents[1:]] = True
    best: list[int] = []
    for leaf in range(1, size + 1):
        if has_child[leaf]:
            continue
        path = [leaf]
        while parents[path[-1]] > 0:
            path.append(int(parents[path[-1]]))
        path.reverse()
        passing = np.nonzero(np.cumsum(ratios[np.asarray(path) - 1]) > log_tau)[0]
        depth = int(passing[-1]) + 1 if len(passing) else 0
        if depth > len(best):
            best = path[:depth]
    return best
