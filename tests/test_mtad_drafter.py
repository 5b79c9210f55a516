"""MTAD's auxiliary beam drafter and its configuration errors at start-up (tiny random
Llama as target; as auxiliary the same model, or the tiny Qwen2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ENGINE_KWARGS, fake_vllm_config, make_prompts, mtad
from vllm import LLM

from vllm_lookahead.mtad.beams import (
    AuxiliaryState,
    BeamSampler,
    DraftJob,
    sampling_distribution,
)
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.mtad.transformers_drafter import TransformersDrafter
from vllm_lookahead.engine_config import (
    parse_speculative_config_arg,
    rewrite_speculative_config,
)
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.worker.scheduler import count_mtad_lookahead_slots, mtad_lookahead_slots
from vllm_lookahead.worker.scratch import scratch_blocks
from vllm_lookahead.worker.tree_attention import scratch_block_count

# -- the auxiliary drafter ----------------------------------------------------------------


@pytest.fixture(scope="module")
def aux_model(llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def test_sampling_distribution_applies_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert sampling_distribution(logits, 1.0, 2, 1.0)[0].tolist() == pytest.approx(
        [0.625, 0.375, 0, 0])
    assert sampling_distribution(logits, 1.0, 0, 0.8)[0].tolist() == pytest.approx(
        [0.625, 0.375, 0, 0])  # 0.5 + 0.3 covers 0.8: the rest is cut
    assert sampling_distribution(logits, 1.0, 0, 1.0)[0].tolist() == pytest.approx(
        [0.5, 0.3, 0.15, 0.05])
    assert sampling_distribution(logits, 1.0, 3, 0.8)[0].tolist() == pytest.approx(
        [0.625, 0.375, 0, 0])  # both: top-p among the top 3
    assert sampling_distribution(logits, 2.0, 0, 1.0)[0].tolist() == pytest.approx(
        (torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt() / torch.tensor(
            [0.5, 0.3, 0.15, 0.05]).sqrt().sum()).tolist())


def transformers_drafter(model, beam_width):
    return TransformersDrafter(model, BeamSampler(beam_width, temperature=1.0, top_k=0,
                                                  top_p=1.0, seed=0, device=torch.device("cpu")))


def draft(drafter, jobs):
    """(tokens, log q) of each job's best beam."""
    return [beams.best() for beams in drafter.draft(jobs)]


def test_drafts_continue_from_the_committed_cache(aux_model):
    """Drafting extends a request's cache and cuts the beams off again: a draft made
    after earlier drafts (and a partial acceptance) equals one from a fresh cache."""
    drafter = transformers_drafter(aux_model, beam_width=4)
    context = np.array(make_prompts()[3][:40])
    state = AuxiliaryState()
    ((first, _),) = draft(drafter, [DraftJob(state, context[:30], 4, argmax=True)])
    assert state.cache.get_seq_length() == state.length == 30
    context = np.concatenate([context[:30], first[:2], [7]])  # two accepted, one sampled
    ((again, logq),) = draft(drafter, [DraftJob(state, context, 5, argmax=True)])
    ((fresh, fresh_logq),) = draft(drafter, [DraftJob(AuxiliaryState(), context, 5, True)])
    assert again == fresh and len(again) == 5
    assert logq == pytest.approx(fresh_logq, abs=1e-4)
    assert logq == pytest.approx(plain_logq(aux_model, context, again), abs=1e-4)


def plain_logq(model, context, draft):
    """log q of each draft token, read off one plain forward pass over context + draft."""
    full = torch.tensor(np.concatenate([context, draft]))[None]
    logits = model(input_ids=full).logits[0, len(context) - 1:-1]
    return torch.log_softmax(logits, -1)[torch.arange(len(draft)), torch.tensor(draft)].tolist()


def test_sampled_beams_keep_the_best_of_several(aux_model):
    drafter = transformers_drafter(aux_model, beam_width=4)
    context = np.array(make_prompts()[1][:50])
    drafts = {tuple(draft(drafter, [DraftJob(AuxiliaryState(), context, 4, False)])[0][0])
              for _ in range(20)}
    assert len(drafts) > 1  # sampled, not the argmax chain
    assert all(len(d) == 4 for d in drafts)


def test_a_batch_of_requests_drafts_as_each_alone(aux_model):
    """Beam steps of several requests share one left-padded batch: contexts of other
    lengths, other draft lengths and beam counts must not change a request's draft."""
    drafter = transformers_drafter(aux_model, beam_width=3)
    prompts = make_prompts()
    specs = [(prompts[1][:50], 4), (prompts[3][:12], 2), (prompts[5][:90], 5),
             (prompts[7][:30], 1)]
    alone = [draft(drafter, [DraftJob(AuxiliaryState(), np.array(p), n, True)])[0]
             for p, n in specs]
    together = draft(drafter, [DraftJob(AuxiliaryState(), np.array(p), n, True)
                              for p, n in specs])
    for (tokens, logq), (batched_tokens, batched_logq) in zip(alone, together):
        assert batched_tokens == tokens
        assert batched_logq == pytest.approx(logq, abs=1e-4)
    # sampled: 3 beams per request, reordered by parent at every step
    sampled = draft(drafter, [DraftJob(AuxiliaryState(), np.array(p), n, False)
                             for p, n in specs])
    for (prompt, n), (tokens, logq) in zip(specs, sampled):
        assert len(tokens) == n
        assert logq == pytest.approx(plain_logq(aux_model, np.array(prompt), tokens), abs=1e-4)


# -- configuration errors at startup ------------------------------------------------------


def test_missing_model_is_a_clear_error():
    with pytest.raises(ValueError, match="option 'model' is required"):
        rewrite_speculative_config({"method": "mtad"}, None)
    with pytest.raises(ValueError, match="mtad: model '/nonexistent/aux'"):
        rewrite_speculative_config(mtad("/nonexistent/aux"), None)


@pytest.mark.parametrize("option,value,accepted", [
    ("acceptance", "greedy", "'joint' or 'lossless'"),
    ("acceptance_threshold", 0, r"\(0, 1\]"),
    ("beam_width", 0, r"in \[1, 16\]"),
    ("beam_width", 17, r"in \[1, 16\] \(got 17\)"),
    ("draft_top_p", 1.5, r"\(0, 1\]"),
    ("auxiliary_runner", "hf", "'vllm' or 'transformers'"),
])
def test_bad_options_name_the_option_and_the_accepted_values(llama_path, option, value,
                                                             accepted):
    with pytest.raises(ValueError, match=f"mtad: {option} must be .*{accepted}"):
        rewrite_speculative_config(mtad(llama_path, **{option: value}), None)


def test_options_reach_the_workers(llama_path):
    spec, extra = rewrite_speculative_config(mtad(llama_path, beam_width=2), None)
    assert spec == {"method": "custom_class", "num_speculative_tokens": 4,
                    "model": "vllm_lookahead.mtad.proposer.MTADProposer"}
    assert extra["vllm_lookahead"]["model"] == llama_path
    assert extra["vllm_lookahead"]["beam_width"] == 2
    # all beams verified: vLLM schedules the whole tree, gamma x B tokens
    spec, extra = rewrite_speculative_config(mtad(llama_path, beam_width=3,
                                                  candidates="all"), None)
    assert spec["num_speculative_tokens"] == 12
    options = MTADOptions.from_dict({"model": "m", "beam_width": 3, "candidates": "auto"})
    assert options.draft_length(12) == 4
    with pytest.raises(ValueError, match="schedule 160 draft tokens.*candidates to 'best'"):
        rewrite_speculative_config(mtad(llama_path, num_speculative_tokens=40,
                                        candidates="all"), None)


def test_command_line_accepts_mtad_and_rejects_bad_values(llama_path):
    import argparse

    text = f'{{"method": "mtad", "model": "{llama_path}", "beam_width": 2}}'
    assert parse_speculative_config_arg(text)["beam_width"] == 2
    with pytest.raises(argparse.ArgumentTypeError, match="mtad: beam_width"):
        parse_speculative_config_arg(text.replace('"beam_width": 2', '"beam_width": -1'))


def test_vocabulary_mismatch_names_both_sizes(llama_path, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=1,
                num_attention_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens.* one of 512"):
        LLM(llama_path, speculative_config=mtad(str(tmp_path)), **ENGINE_KWARGS)


def mtad_config(num_speculative_tokens, **options):
    return fake_vllm_config(num_speculative_tokens, 1024, {ADDITIONAL_CONFIG_KEY: {
        "method": "mtad", "model": "m", **options}})


def test_all_beams_reserve_kv_for_the_draft_length_not_the_node_budget():
    """With candidates='all' vLLM's num_speculative_tokens is gamma x B (16 here), but a
    beam, a path of the trie and the auxiliary model's lookahead are gamma (4) long."""
    all_beams = mtad_config(16, candidates="all", beam_width=4)
    best_beam = mtad_config(4, candidates="best", beam_width=4)
    block_size = 4  # gamma x B would span 5 blocks a beam, gamma spans 2
    blocks = scratch_blocks(all_beams, 2000, block_size)
    assert len(blocks.beams) == len(scratch_blocks(best_beam, 2000, block_size).beams)
    assert len(blocks.beams) == 8 * 3 * 2  # max_num_seqs x (B - 1) x blocks a beam
    assert len(blocks.trees) == scratch_block_count(2000, block_size, 4)
    assert mtad_lookahead_slots(all_beams) == mtad_lookahead_slots(best_beam) == 4
    assert count_mtad_lookahead_slots(lambda config: 0)(all_beams) == 4
    assert count_mtad_lookahead_slots(lambda config: 7)(all_beams) == 7  # vLLM's own, if more
    assert mtad_lookahead_slots(fake_vllm_config(5, 1024, {ADDITIONAL_CONFIG_KEY: {
        "method": "lookahead"}})) == 0
