"""Which requests vLLM verifies exactly with drafts (``worker/request_support.py``) and
the admission of the others (``engine_config``), without an engine; the engines'
side is tests/test_request_matrix.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams

from vllm_lookahead import engine_config
from vllm_lookahead.proposer import METHODS
from vllm_lookahead.worker import request_support

OURS = SimpleNamespace(method="custom_class", model=METHODS["lookahead"].proposer)
NGRAM = SimpleNamespace(method="ngram", model=None)


def test_requests_vllm_would_verify_inexactly_are_named():
    assert request_support.undrafted_parameter(SamplingParams(logit_bias={3: 1.0})) == "logit_bias"
    sampled = SamplingParams(temperature=1.0, min_p=0.1)
    assert request_support.undrafted_parameter(sampled) == "min_p"
    assert request_support.undrafted_parameter(SamplingParams(temperature=1.0)) is None
    assert request_support.undrafted_parameter(None) is None
    assert set(request_support.UNDRAFTED_PARAMETERS) == {"logit_bias", "min_p"}


def test_drafts_end_before_min_tokens_until_it_is_reached():
    # a 10-token prompt and min_tokens 5: the context reaches it at 15 tokens
    end = request_support.min_tokens_end(SamplingParams(min_tokens=5), 10)
    assert end == 15 and request_support.min_tokens_end(SamplingParams(), 10) == 0
    bounds = request_support.min_tokens_bound([end] * 5 + [0], [10, 12, 14, 15, 40, 10])
    # 10 tokens (no output yet): 4 drafted + the bonus token are outputs 1-5, the bonus
    # (the 5th) still masked by vLLM as by plain decoding; from 15 on no bound
    assert bounds[:3].tolist() == [4, 2, 0]
    assert (bounds[3:] == request_support.NO_BOUND).all()
    assert int(request_support.min_tokens_bound(end, 11)) == 3


def test_min_p_and_logit_bias_are_admitted_for_our_methods_only():
    engine_config.install()
    for params in (SamplingParams(logit_bias={3: 1.0}), SamplingParams(temperature=1.0, min_p=0.2)):
        params._validate_spec_decode(OURS)  # served without drafts
        with pytest.raises(Exception, match="not yet supported with speculative decoding"):
            params._validate_spec_decode(NGRAM)  # vLLM's own methods: vLLM's answer
    assert params.min_p == 0.2  # the request keeps its parameters


def test_exact_id_logprobs_are_refused_naming_why():
    engine_config.install()
    params = SamplingParams(logprob_token_ids=[1, 2])
    with pytest.raises(Exception, match="logprob_token_ids cannot be served with speculative"):
        params._validate_spec_decode(OURS)


class _CustomProcessor:
    """Stands for a user's logits processor (``logits_processors=``)."""

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits


def _fake_config(ours: bool):
    return SimpleNamespace(
        speculative_config=OURS, scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={"vllm_lookahead": {"method": "lookahead"}} if ours else {})


def test_plain_decodings_logits_processors_are_built_for_our_methods():
    from vllm.v1.sample.logits_processor import (
        BUILTIN_LOGITS_PROCESSORS,
        LogitsProcessor,
        build_logitsprocs,
    )

    build = request_support._plain_decodings_processors(build_logitsprocs)
    args = (torch.device("cpu"), False, False)
    built = {type(p) for p in build(_fake_config(True), *args).all}
    assert built == set(BUILTIN_LOGITS_PROCESSORS)  # min_tokens, logit_bias, min_p
    # another method (no options of ours): vLLM's min_tokens alone, as before
    assert len(list(build(_fake_config(False), *args).all)) == 1
    custom = type("UserProcessor", (_CustomProcessor, LogitsProcessor), {})
    with pytest.raises(ValueError, match="the logits processors UserProcessor change logits"):
        build(_fake_config(True), *args, custom_logitsprocs=[custom])
