"""A model folder of a real model's shape without its weights, for vLLM's
``load_format="dummy"`` (random weights built from the config): step costs, graph modes
and worst cases at a size whose weights cannot travel. Never for acceptance: random
weights accept almost nothing.

    python -m benchmarks.dummy_model --shape llama-3.1-8b --tokenizer DIR --output DIR

The tokenizer (and its chat template) comes from ``--tokenizer``, a model folder; the
vocabulary is the tokenizer's, so that prompts and drafts are valid token ids.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

#: Published shapes (the models' config.json), less the vocabulary and the weights.
SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def build(shape: str, tokenizer: Path, output: Path) -> Path:
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)} (got {shape!r})")
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer))
    source = json.loads((tokenizer / "config.json").read_text())
    output.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[shape], "vocab_size": vocab_size,
              "bos_token_id": source.get("bos_token_id"),
              "eos_token_id": source.get("eos_token_id")}
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, output / name)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", required=True, type=Path,
                        help="a model folder whose tokenizer the model gets")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    print(build(args.shape, args.tokenizer, args.output))


if __name__ == "__main__":
    main()
