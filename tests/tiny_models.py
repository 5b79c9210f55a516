"""Tiny random-weight models (Llama and Qwen2 configs) and a tokenizer, built at test time.

Float32, head_dim 64 (vLLM's CPU attention only supports some head sizes). Weights
are drawn with a large initializer range so that greedy choices are decided by clear
logit margins, not by float rounding: spec decoding computes the same positions in a
different batch shape, and a near-tie would flip on numerics alone.

A plain random model is chaotic: its greedy output never repeats, so no draft is ever
accepted and a test would only see rejections. The attention and MLP outputs are
therefore scaled down (``residual_scale``): the next token then depends mostly on the
current one, so the output falls into loops that drafts can predict, while attention
still decides a quarter or so of the tokens, so the KV cache and positions matter.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _training_text() -> list[str]:
    import json as json_module  # any sizeable stdlib source is a fine corpus

    return [Path(json_module.__file__).parent.joinpath(name).read_text()
            for name in ("decoder.py", "encoder.py", "__init__.py")]


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build_model(path: Path, arch: str = "llama", seed: int = 0,
                residual_scale: float = 1e-3) -> Path:
    """Save a random float32 model of the given architecture with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    path = Path(path)
    if (path / "config.json").exists():
        return path
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    config_path = path / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config_json, indent=2))
    return path
