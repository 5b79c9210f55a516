"""Tiny random-weight models and a tokenizer, built at test time.

Float32, 2 layers, hidden size 128, head_dim 64 (vLLM's CPU attention only supports some
head sizes). Weights are drawn with a large initializer range so that greedy choices are
decided by clear logit margins, not by float rounding: spec decoding computes the same
positions in a different batch shape, and a near-tie would flip on numerics alone.

A plain random model is chaotic: its greedy output never repeats, so no draft is ever
accepted and a test would only see rejections. The attention and MLP outputs are
therefore scaled down (``residual_scale``): the next token then depends mostly on the
current one, so the output falls into loops that drafts can predict, while attention
still decides a quarter or so of the tokens, so the KV cache and positions matter.

Llama and Qwen2 are the models most tests run; the other decoder families (``FAMILIES``)
are for the architecture matrix: each one's builder says what it exercises, and each
family carries a seed and residual scale whose greedy output loops (drafts accepted)
without near-ties (every step's top-two logprob gap well above float noise) on vLLM's
CPU backend. Each family scales the modules whose output is added to its residual
stream: output projections, MLP / expert down projections, state-space out projections,
or, for families that normalize a branch's output before adding it (Gemma's and OLMo 2's
post-norms), that norm's weight (Gemma's norms multiply by ``1 + weight``).
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


def build_model(path: Path, arch: str = "llama", seed: int | None = None,
                residual_scale: float | None = None) -> Path:
    """Save a random float32 model of the given architecture (a key of ``FAMILIES``)
    with a tokenizer; ``seed`` and ``residual_scale`` default to the family's choice."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(FAMILIES)}")
    family = FAMILIES[arch]
    seed = family.seed if seed is None else seed
    residual_scale = family.residual_scale if residual_scale is None else residual_scale
    path = Path(path)
    if (path / "config.json").exists():
        return path
    config = family.config()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        family.scale(model, residual_scale)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    config_path = path / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(config_json, indent=2))
    return path


def _common() -> dict:
    """The Llama-style configuration keys most families share."""
    return dict(
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


def _without_head_dim() -> dict:
    """``_common()`` for configs that derive head_dim (hidden / heads = 64)."""
    common = _common()
    del common["head_dim"]
    return common


def _scale_llama_layers(model, scale: float) -> None:
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(scale)
        layer.mlp.down_proj.weight.mul_(scale)


def _scaler(*suffixes: str, gemma_norms: tuple[str, ...] = ()):
    """Multiply the parameters whose names end with one of ``suffixes`` by the scale;
    set Gemma-style norms (``x * (1 + weight)``) named by ``gemma_norms`` so that their
    factor is multiplied by it."""

    def scale(model, factor: float) -> None:
        for name, parameter in model.named_parameters():
            if name.endswith(gemma_norms):
                parameter.copy_(factor * (1 + parameter) - 1)
            elif name.endswith(suffixes):
                parameter.mul_(factor)

    return scale


class Family:
    """A decoder family: its config, the residual branches its scale shrinks, and the
    seed and residual scale chosen for it (its builder's docstring says why)."""

    def __init__(self, config, scale, seed: int = 0, residual_scale: float = 1e-3):
        self.config, self.scale = config, scale
        self.seed, self.residual_scale = seed, residual_scale


_DOWN = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _llama():
    """Llama: the reference decoder (RMSNorm, RoPE, SwiGLU, GQA). Residual scale 1e-3."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common())


def _qwen2():
    """Qwen2: Llama plus q/k/v biases. Residual scale 1e-3 by default (the tests use
    seed 1, 2e-3)."""
    from transformers import Qwen2Config

    return Qwen2Config(**_common())


def _qwen3():
    """Qwen3: Llama plus per-head RMSNorm on queries and keys (QK-norm). Seed 0,
    residual scale 1e-3."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common())


def _mistral():
    """Mistral with a 32-token sliding window on every layer, far shorter than prompt
    plus output (up to ~400 tokens): drafts are verified against a window that slides
    (trees refused: sliding window). Seed 0, residual scale 1e-3."""
    from transformers import MistralConfig

    return MistralConfig(**_common(), sliding_window=32)


def _gemma2():
    """Gemma2: sliding window (32 tokens, layer 0) and full attention (layer 1)
    alternate, attention-logit and final-logit soft-capping (both 10: they bite),
    embeddings scaled by sqrt(hidden), GeGLU, post-norms on each branch (scaled through
    their ``1 + weight``), tied embeddings (vLLM always ties Gemma2's). Trees refused
    (sliding window, soft-capping). Seed 1, residual scale 8: with tied embeddings a
    weak residual branch repeats the last token forever (its own embedding wins the
    logits), so here the branches must outweigh the sqrt(hidden)-scaled embedding."""
    from transformers import Gemma2Config

    return Gemma2Config(**{**_common(), "tie_word_embeddings": True}, pad_token_id=None,
                        query_pre_attn_scalar=64, sliding_window=32,
                        layer_types=["sliding_attention", "full_attention"],
                        attn_logit_softcapping=10.0, final_logit_softcapping=10.0)


def _gemma3():
    """Gemma3 text-only (``Gemma3ForCausalLM``, ``gemma3_text``): a 48-token sliding
    window (layer 0, local RoPE base) and full attention (layer 1), QK-norm, post-norms
    on each branch (scaled through their ``1 + weight``), tied embeddings; two KV cache
    groups (sliding and full). Trees refused (sliding window). Seed 0, residual scale 16
    (tied embeddings: see Gemma2)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**_common(), "tie_word_embeddings": True},
                            pad_token_id=None, query_pre_attn_scalar=64, sliding_window=48,
                            layer_types=["sliding_attention", "full_attention"])


def _phi3():
    """Phi-3: fused qkv_proj and gate_up_proj weights (vLLM's Llama path). Seed 0,
    residual scale 1e-3."""
    from transformers import Phi3Config

    return Phi3Config(**_without_head_dim(), pad_token_id=None)


def _granite():
    """Granite: Llama with multipliers on embeddings (2), attention scores (0.1 instead
    of 1/sqrt(64)), residual branches (0.5) and logits (divided by 2). Seed 0, residual
    scale 1e-3."""
    from transformers import GraniteConfig

    return GraniteConfig(**_without_head_dim(), embedding_multiplier=2.0,
                         attention_multiplier=0.1, residual_multiplier=0.5,
                         logits_scaling=2.0)


def _olmo2():
    """OLMo 2: no pre-norms, RMSNorm on each branch's output before the residual add
    (post-norms, their weight scaled), QK-norm over all heads at once. vLLM runs it
    through its Transformers modeling backend; on vLLM 0.26 (only) the tree step's
    self-check fails there (the request's blocks after the KV move), so trees are
    refused. Seed 2, residual scale 1e-3."""
    from transformers import Olmo2Config

    return Olmo2Config(**_without_head_dim(), pad_token_id=None)


def _starcoder2():
    """StarCoder2: LayerNorm with biases, biases on every projection, a plain GELU MLP
    (c_fc / c_proj), untied LM head (tied, a tiny model only repeats its last token).
    vLLM runs it through its Transformers modeling backend (trees refused on 0.26: see
    OLMo 2). Seed 0, residual scale 3e-4."""
    from transformers import Starcoder2Config

    return Starcoder2Config(**_without_head_dim(), sliding_window=None)


def _gpt2():
    """GPT-2: learned absolute positions (1024), LayerNorm, Conv1D projections
    (attn.c_proj, mlp.c_proj, weights and biases scaled; positions scaled by
    ``GPT2_POSITION_SCALE``), MHA, untied LM head. Seed 2, residual scale 3e-3."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB_SIZE, n_positions=1024, n_embd=128, n_layer=2,
                      n_head=2, n_inner=256, initializer_range=0.25, bos_token_id=0,
                      eos_token_id=0, tie_word_embeddings=False)


def _mixtral():
    """Mixtral: a sparse MoE MLP (4 experts, top 2; experts' down projections
    scaled) under Llama attention. Seed 2, residual scale 1e-3."""
    from transformers import MixtralConfig

    return MixtralConfig(**_common(), num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=None)


def _qwen3_moe():
    """Qwen3-MoE: QK-norm attention and a sparse MoE MLP (4 experts of 128, top 2,
    normalized top-k weights; experts' down projections scaled). Seed 0, residual
    scale 1e-3."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(), num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=128, norm_topk_prob=True)


def _granitemoehybrid():
    """Granite 4.0 hybrid (``granitemoehybrid``): a Mamba-2 layer (4 heads of 64, state
    64; out_proj scaled) then an attention layer without positions (NoPE), dense
    shared MLPs (no experts), Granite's multipliers at 1: state carried across steps,
    which verification must roll back; two KV cache groups (trees refused). Seed 1,
    residual scale 1e-3. The plugin refuses it at start-up. On vLLM 0.32's CPU backend,
    with prefix caching on, a prompt longer than a few tokens fails in the prefill
    (``varlen_states[last_chunk_indices_p]``: IndexError); with it off, speculative
    decoding (vLLM's ngram too, even K=1) departs from plain decoding, probably because
    ``causal_conv1d_update_cpu`` drops ``num_accepted_tokens`` into ``**kwargs`` (the conv
    state keeps rejected drafts' inputs). vLLM 0.26's CPU backend runs no float32
    Mamba-2 ("causal_conv1d_fwd_kernel_impl" not implemented for 'Float')."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **_without_head_dim(), num_local_experts=0, shared_intermediate_size=256,
        layer_types=["linear_attention", "full_attention"], mamba_n_heads=4,
        mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1)


def _qwen3_next():
    """Qwen3-Next: a Gated DeltaNet linear-attention layer (state carried across steps)
    then a gated full-attention layer, a sparse MoE MLP with a shared expert on each
    (linear_attn.out_proj, o_proj and every down projection scaled). Seed 1, residual
    scale 1e-3. vLLM 0.32's CPU backend runs Gated DeltaNet in bfloat16 only ("CPU GDN
    attention requires BF16."); 0.26's not at all ("causal_conv1d_fwd_kernel_impl" not
    implemented for 'Float'): the plugin refuses it at start-up before either."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(), layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128)


#: GPT-2's learned positions are added to the token embeddings: at full size they make
#: the next token a function of the position as much as of the current token (no loops),
#: so they are scaled down to the order of the (scaled) residual branches.
GPT2_POSITION_SCALE = 0.01


def _scale_gpt2(model, factor: float) -> None:
    _scaler("attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight",
            "mlp.c_proj.bias")(model, factor)
    model.transformer.wpe.weight.mul_(GPT2_POSITION_SCALE)


_GEMMA_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
#: The decoder families by ``build_model``'s ``arch``; each builder's docstring says what
#: it exercises and why its seed and residual scale.
FAMILIES: dict[str, Family] = {
    "llama": Family(_llama, _scale_llama_layers),
    "qwen2": Family(_qwen2, _scale_llama_layers),
    "qwen3": Family(_qwen3, _scaler(*_DOWN), seed=0, residual_scale=1e-3),
    # vLLM 0.26's CPU attention fails on it ("Check failed: input.block_size %
    # attn_impl::BlockSizeAlignment == 0 (16 vs. 0)"), plain decoding too; 0.32 runs it
    "mistral": Family(_mistral, _scaler(*_DOWN), seed=0, residual_scale=1e-3),
    "gemma2": Family(_gemma2, _scaler(gemma_norms=_GEMMA_POST_NORMS), seed=1,
                     residual_scale=8.0),
    "gemma3": Family(_gemma3, _scaler(gemma_norms=_GEMMA_POST_NORMS), seed=0,
                     residual_scale=16.0),
    "phi3": Family(_phi3, _scaler(*_DOWN), seed=0, residual_scale=1e-3),
    "granite": Family(_granite, _scaler(*_DOWN), seed=0, residual_scale=1e-3),
    "olmo2": Family(_olmo2, _scaler(*_GEMMA_POST_NORMS), seed=2, residual_scale=1e-3),
    "starcoder2": Family(_starcoder2, _scaler(
        "self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias"), seed=0, residual_scale=3e-4),
    "gpt2": Family(_gpt2, _scale_gpt2, seed=2, residual_scale=3e-3),
    "mixtral": Family(_mixtral, _scaler("self_attn.o_proj.weight", "experts.down_proj"),
                      seed=2, residual_scale=1e-3),
    "qwen3_moe": Family(_qwen3_moe, _scaler("self_attn.o_proj.weight", "experts.down_proj"),
                        seed=0, residual_scale=1e-3),
    "granitemoehybrid": Family(_granitemoehybrid, _scaler(
        "self_attn.o_proj.weight", "mamba.out_proj.weight",
        "shared_mlp.output_linear.weight"),
        seed=1, residual_scale=1e-3),
    "qwen3_next": Family(_qwen3_next, _scaler(
        "self_attn.o_proj.weight", "linear_attn.out_proj.weight", "experts.down_proj",
        "shared_expert.down_proj.weight"), seed=1, residual_scale=1e-3),
}
