"""A lookahead proposer bound to a fake runner, the batches vLLM hands it and the
verification captures it reads: shared by the proposer tests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from conftest import fake_vllm_config

from vllm_lookahead.lookahead.proposer import LookaheadProposer
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.worker.hooks import VerificationCapture

MAX_LEN = 64


def make_proposer(k=4, max_model_len=MAX_LEN, **options):
    """A bound proposer; linear unless the test names tree options (no worker here to
    decide trees ``auto``)."""
    tree_options = {"tree_candidates", "tree_window"} & set(options)
    options.setdefault("trees", "on" if tree_options else "off")
    config = fake_vllm_config(
        k, max_model_len, {ADDITIONAL_CONFIG_KEY: {"method": "lookahead", **options}})
    proposer = LookaheadProposer(config)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(8, np.int32)),
        requests={},
        # no attention layer registered: tree drafts are not refused
        vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={})),
    )
    proposer.bind_model_runner(runner)
    proposer.load_model(None)
    return proposer, runner


class Batch:
    """The runner's token buffer, as vLLM hands it to ``propose``."""

    def __init__(self, runner, contexts: dict[str, list[int]], prompt_lens=None):
        self.runner = runner
        self.tokens = np.zeros((8, MAX_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(8, dtype=np.int32)
        self.set(contexts, prompt_lens)

    def set(self, contexts, prompt_lens=None):
        self.runner.input_batch.req_ids = list(contexts)
        self.runner.requests.update(dict.fromkeys(contexts))
        for row, context in enumerate(contexts.values()):
            self.tokens[row, : len(context)] = context
            self.num_tokens[row] = len(context)
            self.runner.input_batch.num_prompt_tokens[row] = (prompt_lens or {}).get(row, 1)

    def propose(self, proposer, sampled):
        return proposer.propose(sampled, self.num_tokens, self.tokens)


def capture(drafts, predictions, bonus, top_ids=None, top_logprobs=None):
    flat = [t for d in drafts for t in d]
    return VerificationCapture(
        num_draft_tokens=[len(d) for d in drafts],
        draft_token_ids=torch.tensor(flat),
        target_argmax=torch.tensor([t for p in predictions for t in p]),
        bonus_token_ids=torch.tensor(bonus),
        target_top_ids=None if top_ids is None else torch.tensor(top_ids),
        target_top_logprobs=None if top_logprobs is None else torch.tensor(top_logprobs),
    )


def top_k(ids, probs):
    """Top-k ids and log-probabilities as the sampler hooks capture them."""
    return torch.tensor(ids), torch.tensor(probs).log()
