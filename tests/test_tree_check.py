"""The tree step's start-up self-check (``worker/tree_check.py``): it passes on the real
tree step, fails where any piece of that step is broken, and a failed check leaves the
engine serving linear drafts, still exact."""

from __future__ import annotations

from functools import partial

import pytest
from conftest import (
    ENGINE_KWARGS,
    TREE,
    generate,
    greedy,
    make_prompts,
    proposer_stats,
    shutdown,
)
from tiny_models import build_model
from vllm import LLM


@pytest.fixture(scope="module")
def sharp_llama_path(tmp_path_factory):
    """A tiny Llama whose attention decides its hidden states (no residual scaling):
    the test models of the other files barely depend on a few keys and values, so a
    broken piece of the tree step would change their hidden states by too little."""
    return str(build_model(tmp_path_factory.mktemp("sharp_llama"), "llama", seed=2,
                           residual_scale=1.0))


@pytest.fixture(scope="module")
def checked_llm(sharp_llama_path):
    llm = LLM(sharp_llama_path, speculative_config=TREE, **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


def _break(piece: str) -> None:
    """Break one piece of the tree step in this worker process (restored by _check)."""
    from vllm_lookahead.worker import tree_attention

    if piece == "root-block copy":
        tree_attention.copy_root_blocks = lambda caches, dim, step: None
    elif piece == "path writes":
        def keep_without_writing(impl, layer, key, value, kv_cache, step):
            tokens = step.write_tokens.to(key.device)
            step.kept_kv.append((impl, layer, kv_cache, key[tokens], value[tokens]))

        tree_attention.prepare_layer = keep_without_writing
    elif piece == "metadata split":
        tree_attention.split_metadata = lambda common, step: common
    elif piece == "accepted path move":
        tree_attention.move_accepted_kv = lambda step, tokens, slots: None


def _check(worker, broken: str | None):
    from vllm_lookahead.worker import tree_attention, tree_check

    saved = dict(vars(tree_attention))
    try:
        if broken:
            _break(broken)
        return tree_check.run(worker.model_runner)
    finally:
        vars(tree_attention).update(saved)


def test_trees_pass_the_self_check_at_start(checked_llm):
    stats, = proposer_stats(checked_llm)
    assert stats.tree_check == 1


@pytest.mark.parametrize("broken", [None, "root-block copy", "path writes", "metadata split",
                                    "accepted path move"])
def test_the_self_check_fails_a_broken_tree_step(checked_llm, broken):
    check, = checked_llm.collective_rpc(partial(_check, broken=broken))
    assert check.dtype == "float32" and not check.reason, check.describe()
    if broken is None:
        assert check.passed, check.describe()
    else:
        assert not check.passed and check.max_difference > 10 * check.tolerance, \
            check.describe()


def test_after_a_failed_check_drafts_are_linear_and_exact(checked_llm, sharp_llama_path):
    plain = LLM(sharp_llama_path, **ENGINE_KWARGS)
    reference = generate(plain, make_prompts(), greedy())
    shutdown(plain)

    def fail(worker):
        from vllm_lookahead.worker import tree_check

        worker.model_runner.drafter.on_tree_check(tree_check.TreeCheck(
            passed=False, backend="any", dtype="float32", max_difference=1.0,
            tolerance=1e-3))

    checked_llm.collective_rpc(fail)
    assert generate(checked_llm, make_prompts(), greedy()) == reference
    stats, = proposer_stats(checked_llm)
    assert stats.tree_check == 0 and stats.tree_nodes == 0 and stats.drafts > 0
