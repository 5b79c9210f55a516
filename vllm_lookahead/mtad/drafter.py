"""The auxiliary model and its beam-sampling drafts (MTAD's ``generate_draft``).

The auxiliary model runs outside vLLM's paged KV cache, as a plain transformers
model with one dense cache per request: beam sampling needs B different histories
at the same positions, which vLLM's one-chain draft machinery cannot hold. A
request's cache holds its committed context only; beams extend a B-row copy that
is cut back after drafting, so a rejected draft needs no rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def auxiliary_vocab_size(name: str) -> int:
    """The auxiliary model's vocabulary size; errors name the option and the cause."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - any loading failure is the user's setting
        raise ValueError(f"mtad: model {name!r}: cannot load the auxiliary model's "
                         f"configuration ({exc})") from None
    config = getattr(config, "get_text_config", lambda: config)()
    return int(config.vocab_size)


def load_auxiliary_model(name: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    return model.to(device).eval()


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int,
                          top_p: float) -> torch.Tensor:
    """Rows of ``logits`` as probabilities after temperature, top-k and top-p."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already cover top_p (the first stays)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(dim=-1)


@dataclass
class AuxiliaryState:
    """A request's auxiliary KV cache over its first ``length`` context tokens."""

    cache: Any = None
    length: int = 0


class BeamDrafter:
    """Beam sampling in the auxiliary model; greedy requests get its greedy chain (one
    argmax beam: exact-match verification accepts that chain more often than the most
    likely beam)."""

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
    def draft(self, state: AuxiliaryState, context: np.ndarray, length: int,
              argmax: bool) -> tuple[list[int], list[float]]:
        """The best beam of ``length`` tokens after ``context`` and the auxiliary
        log-probability of each of its tokens (log q(x_t | x_<t), not the beam score)."""
        if state.cache is None:
            from transformers import DynamicCache

            state.cache = DynamicCache(config=self.model.config)
        new_tokens = torch.as_tensor(context[state.length:], device=self.device)
        q = self._next_distribution(new_tokens[None], state.cache)[0]
        state.length = len(context)

        beams = 1 if argmax else self.beam_width
        tokens = self._choose(q, beams, argmax)
        picked = q[tokens]
        score = picked / picked.sum()
        history, logq = tokens[:, None], picked.log()[:, None]
        if length > 1:
            cache = state.cache
            cache.batch_repeat_interleave(beams)
            for step in range(1, length):
                q = self._next_distribution(history[:, -1:], cache)
                joint = (score[:, None] * q).flatten()
                picks = self._choose(joint, beams, argmax)
                parent, token = picks // q.shape[-1], picks % q.shape[-1]
                score = joint[picks] / joint[picks].sum()
                history = torch.cat([history[parent], token[:, None]], dim=1)
                logq = torch.cat([logq[parent], q[parent, token].log()[:, None]], dim=1)
                if step < length - 1:
                    cache.reorder_cache(parent)
            cache.batch_select_indices(torch.zeros(1, dtype=torch.long, device=self.device))
            cache.crop(state.length - cache.get_seq_length())  # negative: drop the beams
        best = int(score.argmax())
        return history[best, :length].tolist(), logq[best, :length].tolist()

    def _next_distribution(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        logits = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        return sampling_distribution(logits, self.temperature, self.top_k, self.top_p)

    def _choose(self, weights: torch.Tensor, beams: int, argmax: bool) -> torch.Tensor:
        if argmax:
            return torch.topk(weights, beams).indices
        return torch.multinomial(weights, beams, replacement=True, generator=self.generator)
