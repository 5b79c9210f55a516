"""What users send through ``SamplingParams``, with lookahead's defaults: the same tokens
as plain decoding (greedy), alone and mixed in one batch, with drafts accepted; the
requests vLLM cannot verify with drafts (logit_bias, min_p) served without them, equal
to plain decoding even when sampled with a seed (docs/compatibility.md, "Requests";
sampled features' distributions: test_sampling.py).

One plain engine and one lookahead engine (``{"method": "lookahead"}``, nothing else)
serve the whole module side by side.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import (
    ENGINE_KWARGS,
    generate,
    greedy,
    make_prompts,
    metrics,
    proposer_stats,
    shutdown,
)
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams

PROMPTS = make_prompts()[:4]
#: Log-probabilities of a token verified in a pass of several tokens and of one decoded
#: alone may round apart in float32 (~1e-6 on vLLM 0.26's CPU attention: conftest's
#: NEAR_TIE); 100x that is still far below any difference a wrong position or a
#: missing penalty makes (> 1e-2 on these models).
LOGPROB_TOLERANCE = 1e-4


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, "ignore_eos": True, **kwargs})


def _structured(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(**kwargs))


#: Greedy requests by feature; each is run on PROMPTS. ``undrafted``: served without drafts.
CASES = {
    "plain": _greedy(),
    "logprobs": _greedy(logprobs=3),
    "prompt_logprobs": _greedy(prompt_logprobs=2),
    "penalties": _greedy(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
    "logit_bias": _greedy(logit_bias={7: 4.0, 100: 2.5, 245: -3.0}),
    "stop_strings": _greedy(stop=["en", "ect"]),
    "stop_token_ids": _greedy(stop_token_ids=[28, 440]),
    "bad_words": _greedy(bad_words=["ing", " de"]),
    "allowed_token_ids": _greedy(allowed_token_ids=list(range(100, 300))),
    "eos": _greedy(ignore_eos=False),
    "json": _structured(json={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}),
    "regex": _structured(regex=r"(ab|cd)+x{2,5}"),
    "choice": _structured(choice=["ab" * 12, "cd" * 12, "ef" * 12]),
    "grammar": _structured(grammar='root ::= ("ab" | "c") ("d" | "ef")+ "."'),
}
UNDRAFTED = {"logit_bias"}


@pytest.fixture(scope="module")
def engines(llama_path):
    plain = LLM(llama_path, **ENGINE_KWARGS)
    lookahead = LLM(llama_path, speculative_config={"method": "lookahead"},
                    disable_log_stats=False, **ENGINE_KWARGS)
    yield plain, lookahead
    shutdown(lookahead)
    shutdown(plain)


def run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def accepted_and_drafts(llm) -> tuple[float, float]:
    counters = metrics(llm)
    return (counters["vllm:spec_decode_num_accepted_tokens"],
            counters["vllm:spec_decode_num_drafts"])


def stop_strings_drop_later_tokens() -> bool:
    """Whether vLLM's detokenizer drops the tokens a step appended after the one that
    completed a stop string (vLLM 0.32 does; 0.26 returns them, and counts them in
    usage, for every speculative method: the text is cut at the stop string)."""
    import inspect

    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    return "token_offsets" in inspect.getsource(BaseIncrementalDetokenizer.update)


def assert_same_answers(expected, got) -> None:
    """Same tokens, texts and finish reasons; log-probabilities within tolerance. Where
    vLLM keeps the tokens of an accepted draft past a stop string (0.26), the tokens of
    a request stopped by one are plain decoding's and then that draft's rest."""
    for want, have in zip(expected, got):
        for a, b in zip(want.outputs, have.outputs):
            if isinstance(b.stop_reason, str) and not stop_strings_drop_later_tokens():
                assert list(b.token_ids)[:len(a.token_ids)] == list(a.token_ids)
            else:
                assert list(b.token_ids) == list(a.token_ids)
            assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason,
                                                                b.stop_reason)
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.keys() == y.keys()
                assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=LOGPROB_TOLERANCE)
                           for t in x)
        for x, y in zip(want.prompt_logprobs or [], have.prompt_logprobs or []):
            assert (x is None) == (y is None)
            if x is not None:
                assert all(math.isclose(x[t].logprob, y[t].logprob, abs_tol=LOGPROB_TOLERANCE)
                           for t in x)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_feature_alone_matches_plain_decoding(engines, case):
    plain, lookahead = engines
    params = CASES[case]
    expected = run(plain, PROMPTS, params)
    accepted, drafts = accepted_and_drafts(lookahead)
    got = run(lookahead, PROMPTS, params)
    accepted, drafts = (after - before for after, before in
                        zip(accepted_and_drafts(lookahead), (accepted, drafts)))
    assert_same_answers(expected, got)
    if case in UNDRAFTED:
        assert drafts == 0  # served without drafts: the plain sampler's tokens
    else:
        assert accepted > 0  # else the comparison proves nothing
    if case == "json" and all(_parses(o.outputs[0].text) for o in expected):
        assert all(_parses(o.outputs[0].text) for o in got)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_all_features_mixed_in_one_batch_match_plain_decoding(engines):
    plain, lookahead = engines
    prompts = [p for _ in CASES for p in PROMPTS]
    params = [CASES[c] for c in CASES for _ in PROMPTS]
    accepted = accepted_and_drafts(lookahead)[0]
    assert_same_answers(run(plain, prompts, params), run(lookahead, prompts, params))
    assert accepted_and_drafts(lookahead)[0] > accepted


def test_min_tokens_with_stop_tokens_matches_plain_decoding(engines):
    """min_tokens with stop tokens from the model's own loops, on a grid of both: vLLM
    masks stop tokens at a drafted row's bonus position by the count before the draft,
    so drafts crossing min_tokens stopped late (5 of these 184 requests differed)."""
    plain, lookahead = engines
    prompts = make_prompts()
    requests = [(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                        min_tokens=min_tokens, stop_token_ids=[stop]))
                for prompt, loop in zip(prompts, generate(plain, prompts, greedy(64)))
                for stop in sorted(set(loop[20:40]))[:6] for min_tokens in (12, 16, 20, 24)]
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    accepted = accepted_and_drafts(lookahead)[0]
    expected = run(plain, prompts, params)
    assert tokens(run(lookahead, prompts, params)) == tokens(expected)
    assert accepted_and_drafts(lookahead)[0] > accepted
    assert sum(o.outputs[0].finish_reason == "stop" for o in expected) > len(requests) / 2


def test_requests_vllm_refuses_under_speculation_are_served_without_drafts(engines):
    """logit_bias and min_p, sampled with a seed among drafted requests: the same tokens
    as plain decoding (a row without drafts samples as the plain sampler does), the
    drafted rows speculate, each undrafted request is counted."""
    plain, lookahead = engines
    sampled = dict(temperature=1.0, top_p=0.9, max_tokens=32, ignore_eos=True)
    undrafted = [SamplingParams(**sampled, seed=seed, **extra) for seed, extra in
                 enumerate([{"logit_bias": {7: 3.0}}, {"min_p": 0.2}] * 4)]
    prompts = make_prompts()
    drafted = [greedy(48)] * len(prompts)
    before_stats = proposer_stats(lookahead)[0].requests_without_drafts
    accepted = accepted_and_drafts(lookahead)[0]
    expected = run(plain, prompts * 2, undrafted + drafted)
    if tokens(run(plain, prompts * 2, undrafted + drafted)) != tokens(expected):
        pytest.skip("this vLLM's CPU sampler gives the same seeded batch other tokens the "
                    "second time, without speculation too (vLLM 0.26): seeded rows cannot "
                    "be compared token for token")
    got = run(lookahead, prompts * 2, undrafted + drafted)
    assert tokens(got) == tokens(expected)
    assert accepted_and_drafts(lookahead)[0] > accepted
    assert proposer_stats(lookahead)[0].requests_without_drafts - before_stats == len(undrafted)


def test_a_seeded_sample_without_drafts_is_plain_decodings(engines):
    """With drafts a seeded sample differs from plain decoding's (the rejection sampler
    draws its own random numbers; the distribution is the same, tested below); with
    ``lookahead_num_speculative_tokens: 0`` it is plain decoding's, token for token."""
    plain, lookahead = engines
    params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=seed)
              for seed in range(4)]
    expected = run(plain, PROMPTS, params)
    for p in params:
        p.extra_args = {"lookahead_num_speculative_tokens": 0}
    assert tokens(run(lookahead, PROMPTS, params)) == tokens(expected)


def test_prefix_cached_prompts_match_plain_decoding(engines):
    plain, lookahead = engines
    prompt = make_prompts()[1] * 2  # 600 tokens: many full blocks to reuse
    hits = metrics(lookahead).get("vllm:prefix_cache_hits", 0)
    expected = run(plain, [prompt], _greedy())
    first, second = (run(lookahead, [prompt], _greedy()) for _ in range(2))
    assert tokens(first) == tokens(second) == tokens(expected)
    assert metrics(lookahead)["vllm:prefix_cache_hits"] > hits


def test_max_tokens_past_max_model_len_matches_plain_decoding(engines):
    plain, lookahead = engines
    max_model_len = ENGINE_KWARGS["max_model_len"]
    prompt = (make_prompts()[1] * 4)[:max_model_len - 40]
    params = _greedy(max_tokens=200)
    expected = run(plain, [prompt], params)
    got = run(lookahead, [prompt], params)
    assert tokens(got) == tokens(expected)
    assert len(got[0].outputs[0].token_ids) == 40 and got[0].outputs[0].finish_reason == "length"


def build_lora_adapter(path, base: str) -> str:
    """A random rank-8 LoRA adapter on the tiny Llama's q and v projections (B not zero,
    unlike a fresh adapter's, so it changes the output)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(2):
        for module, width in (("q_proj", 128), ("v_proj", 64)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(8, 128, generator=generator)
            weights[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(width, 8, generator=generator)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": base}))
    return str(path)


LORA_ENGINE = dict(enable_lora=True, max_lora_rank=8, max_num_seqs=8)


def test_lora_requests_match_plain_decoding(llama_path, tmp_path):
    """A LoRA adapter's greedy requests with drafts equal the same engine's requests
    without drafts (``lookahead_num_speculative_tokens: 0``: one token a step, as plain
    decoding computes it), the adapter changing the output."""
    from vllm.lora.request import LoRARequest

    adapter = LoRARequest("tiny", 1, build_lora_adapter(tmp_path / "adapter", llama_path))
    llm = LLM(llama_path, speculative_config={"method": "lookahead"}, disable_log_stats=False,
              **LORA_ENGINE, **ENGINE_KWARGS)
    try:
        undrafted = _greedy(extra_args={"lookahead_num_speculative_tokens": 0})
        expected = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], undrafted,
                                       lora_request=adapter, use_tqdm=False))
        accepted = accepted_and_drafts(llm)[0]
        got = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(),
                                  lora_request=adapter, use_tqdm=False))
        base = tokens(run(llm, PROMPTS, _greedy()))
        assert accepted_and_drafts(llm)[0] > accepted
    finally:
        shutdown(llm)
    assert got == expected != base


def test_lora_with_too_small_a_token_budget_is_refused_at_start_up(llama_path):
    """vLLM's own check, before any process starts: LoRA with speculation needs
    max_num_batched_tokens >= max_num_seqs x (K + 1)."""
    with pytest.raises(ValueError, match="Consider increasing max_num_batched_tokens"):
        LLM(llama_path, speculative_config={"method": "lookahead"},
            **{**LORA_ENGINE, "max_num_seqs": 256, "max_num_batched_tokens": 2048},
            **ENGINE_KWARGS)


def test_exact_id_logprobs_are_refused_at_admission(engines):
    """vLLM's verification loses them or fails the engine: refused with the reason."""
    _, lookahead = engines
    params = _greedy()
    params.logprob_token_ids = [1, 2]
    with pytest.raises(Exception, match="logprob_token_ids cannot be served"):
        run(lookahead, PROMPTS[:1], params)
    assert tokens(run(lookahead, PROMPTS[:1], _greedy()))  # the engine goes on
