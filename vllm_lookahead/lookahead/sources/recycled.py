"""Token Recycling (Luo et al., arXiv 2408.08696): the target's own top-k next tokens
after each token, from the latest pass that computed them, chained into drafts.

Every pass computes the target's distribution after each input token (the root, the
draft tokens, the last position vLLM samples from), also where verification then
rejects: plain decoding throws those predictions away. Here they are kept, one row per
vocabulary token, shared by all requests of the worker, and a draft follows the most
likely next token of each token while the product of the target's probabilities stays
above the request's ``draft_min_prob``. Memory is fixed: vocabulary x k ids (int32) and
log-probabilities (float32).
"""

from __future__ import annotations

import numba
import numpy as np


class RecycledTopK:
    """The target's latest top-k next tokens (and log-probabilities) after each token."""

    def __init__(self, vocab_size: int, top_k: int):
        self.top_k = top_k
        self._ids = np.full((vocab_size, top_k), -1, dtype=np.int32)
        self._logprobs = np.full((vocab_size, top_k), -np.inf, dtype=np.float32)
        self.chain(0, 1, 1.0, 0.0)  # compiled before the first request, not during one

    @property
    def storage(self) -> tuple[np.ndarray, np.ndarray]:
        """The preallocated arrays (next-token ids, their log-probabilities)."""
        return self._ids, self._logprobs

    def update(self, tokens: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray) -> None:
        """Token ``tokens[i]`` was followed by the target's ``top_ids[i]`` (best first);
        the latest prediction replaces the earlier one (later rows win over earlier)."""
        if not len(tokens):
            return
        k = min(self.top_k, top_ids.shape[1])
        known = (tokens >= 0) & (tokens < len(self._ids))
        tokens = tokens[known]
        self._ids[tokens, :k] = top_ids[known, :k]
        self._logprobs[tokens, :k] = top_logprobs[known, :k]

    def chain(self, key: int, limit: int, prob: float, min_prob: float) -> tuple[list[int], float]:
        """Up to ``limit`` tokens following ``key`` by the target's most likely next
        token, while ``prob`` times their probabilities stays at or above ``min_prob``;
        and the resulting probability."""
        if limit <= 0 or not 0 <= key < len(self._ids):
            return [], prob
        out = np.empty(limit, dtype=np.int64)
        count, prob = _follow_top_one(self._ids, self._logprobs, key, limit, prob,
                                      min_prob, out)
        return out[:count].tolist(), prob


@numba.njit(cache=True, nogil=True)
def _follow_top_one(ids, logprobs, key, limit, prob, min_prob, out):
    count = 0
    while count < limit:
        token = ids[key, 0]
        if token < 0 or token >= ids.shape[0]:
            break
        next_prob = prob * np.exp(logprobs[key, 0])
        if next_prob < min_prob:
            break
        prob = next_prob
        out[count] = token
        count += 1
        key = token
    return count, prob
