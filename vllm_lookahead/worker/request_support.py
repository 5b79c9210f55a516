"""Which requests vLLM's verifier decides exactly with drafts; the others are served
without drafts (or with shorter ones), never refused.

At draft positions vLLM's rejection sampler applies penalties, bad words, allowed
token ids, min_tokens, structured output, temperature, top-k and top-p, but no other
logits processor: not ``logit_bias``, not ``min_p``. vLLM therefore refuses both
under speculation and builds neither processor, so a server that turns speculation
on would lose requests that it served before. With our methods they are admitted
(``engine_config``), the processors plain decoding has are built (``install``), and
such a request gets no drafts: each of its steps samples one token through vLLM's
plain sampler (the bonus token), exactly as without speculation, while the other
requests of the batch keep speculating.

min_tokens: at draft positions vLLM masks stop tokens by position, but at the bonus
position of a drafted row by the count before the draft. A draft that crosses
min_tokens would keep a stop token masked one token too long, so, until min_tokens
tokens are generated, drafts end before it (``min_tokens_bound``).

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.v1.worker.gpu_model_runner.build_logitsprocs`` (the runner module's name for it) | wrapped (our methods only, worker processes) | builds what plain decoding builds (min_tokens, logit_bias, min_p) instead of min_tokens alone; refuses at start-up the processors plain decoding would add on top (``logits_processors=``, entry-point plugins: vLLM refuses the first and silently drops the second under speculation) | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``SamplingParams.logit_bias``, ``.min_p``, ``.min_tokens`` | read | which requests get no drafts or shorter ones | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from vllm_lookahead import _patching
from vllm_lookahead.options import method_config

#: Sampling parameters that vLLM's verifier does not apply at draft positions: a
#: request with one is served without drafts (docs/compatibility.md lists them).
UNDRAFTED_PARAMETERS = ("logit_bias", "min_p")
#: vLLM's threshold below which min_p is off (``sampling_params._SAMPLING_EPS``).
MIN_P_EPS = 1e-5
#: ``min_tokens_bound`` where min_tokens does not bound a draft.
NO_BOUND = np.iinfo(np.int64).max


def undrafted_parameter(params: Any) -> str | None:
    """The request's sampling parameter that vLLM's verifier would not apply to its
    drafts (one of ``UNDRAFTED_PARAMETERS``), or None."""
    if params is None:
        return None
    if getattr(params, "logit_bias", None):
        return "logit_bias"
    if (getattr(params, "min_p", 0.0) or 0.0) > MIN_P_EPS:
        return "min_p"
    return None


def without_undrafted_parameters(params: Any) -> Any:
    """A copy of the request's sampling parameters without ``UNDRAFTED_PARAMETERS``
    (what vLLM's admission checks of a speculative request see: it is served without
    drafts, every other check applies)."""
    plain = copy.copy(params)
    plain.logit_bias, plain.min_p = None, 0.0
    return plain


def min_tokens_end(params: Any, num_prompt_tokens: int) -> int:
    """The context length at which the request has its ``min_tokens`` (0: none)."""
    min_tokens = getattr(params, "min_tokens", 0) or 0
    return num_prompt_tokens + min_tokens if min_tokens else 0


def min_tokens_bound(end: Any, num_tokens: Any) -> Any:
    """Longest draft after a context of ``num_tokens`` whose every position vLLM
    verifies as plain decoding would, for a request reaching min_tokens at context
    length ``end`` (``min_tokens_end``): until then, one short of it; ``NO_BOUND``
    after. Scalars or arrays."""
    end, num_tokens = np.asarray(end, dtype=np.int64), np.asarray(num_tokens, dtype=np.int64)
    return np.where(num_tokens < end, end - num_tokens - 1, NO_BOUND)


def install() -> None:
    """Worker processes: build plain decoding's logits processors for our methods."""
    from vllm.v1.worker import gpu_model_runner

    if hasattr(gpu_model_runner, "build_logitsprocs"):
        _patching.wrap(gpu_model_runner, "build_logitsprocs", _plain_decodings_processors)


def _plain_decodings_processors(original):
    def build_logitsprocs(vllm_config, *args, **kwargs):
        if not method_config(vllm_config):
            return original(vllm_config, *args, **kwargs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

        without_speculation = copy.copy(vllm_config)
        object.__setattr__(without_speculation, "speculative_config", None)
        processors = original(without_speculation, *args, **kwargs)
        others = sorted({type(p).__qualname__ for p in processors.all
                         if type(p) not in BUILTIN_LOGITS_PROCESSORS})
        if others:
            raise ValueError(
                f"vllm-lookahead: the logits processors {', '.join(others)} change "
                "logits at positions that vLLM's speculative verification does not "
                "process, so drafted requests would not get them; serve this model "
                "without speculative decoding, or without these processors "
                "(logits_processors=, or the plugins of the 'vllm.logits_processors' "
                "entry-point group)")
        return processors

    return build_logitsprocs
