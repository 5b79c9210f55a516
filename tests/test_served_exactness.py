"""Greedy exactness with the defaults users get (K = 24, drafts filled to K, trees, the
cost cut), at batch 16 and batch 1, under chunked prefill and preemption, against no
speculation (``benchmarks.exactness``: the same code runs the GPU configurations).

On CPU (CI): float32, eager, drafts filled to K wherever the batch can be uniform
(``uniform_drafts: on``; without CUDA graphs ``auto`` never fills) with trees where it
cannot, and trees on with drafts never filled. On a GPU host,
``LOOKAHEAD_EXACTNESS=fp32-ieee`` with ``TRITON_F32_DEFAULT=ieee`` runs that graph-mode
configuration of ``benchmarks.exactness.CONFIGURATIONS`` instead;
``scripts/gpu_validate.sh exactness`` runs them all on a real model with its report.
"""

from __future__ import annotations

import os

import pytest
from conftest import NEAR_TIE, make_prompts

from benchmarks.divergence import compare, tie
from benchmarks.exactness import CONFIGURATIONS, passed, run_configuration

CONFIGURATION = CONFIGURATIONS[os.environ.get("LOOKAHEAD_EXACTNESS", "cpu-fp32")]
MAX_TOKENS = 96
PROMPTS = make_prompts(16)


@pytest.fixture(scope="module")
def result(llama_path):
    return run_configuration(CONFIGURATION, llama_path, PROMPTS, MAX_TOKENS,
                             max_model_len=1024, kv_bytes=64 * 2**20)


def test_the_defaults_match_plain_decoding_at_batch_16_and_1(result):
    # a reference with a near-tie could flip on rounding alone (conftest.NEAR_TIE)
    assert result["near_tie_positions"]["smallest_gap"] > NEAR_TIE
    for run in result["runs"]:
        assert run["identical"] == run["total"] == len(PROMPTS), (
            run["variant"], run["batch"], run["divergences"])
    assert result["passed"]


def test_the_steps_users_get_were_run(result):
    """Filled to K (every request of the step 1 + K tokens), trees, chunked prefill and
    preemption: the checks above are not vacuous."""
    runs = {(run["variant"], run["batch"]): run for run in result["runs"]}
    filled = runs[(CONFIGURATION.variants[0], 1)]
    assert filled["filled_steps"] > 0 and filled["draft_tokens"] >= 24 * filled["filled_steps"]
    assert sum(run["tree_steps"] for run in runs.values()) > 0
    pressed = runs[(CONFIGURATION.variants[0], len(PROMPTS))]
    assert pressed["preemptions"] > 0 and pressed["engine_overrides"]["enable_chunked_prefill"]
    assert max(map(len, PROMPTS)) > pressed["engine_overrides"]["max_num_batched_tokens"]
    for run in runs.values():  # every step counted in a graph mode (CPU: all eager)
        assert sum(run["steps_by_graph_mode"].values()) >= run["request_passes"] / run["batch"]
        if not CONFIGURATION.graphs:
            assert run["steps_by_graph_mode"]["NONE"] > 0 == run["steps_by_graph_mode"]["FULL"]
    # trees in the trees variant ran eagerly; K defaulted to 24 (the longest draft)
    trees = runs[("trees", 1)]
    assert trees["tree_steps"] > 0 and trees["steps_by_graph_mode"]["NONE"] >= trees["tree_steps"]


def test_a_divergence_is_reported_with_the_gap_it_flipped():
    top = [[(5, 20.0), (7, 19.875)], [(3, 12.0), (4, 2.0)]]  # bf16 near-tie, then wide
    reference = [([5, 3], top)]
    near = compare([[7, 3]], reference, "bfloat16")
    assert near["identical"] == 0 and near["divergences"][0]["near_tie"]
    assert near["divergences"][0]["gap_ulps"] == 1.0  # 0.125 apart: bf16's spacing at 16-32
    wide = compare([[5, 4]], reference, "bfloat16")["divergences"][0]
    assert (wide["index"], wide["near_tie"]) == (1, False)
    assert compare([[5, 3]], reference, "bfloat16") == {"identical": 1, "total": 1,
                                                        "divergences": []}
    assert not tie(top[0], "float32")["near_tie"]  # the same gap is wide in float32


def test_a_configuration_passes_only_with_the_steps_it_must_run():
    run = {"variant": "filled-pressure", "batch": 8, "identical": 8, "total": 8,
           "filled_steps": 3, "tree_steps": 2, "preemptions": 1, "divergences": []}
    assert passed({"exact": True, "runs": [run]})
    for field in ("filled_steps", "tree_steps", "preemptions"):
        assert not passed({"exact": True, "runs": [{**run, field: 0}]})
    assert not passed({"exact": True, "runs": [{**run, "identical": 7}]})
    # where the engine rounds by batch shape, only a flip at a wide gap fails
    rounding = {"near_tie": False, "within_noise": True}
    flipped = {**run, "identical": 7, "divergences": [rounding]}
    assert passed({"exact": False, "runs": [flipped]})
    wide = {**flipped, "divergences": [{**rounding, "within_noise": False}]}
    assert not passed({"exact": False, "runs": [wide]})
    assert not passed({"exact": False, "runs": [{**flipped, "divergences": [{"length": 3}]}]})
