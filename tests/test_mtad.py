"""MTAD: the joint acceptance rule, the auxiliary beam drafter, and the method end to end
(tiny random Llama as target; as auxiliary the same model, or the tiny Qwen2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import (
    ENGINE_KWARGS,
    SIGNIFICANCE,
    STRESSED,
    fake_vllm_config,
    generate,
    generate_aborting_one,
    greedy,
    make_prompts,
    metrics,
    proposer_stats,
    run_beside_scheduler,
    same_distribution_pvalue,
    sample_tokens,
    shutdown,
    stats_once_idle,
)
from vllm import LLM, SamplingParams

from vllm_lookahead.mtad.acceptance import joint_accept
from vllm_lookahead.mtad.beams import (
    AuxiliaryState,
    BeamSampler,
    DraftJob,
    sampling_distribution,
)
from vllm_lookahead.mtad.options import MTADOptions
from vllm_lookahead.mtad.transformers_drafter import TransformersDrafter
from vllm_lookahead.engine_config import parse_speculative_config_arg, rewrite_speculative_config
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.worker.scheduler import count_mtad_lookahead_slots, mtad_lookahead_slots
from vllm_lookahead.worker.scratch import scratch_blocks
from vllm_lookahead.worker.tree_attention import scratch_block_count

SAMPLED = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)


def mtad(model, **options):
    return {"method": "mtad", "model": model, "num_speculative_tokens": 4, **options}


# -- the acceptance rule against the formula -------------------------------------------


def reference_accepted(target_probs, draft, draft_logq, threshold):
    """Longest d with sum_{t<=d} log p(x_t) - log q(x_t) > log threshold (0 if none)."""
    accepted, total = 0, 0.0
    for depth, token in enumerate(draft):
        p = target_probs[depth][token]
        total += (math.log(p) if p > 0 else -math.inf) - draft_logq[depth]
        if total > math.log(threshold):
            accepted = depth + 1
    return accepted


def run_rule(rows, threshold=0.5, greedy_rows=None, bonus=None):
    """rows: (target probability rows [n, V], draft [n], draft log q [n]) per request."""
    probs = torch.tensor([p for r in rows for p in r[0]], dtype=torch.float64)
    logits = probs.clamp_min(1e-30).log().float()
    drafts = torch.tensor([t for r in rows for t in r[1]])
    logq = torch.tensor([v for r in rows for v in r[2]])
    counts = [len(r[1]) for r in rows]
    bonus = torch.tensor(bonus or [99] * len(rows))
    return joint_accept(drafts, counts, max(counts), logits, bonus, logq,
                        greedy_rows or [False] * len(rows), threshold).tolist()


P = [0.1, 0.2, 0.3, 0.4]


def test_a_failing_prefix_does_not_stop_a_longer_passing_one():
    # ratios: log(0.1/0.4) = -1.39 (fails log 0.5), then +log(0.4/0.1): total 0 (passes)
    rows = [([P, P, [0, 0, 0, 1.0]], [0, 3, 1], [math.log(0.4), math.log(0.1), 0.0])]
    # depth 3: p = 0 for token 1: fails; the token after depth 2 is sampled from p: 3
    assert reference_accepted(rows[0][0], rows[0][1], rows[0][2], 0.5) == 2
    assert run_rule(rows) == [[0, 3, 3, -1]]


def test_all_fail_gives_one_token_sampled_from_the_target():
    rows = [([[0, 0, 1.0, 0], P], [0, 1], [math.log(0.9), math.log(0.9)])]
    assert run_rule(rows) == [[2, -1, -1]]


def test_all_pass_keeps_the_bonus_token():
    rows = [([P, P, P], [3, 3, 2], [math.log(0.4), math.log(0.4), math.log(0.3)])]
    assert run_rule(rows, bonus=[7]) == [[3, 3, 2, 7]]


def test_greedy_rows_accept_the_longest_argmax_prefix_only():
    # the joint ratio would pass (q tiny), but the second token is not the argmax
    rows = [([P, P, P], [3, 0, 3], [-9.0, -9.0, -9.0]),
            ([P, P], [3, 1], [math.log(0.4), math.log(0.2)])]
    assert run_rule(rows, greedy_rows=[True, False]) == [[3, 3, -1, -1], [3, 1, 99, -1]]


def test_random_cases_match_the_formula():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        probs = rng.dirichlet(np.full(6, 0.5), size=n).tolist()
        draft = rng.integers(0, 6, size=n).tolist()
        logq = np.log(rng.uniform(0.05, 1.0, size=n)).tolist()
        threshold = float(rng.uniform(0.1, 1.0))
        expected = reference_accepted(probs, draft, logq, threshold)
        output = run_rule([(probs, draft, logq)], threshold=threshold)[0]
        assert output[:expected] == draft[:expected]
        assert output[expected] != -1 and all(t == -1 for t in output[expected + 1:])
        if expected < n:  # the extra token is one the target can sample there
            assert probs[expected][output[expected]] > 0


def run_tree_rule(after, tokens, parents, logq, threshold=0.5, greedy_row=False, bonus=99):
    """One tree row: ``after[i]`` is the target's distribution after node i (root 0)."""
    logits = torch.tensor(after, dtype=torch.float64).clamp_min(1e-30).log().float()
    return joint_accept(torch.tensor(tokens), [len(tokens)], len(tokens), logits,
                        torch.tensor([bonus]), torch.tensor(logq), [greedy_row], threshold,
                        parents=[np.array(parents)]).tolist()[0]


def reference_tree_path(after, tokens, parents, logq, threshold):
    """Nodes of the longest passing prefix over all root-to-leaf paths (first on ties)."""
    best = []
    for leaf in range(1, len(parents)):
        if leaf in parents:
            continue
        path = [leaf]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        path.reverse()
        depth = reference_accepted([after[parents[c]] for c in path],
                                   [tokens[c - 1] for c in path],
                                   [logq[c - 1] for c in path], threshold)
        if depth > len(best):
            best = path[:depth]
    return best


def test_a_tree_takes_the_path_with_the_longest_passing_prefix():
    # root -> 1 (token 0) -> 2 (token 1); root -> 3 (token 2) -> 4 (token 3)
    parents, tokens = [-1, 0, 1, 0, 3], [0, 1, 2, 3]
    after = [[0.5, 0.1, 0.3, 0.1], [0.05, 0.05, 0.45, 0.45], P, [0.1, 0.1, 0.2, 0.6]]
    logq = [math.log(0.5), math.log(0.5), math.log(0.3), math.log(0.5)]
    # path 1-2 passes at depth 1 only (0.05 / 0.5); path 3-4 at depth 2: it wins, and as
    # node 4 is the last node, vLLM's bonus token follows
    assert reference_tree_path(after, tokens, parents, logq, 0.5) == [3, 4]
    assert run_tree_rule(after, tokens, parents, logq) == [2, 3, 99, -1, -1]
    # greedy: the argmax path only (token 0, then token 2 is no child of node 1)
    assert run_tree_rule(after, tokens, parents, logq, greedy_row=True) == [0, 2, -1, -1, -1]


def test_random_trees_match_the_formula():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        parents = [-1] + [int(rng.integers(0, c)) for c in range(1, n + 1)]
        after = rng.dirichlet(np.full(6, 0.5), size=n).tolist()
        tokens = rng.integers(0, 6, size=n).tolist()
        logq = np.log(rng.uniform(0.05, 1.0, size=n)).tolist()
        threshold = float(rng.uniform(0.1, 1.0))
        path = reference_tree_path(after, tokens, parents, logq, threshold)
        output = run_tree_rule(after, tokens, parents, logq, threshold)
        assert output[:len(path)] == [tokens[c - 1] for c in path]
        assert output[len(path)] != -1 and all(t == -1 for t in output[len(path) + 1:])
        end = path[-1] if path else 0
        if end < n:  # the extra token is one the target can sample after the last node
            assert after[end][output[len(path)]] > 0
        else:
            assert output[len(path)] == 99


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


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def joint_llm(llama_path):
    llm = LLM(llama_path, speculative_config=mtad(llama_path, draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


def tokens_per_pass(llm, run):
    before = proposer_stats(llm)[0]
    outputs = run()
    after = proposer_stats(llm)[0]
    passes = after.request_passes - before.request_passes
    return outputs, (after.generated_tokens - before.generated_tokens) / passes


def test_auxiliary_equal_to_target_is_almost_always_accepted(joint_llm):
    outputs, per_pass = tokens_per_pass(joint_llm, lambda: generate(
        joint_llm, make_prompts(), SAMPLED))
    assert all(len(o) == 64 for o in outputs)
    assert per_pass > 4.3  # of at most K + 1 = 5; only a request's last step is short


def test_greedy_requests_match_plain_decoding(joint_llm, llama_reference):
    outputs, per_pass = tokens_per_pass(joint_llm, lambda: generate(
        joint_llm, make_prompts(), greedy()))
    assert outputs == llama_reference
    assert per_pass > 4.3


def test_mixed_batch_keeps_greedy_rows_exact(joint_llm, llama_reference):
    prompts = make_prompts()
    params = [greedy() if i % 2 == 0 else SAMPLED for i in range(len(prompts))]
    outputs = joint_llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
    for i, output in enumerate(outputs):
        if i % 2 == 0:
            assert list(output.outputs[0].token_ids) == llama_reference[i]


def test_logprobs_come_with_the_accepted_tokens(joint_llm):
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, logprobs=2)
    (output,) = joint_llm.generate([{"prompt_token_ids": make_prompts()[1]}], params,
                                   use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 32
    for token, candidates in zip(completion.token_ids, completion.logprobs):
        assert token in candidates and math.isfinite(candidates[token].logprob)


def test_abort_mid_generation_frees_state(joint_llm, llama_reference):
    finished = generate_aborting_one(joint_llm, [greedy(), SAMPLED, greedy()])
    assert finished == {"r0": llama_reference[0], "r2": llama_reference[2]}
    (stats,) = stats_once_idle(joint_llm)
    assert stats.active_requests == 0


def test_chunked_prefill_and_preemption_keep_greedy_exact(llama_path, llama_reference):
    """A 64-token prefill budget chunks the long prompts; a KV cache of 1024 tokens cannot
    hold the 8 requests, so some are preempted and resumed (their auxiliary cache
    rebuilt). The auxiliary layers take as much KV per token as the target's here."""
    stressed = {**STRESSED, "kv_cache_memory_bytes": 2 * STRESSED["kv_cache_memory_bytes"]}
    llm = LLM(llama_path, speculative_config=mtad(llama_path), disable_log_stats=False,
              **stressed)
    outputs = generate(llm, make_prompts(), greedy())
    sampled = generate(llm, make_prompts(), SAMPLED)
    preemptions = metrics(llm)["vllm:num_preemptions"]
    shutdown(llm)
    assert outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    assert preemptions > 0


def test_all_beams_under_a_tight_kv_budget_count_their_lookahead_slots_at_admission(
        llama_path, llama_reference):
    """candidates='all' under the KV budget of the test above: vLLM's admission estimate
    (built in Scheduler.__init__) counts the auxiliary model's gamma lookahead slots, and
    requests are preempted and resumed with their trees, greedy rows exact."""
    stressed = {**STRESSED, "kv_cache_memory_bytes": 2 * STRESSED["kv_cache_memory_bytes"]}
    result = run_beside_scheduler(llama_path, mtad(llama_path, candidates="all"), stressed,
                                  make_prompts(), greedy().max_tokens)
    assert result["num_spec_tokens"] == 16 and result["num_lookahead_tokens"] == 4
    if result["config_lookahead_tokens"] is not None:  # vLLM 0.32: Scheduler.__init__ reads it
        assert result["config_lookahead_tokens"] == 4
    if result["step_blocks"] is not None:  # vLLM 0.32's admission estimate
        assert result["step_blocks"] == math.ceil((1 + 16 + 4) / result["block_size"])
    assert result["outputs"] == llama_reference
    assert result["preemptions"] > 0


def test_all_beams_of_another_auxiliary_model_verified_as_a_tree(llama_path, qwen2_path,
                                                                  llama_reference):
    """candidates='all': the trie of all beams in one target pass (tree attention on
    CPU). Greedy rows stay exact; sampled rows accept tree nodes off the best beam; an
    auxiliary model other than the target is accepted in part."""
    llm = LLM(llama_path, speculative_config=mtad(qwen2_path, candidates="all"),
              **ENGINE_KWARGS)
    outputs = generate(llm, make_prompts(), greedy())
    sampled, per_pass = tokens_per_pass(llm, lambda: generate(llm, make_prompts(), SAMPLED))
    (stats,) = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    assert 1.0 <= per_pass < 4.0
    assert stats.tree_nodes > 0 and stats.tree_branches > 0


def test_transformers_runner_drafts_alike(llama_path, llama_reference):
    """``auxiliary_runner="transformers"`` (the fallback): the same guarantees."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, auxiliary_runner="transformers",
                                                  draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    outputs, per_pass = tokens_per_pass(llm, lambda: generate(llm, make_prompts(), greedy()))
    sampled, sampled_per_pass = tokens_per_pass(
        llm, lambda: generate(llm, make_prompts(), SAMPLED))
    shutdown(llm)
    assert outputs == llama_reference and per_pass > 4.3
    assert all(len(o) == 64 for o in sampled) and sampled_per_pass > 4.3


@pytest.mark.parametrize("candidates", ["best", "all"])
def test_lossless_mode_keeps_the_target_distribution(llama_path, plain_samples,
                                                      llama_reference, candidates):
    """The lossless rule, on the best beam and on the trie of all beams: samples follow
    the target's distribution, and greedy rows stay exact."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, acceptance="lossless",
                                                  candidates=candidates), **ENGINE_KWARGS)
    prompt, reference = plain_samples
    speculated, per_pass = tokens_per_pass(llm, lambda: sample_tokens(llm, prompt))
    outputs = generate(llm, make_prompts(), greedy())
    (stats,) = proposer_stats(llm)
    shutdown(llm)
    assert outputs == llama_reference
    assert per_pass > 1.3  # drafts really were verified (4 tokens a request)
    if candidates == "all":
        assert stats.tree_nodes > 0 and stats.tree_branches > 0
    for position in (1, 2, 3):
        assert same_distribution_pvalue(reference[:, position],
                                        speculated[:, position]) > SIGNIFICANCE


@pytest.mark.once
def test_joint_mode_shifts_the_distribution(llama_path, plain_samples):
    """Control for the test above: the joint rule is not lossless (it keeps the most
    likely of the sampled beams), and the same test sees it. Beams sampled at a low
    temperature make the shift plain: a likely token passes the joint ratio more often
    than the target samples it (from the target itself at temperature 1, position 1's
    p-value was 0.0007 against the 0.001 threshold)."""
    llm = LLM(llama_path, speculative_config=mtad(llama_path, draft_temperature=0.3,
                                                  draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    prompt, reference = plain_samples
    speculated = sample_tokens(llm, prompt)
    shutdown(llm)
    pvalues = [same_distribution_pvalue(reference[:, p], speculated[:, p]) for p in (1, 2, 3)]
    assert min(pvalues) < SIGNIFICANCE


def test_tp2_drafts_on_the_first_rank_and_agrees(llama_path, llama_reference, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm = LLM(llama_path, tensor_parallel_size=2, distributed_executor_backend="mp",
              speculative_config=mtad(llama_path, draft_top_k=0, draft_top_p=1.0),
              **ENGINE_KWARGS)
    greedy_outputs = generate(llm, make_prompts(), greedy())
    sampled = generate(llm, make_prompts(), SAMPLED)
    stats = proposer_stats(llm)
    shutdown(llm)
    assert greedy_outputs == llama_reference
    assert all(len(o) == 64 for o in sampled)
    # rank 1 verified with rank 0's log-probabilities (a mismatch raises in accept)
    assert stats[0].draft_tokens == stats[1].draft_tokens > 0
