"""MTAD's start-up check: the auxiliary model exists and shares the target's vocabulary
(draft token ids are the target's). Reads only the model's configuration."""

from __future__ import annotations

from typing import Any

from vllm_lookahead.mtad.options import MTADOptions


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


def check_auxiliary_model(options: MTADOptions, target_model_config: Any) -> None:
    """Raise unless the auxiliary model loads; and, once the target's ``ModelConfig`` is
    known (not when the command line is parsed), unless the vocabularies match."""
    aux_vocab = auxiliary_vocab_size(options.model)
    if target_model_config is None:
        return
    target_vocab = target_model_config.get_vocab_size()
    if aux_vocab != target_vocab:
        raise ValueError(
            f"mtad: the auxiliary model {options.model!r} has a vocabulary of {aux_vocab} "
            f"tokens, the target {target_model_config.model!r} one of {target_vocab}; the "
            "two models must share a tokenizer and vocabulary"
        )
