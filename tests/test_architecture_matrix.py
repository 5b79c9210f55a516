"""Decoder families a user may serve (``tiny_models.FAMILIES``, tiny random float32
models whose greedy text loops, so drafts are accepted): with lookahead each gives
plain decoding's tokens with drafts accepted, with trees where its attention takes
them; where it cannot, its drafts are linear with a start-up log line naming why, and
``trees: "on"`` is refused at start-up naming the reason and what to do; models with a
recurrent state (state-space or linear-attention layers) are refused at start-up
(docs/compatibility.md, "Architectures").

The reference is plain decoding in the same engine: requests with
``lookahead_num_speculative_tokens: 0`` get no drafts and compute one token a step, as
an engine without speculation does (on the tiny Llama it is checked against a plain
engine's output); its logit margins are checked free of near-ties. The engines run one
after another in one process of their own (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine
core and worker in that process, seconds an engine instead of tens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from conftest import ENGINE_KWARGS, NEAR_TIE, greedy, make_prompts
from tiny_models import build_model

TREES = "exact, trees"
LINEAR = "exact, linear drafts"
REFUSED = "refused at start-up"
NOT_RUN = "not run by vLLM"
#: What the start-up log line (trees ``auto``) and the refusal of trees ``on`` name for
#: a model whose attention cannot take tree drafts; the refusal of a model with state.
WHY_LINEAR = "sliding window, ALiBi, attention sinks or soft-capping"
WHY_REFUSED = "keep a recurrent state that vLLM's speculative verification does not keep exact"


@dataclass(frozen=True)
class Family:
    status: str  # on vLLM 0.32 (and later)
    on_0_26: str = ""  # on vLLM 0.26, where it differs

    def here(self) -> str:
        import vllm

        return self.on_0_26 or self.status if vllm.__version__.startswith("0.26.") else self.status


#: Each family's status with lookahead's defaults and with ``trees: "on"``. On vLLM
#: 0.26 the tree step's self-check fails on OLMo 2 and StarCoder2 (the request's blocks
#: after the KV move differ), so trees ``auto`` leave their drafts linear and ``on`` is
#: refused; its CPU attention does not run the sliding-window Mistral at all (plain
#: decoding fails: "Check failed: input.block_size % attn_impl::BlockSizeAlignment").
STATUSES = {
    "llama": Family(TREES),
    "qwen2": Family(TREES),
    "qwen3": Family(TREES),
    "mistral": Family(LINEAR, NOT_RUN),
    "gemma2": Family(LINEAR),
    "gemma3": Family(LINEAR),
    "phi3": Family(TREES),
    "granite": Family(TREES),
    "olmo2": Family(TREES),
    "starcoder2": Family(TREES),
    "gpt2": Family(TREES),
    "mixtral": Family(TREES),
    "qwen3_moe": Family(TREES),
    "granitemoehybrid": Family(REFUSED),
    "qwen3_next": Family(REFUSED),
}
#: Run first in the process: each engine there inherits the class-level wraps of the
#: engines before it (the attention forwards), and vLLM 0.26 runs these families through
#: its Transformers modeling backend, whose attention layers are not submodules of the
#: model: a tree step that did not find them failed its self-check only when first.
FIRST_IN_PROCESS = ("olmo2", "starcoder2")
PROMPTS = make_prompts()
MAX_TOKENS = greedy().max_tokens

#: Runs every family's engines one after another in this process (config: JSON in
#: argv[1]) and prints, between markers, what each did: its log, and as JSON the
#: undrafted reference with its smallest top-two logit gap, the drafted and the linear
#: requests' tokens, accepted draft tokens, the drafter's counters, the errors of
#: refused starts.
FAMILY_RUNS = """
import dataclasses, json, sys, time
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

config = json.loads(sys.argv[1])
prompts = [{"prompt_token_ids": p} for p in config["prompts"]]


def params(extra_args=None, logprobs=None):
    return SamplingParams(temperature=0, max_tokens=config["max_tokens"], ignore_eos=True,
                          extra_args=extra_args, logprobs=logprobs)


def accepted(llm):
    return next(m.value for m in llm.get_metrics()
                if m.name == "vllm:spec_decode_num_accepted_tokens")


def start(path, spec):
    try:
        return LLM(path, speculative_config=spec, disable_log_stats=False,
                   **config["engine"]), None
    except Exception as exc:  # a refusal: its message
        cleanup_dist_env_and_memory()
        return None, f"{type(exc).__name__}: {exc}"


def stop(llm):
    # vLLM keeps an in-process engine's process groups (expert parallel only where the
    # model has experts) unless told: the next model starts from none
    llm.llm_engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()


for name, job in config["families"].items():
    print(f"=== FAMILY {name} BEGIN", flush=True)
    result, began = {}, time.perf_counter()
    llm, result["error"] = start(job["path"], job["spec"])
    if llm is not None:
        outputs = llm.generate(prompts, params({"lookahead_num_speculative_tokens": 0}, 2),
                               use_tqdm=False)
        result["reference"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["gap"] = min(sorted(e.logprob for e in position.values())[-1]
                            - sorted(e.logprob for e in position.values())[-2]
                            for o in outputs for position in o.outputs[0].logprobs)
        before = accepted(llm)
        result["drafted"] = [list(o.outputs[0].token_ids)
                             for o in llm.generate(prompts, params(), use_tqdm=False)]
        result["accepted"] = accepted(llm) - before
        linear = {"lookahead_tree_candidates": 0, "lookahead_tree_window": 0}
        result["linear"] = [list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, params(linear), use_tqdm=False)]
        stats = llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats)[0]
        result["stats"] = dataclasses.asdict(stats)
        stop(llm)
        del llm
    if job["trees_on_refused"]:
        _, result["trees_on_error"] = start(job["path"], {"method": "lookahead", "trees": "on"})
    result["seconds"] = time.perf_counter() - began
    print(f"=== FAMILY {name} RESULT " + json.dumps(result), flush=True)
"""


def _job(name: str, path: str) -> dict:
    status = STATUSES[name].here()
    spec = {"method": "lookahead", "trees": "on"} if status == TREES else {"method": "lookahead"}
    return {"path": path, "spec": spec, "trees_on_refused": status == LINEAR}


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, llama_path) -> dict[str, tuple[dict, str]]:
    """Each family's (results, log) from one process running them all (``FAMILY_RUNS``)."""
    families = {name: _job(name, llama_path if name == "llama"  # conftest's tiny Llama
                           else str(build_model(tmp_path_factory.mktemp(name), name)))
                for name in sorted(STATUSES, key=lambda name: (name not in FIRST_IN_PROCESS, name))
                if STATUSES[name].here() != NOT_RUN}
    config = {"families": families, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
              "engine": ENGINE_KWARGS}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, "-c", FAMILY_RUNS, json.dumps(config)], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                         timeout=1800)
    assert run.returncode == 0, run.stdout[-5000:]
    runs = {}
    for name in families:
        log = run.stdout.split(f"=== FAMILY {name} BEGIN", 1)[1]
        log, result = log.split(f"=== FAMILY {name} RESULT ", 1)
        runs[name] = (json.loads(result.split("\n", 1)[0]), log)
    return runs


@pytest.mark.parametrize("name", sorted(STATUSES))
def test_each_family_with_lookahead(name, family_runs, request):
    status = STATUSES[name].here()
    if status == NOT_RUN:
        pytest.skip(f"this vLLM's CPU backend does not run {name} (see STATUSES)")
    result, log = family_runs[name]
    if status == REFUSED:  # before any process starts, naming why
        assert WHY_REFUSED in result["error"] and "reference" not in result
        return
    assert result["error"] is None, result["error"]
    reference = result["reference"]
    assert result["gap"] > NEAR_TIE  # no near-tie: rounding alone cannot flip a token
    if name == "llama":  # the in-engine reference is a plain engine's output
        assert reference == request.getfixturevalue("llama_reference")
    assert result["drafted"] == result["linear"] == reference
    assert result["accepted"] > len(PROMPTS) * MAX_TOKENS / 4  # most tokens came drafted
    stats = result["stats"]
    if status == TREES:
        assert stats["tree_check"] == 1 and stats["tree_steps"] > 0 and stats["tree_nodes"] > 0
        return
    assert stats["tree_nodes"] == 0
    # the defaults said why drafts stay linear; trees "on" is refused, naming it
    assert f"this model's attention cannot take them here: {WHY_LINEAR}" in log
    assert (f"need tree attention, which this model cannot take here: {WHY_LINEAR}"
            in result["trees_on_error"])
    assert "Set both to 0 (linear drafts) for this model" in result["trees_on_error"]
