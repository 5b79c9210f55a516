"""Shared fixtures: tiny random models built once per session, engine settings for CPU."""

from __future__ import annotations

import os
import time

import pytest
from engine_processes import engines_in_this_process, run_engines_in_this_process
from tiny_models import build_model

# Tests read proposer counters from the worker through LLM.collective_rpc(callable).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Under pytest-xdist each test process's engines compute on a core of their own: vLLM's
# "auto" binds every engine's worker to the first core, both processes' alike.
# Engines in the test process itself (``IN_PROCESS_FILES``) compute on its threads, which
# vLLM 0.32 does not bind there: one thread, or each process's threads on every core
# spin-wait on the other's.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                          str(int(os.environ["PYTEST_XDIST_WORKER"][2:]) % os.cpu_count()))
    import torch

    torch.set_num_threads(1)

#: The lookahead configuration the engine tests run (K=5, default options): trees
#: ``auto``, which try both step shapes at each batch size before choosing one
#: (``lookahead/tree_choice.py``), so the engine tests verify tree and linear steps.
LOOKAHEAD = {"method": "lookahead", "num_speculative_tokens": 5}
#: Lookahead with draft rescoring and Token Recycling: the target's top-k is captured
#: at every draft position and at each row's last position.
CAPTURING = {**LOOKAHEAD, "rescoring_top_k": 3, "recycle_top_k": 4}
#: Tree drafts with branches that win often on the tiny models: main drafts from the
#: pool only (no context match), which is often wrong where a tree candidate or the
#: Jacobi window is right, so accepted paths leave the first chain (KV moved).
TREE = {**LOOKAHEAD, "num_speculative_tokens": 12, "trees": "on", "tree_candidates": 3,
        "tree_window": 3, "recycle_top_k": 4, "suffix_match_min": 16, "draft_min_prob": 0.0,
        "cost_aware_drafts": False}

#: Engine settings every CPU test shares: eager (torch.compile on CPU costs minutes),
#: float32 (greedy must be bit-exact), an explicit KV budget (the CPU default is a
#: fraction of node memory minus the worker's RSS, which is not predictable).
#: LOOKAHEAD_TEST_DTYPE=bfloat16 is scripts/gpu_validate.sh's informational bf16 run:
#: a k-token verification pass and k one-token passes need not round alike in bf16.
#: LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION lets several test processes share one GPU
#: (pytest -n): vLLM refuses to start unless that share of the device is free.
ENGINE_KWARGS = dict(
    enforce_eager=True,
    dtype=os.environ.get("LOOKAHEAD_TEST_DTYPE", "float32"),
    max_model_len=1024,
    kv_cache_memory_bytes=64 * 2**20,
    seed=0,
)
if "LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION" in os.environ:  # else vLLM's default
    ENGINE_KWARGS["gpu_memory_utilization"] = float(
        os.environ["LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION"])


# Chunked prefill with a 64-token budget splits the long prompts (up to 300 tokens);
# a KV cache of 1024 tokens cannot hold the 8 requests (~1650 tokens) at once, so
# some are preempted and recomputed (1 MiB in float32, half that in a 2-byte dtype).
_KV_BYTES_1024_TOKENS = 1024 * 1024 // (1 if ENGINE_KWARGS["dtype"] == "float32" else 2)
STRESSED = {**ENGINE_KWARGS, "max_model_len": 512, "enable_chunked_prefill": True,
            "max_num_batched_tokens": 64, "kv_cache_memory_bytes": _KV_BYTES_1024_TOKENS}


def mtad(model: str, **options) -> dict:
    """MTAD's speculative config with ``model`` as auxiliary, K = 4."""
    return {"method": "mtad", "model": model, "num_speculative_tokens": 4, **options}


#: The test files that take longest (``--durations`` on vLLM 0.26.0 and 0.32.0), slowest
#: first: they are collected first, so that with one file per process (scripts/test.sh:
#: pytest-xdist, ``--dist loadfile --no-loadscope-reorder``) the processes finish together
#: instead of one running a slow file alone at the end.
SLOWEST_FILES = ("test_ray.py", "test_architecture_matrix.py", "test_server.py",
                 "test_tensor_parallel.py", "test_mtad.py", "test_tree_check.py",
                 "test_in_process.py", "test_served_exactness.py", "test_sampling.py",
                 "test_step_cost.py", "test_tree.py", "test_config.py", "test_request_matrix.py",
                 "test_greedy_qwen2.py", "test_proposer.py", "test_greedy_exact.py")


#: Test files that start no engine and call no vLLM code whose behaviour changes with
#: its version: marked ``once``.
VERSION_INDEPENDENT_FILES = (
    "test_architecture.py", "test_benchmark_metrics.py", "test_benchmarks.py",
    "test_calibration.py", "test_compatibility_docs.py", "test_cost_aware_cut.py",
    "test_docs.py", "test_draft_sources.py", "test_mtad_rule.py", "test_offline_measurement.py",
    "test_proposer_feedback.py", "test_replay.py")
#: The fast lane (``scripts/test.sh --fast``, marker ``fast``): the proposer's logic
#: and the greedy exactness core (batch 1 and 8, chunked prefill, preemption, the
#: defaults at batch 16, the request matrix), for the edit loop; CI runs everything.
FAST_FILES = VERSION_INDEPENDENT_FILES + (
    "test_budget.py", "test_proposer.py", "test_proposer_trees.py", "test_uniform_drafts.py",
    "test_request_support.py", "test_tree_attention.py", "test_cpu_top_p.py",
    "test_undrafted_steps.py", "test_cpu_recovered_tokens.py",
    "test_greedy_exact.py", "test_served_exactness.py", "test_request_matrix.py")


#: Test files whose offline engines run in pytest's own process
#: (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core and worker in the caller, vLLM
#: already imported): an engine starts in seconds where a new engine-core process and
#: its worker process import vLLM for 20-40 s. The session's plain references run so
#: too. The other files keep vLLM's default processes, as users run it (servers always
#: run as processes of their own).
IN_PROCESS_FILES = (
    "test_greedy_exact.py", "test_greedy_qwen2.py", "test_served_exactness.py",
    "test_tensor_parallel.py", "test_step_cost.py", "test_request_matrix.py", "test_mtad.py",
    "test_mtad_drafter.py", "test_sampling.py", "test_tree.py", "test_tree_check.py")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a test's fixtures: its file's engines in this process or in their own
    (``IN_PROCESS_FILES``)."""
    run_engines_in_this_process(item.path.name in IN_PROCESS_FILES)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the markers added here
def pytest_collection_modifyitems(config, items):
    """The slowest files first (``SLOWEST_FILES``; the order within a file stays); the
    ``fast`` and ``once`` markers of whole files (``FAST_FILES``,
    ``VERSION_INDEPENDENT_FILES``). Tests marked ``once`` are skipped where
    scripts/test.sh has already run them with another vLLM version (it names that
    version in LOOKAHEAD_ONCE_TESTS_RAN_WITH): what they check does not change with
    vLLM's version, or (the torch.compile test) costs a minute an engine and is covered
    on the GPU host's version by gpu_validate.sh."""
    rank = {name: position for position, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))
    for item in items:
        if item.path.name in FAST_FILES:
            item.add_marker(pytest.mark.fast)
        if item.path.name in VERSION_INDEPENDENT_FILES:
            item.add_marker(pytest.mark.once)
    ran_with = os.environ.get("LOOKAHEAD_ONCE_TESTS_RAN_WITH")
    if not ran_with:
        return
    skip = pytest.mark.skip(reason=f"marked once: ran with vLLM {ran_with} in this run")
    for item in items:
        if "once" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("llama"), "llama", seed=0))


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=1,
                           residual_scale=2e-3))


def greedy(max_tokens: int = 96):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def make_prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (6 to ~300): half repeat themselves, half do not."""
    import random

    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = [6, 300, 40, 150, 17, 220, 90, 64][i % 8]
        if i % 2 == 0:  # repetitive: a short phrase repeated, with a little noise
            phrase = [rng.randrange(4, 500) for _ in range(rng.randint(3, 9))]
            tokens = [t if rng.random() > 0.05 else rng.randrange(4, 500)
                      for _ in range(length // len(phrase) + 1) for t in phrase]
        else:
            tokens = [rng.randrange(4, 500) for _ in range(length)]
        prompts.append(tokens[:length])
    return prompts


def generate(llm, prompts, sampling_params):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def metrics(llm) -> dict:
    """vLLM's counters as {name: value} (needs disable_log_stats=False)."""
    values = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None and hasattr(metric, "values"):
            value = list(metric.values)
        values[metric.name] = value
    return values


def generate_aborting_one(llm, params: list) -> dict[str, list[int]]:
    """Requests "r0", "r1", ... (make_prompts()' first ones, ``params[i]`` each) through
    the engine's step loop, "r1" aborted at its first output, mid-generation with drafts
    in flight; the finished ones' tokens by id."""
    engine = llm.llm_engine
    for index, (prompt, request_params) in enumerate(zip(make_prompts(), params)):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, request_params)
    finished, aborted = {}, False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "r1" and not aborted:
                engine.abort_request(["r1"])
                aborted = True
            elif output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    assert aborted
    return finished


def proposer_stats(llm):
    """The lookahead proposer's counters on every worker (one per TP rank)."""
    return llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats)


def stats_once_idle(llm, timeout_s: float = 30.0):
    """Proposer counters once every request's state is freed.

    The scheduler reports a finished request to the runner in the engine's next step,
    which the engine-core process runs right after returning the last output; an RPC
    sent at once may be served before that step, so wait for it (bounded). An engine
    core in this process steps only when asked: that step is taken here.
    """
    deadline = time.monotonic() + timeout_s
    in_process = type(llm.llm_engine.engine_core).__name__ == "InprocClient"
    while True:
        if in_process:
            llm.llm_engine.step()
        stats = proposer_stats(llm)
        if all(s.active_requests == 0 for s in stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def fake_vllm_config(k, max_model_len, additional_config=None, instance_id=""):
    """The parts of VllmConfig the proposer reads, for tests without an engine
    (no instance id: no metrics snapshots)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len, served_model_name="m",
                                     get_vocab_size=lambda: 1024),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
        additional_config=additional_config or {},
        instance_id=instance_id,
    )


#: Seconds an engine may take to exit before it is killed. vLLM's default grace is 5 s,
#: and on CPU the engine core outlives it anyway (its worker alone takes 3-4 s to
#: exit), so every shutdown cost 5 s; the tests need nothing of a graceful exit.
SHUTDOWN_GRACE_S = 0.5


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)


#: A 400-token prompt that runs into max_model_len (512) of the stressed engine
#: (prompt 5 repeated: prompt 2 repeated met a near-tie, see ``NEAR_TIE``).
LONG_PROMPT = (make_prompts()[5] * 2)[:400]
LONG_MAX_TOKENS = 112

#: The smallest gap between the top two logits a greedy reference may have. A pass of
#: k query tokens and one of a single token need not round alike even in float32
#: (vLLM 0.26's CPU attention differs by ~1e-6): at a near-tie the next token then
#: depends on the draft length, for vLLM's own ngram too, and no comparison with
#: plain decoding can stand. 50x that difference.
NEAR_TIE = 5e-5


def generate_with_margins(llm, prompts, sampling_params) -> tuple[list[list[int]], list[float]]:
    """Greedy outputs and, for each, the smallest gap between its top two logprobs."""
    sampling_params = sampling_params.clone()
    sampling_params.logprobs = 2
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params,
                           use_tqdm=False)
    tokens, margins = [], []
    for output in outputs:
        completion = output.outputs[0]
        tokens.append(list(completion.token_ids))
        margins.append(min(_top_two_gap(position) for position in completion.logprobs))
    return tokens, margins


def _top_two_gap(logprobs: dict) -> float:
    first, second = sorted((entry.logprob for entry in logprobs.values()), reverse=True)[:2]
    return first - second


@pytest.fixture(scope="session")
def plain_llama_runs(llama_path):
    """Plain greedy decoding on the tiny Llama: the ground truth for lookahead runs,
    free of near-ties (``NEAR_TIE``)."""
    from vllm import LLM

    with engines_in_this_process():
        llm = LLM(llama_path, **ENGINE_KWARGS)
        batch, batch_margins = generate_with_margins(llm, make_prompts(), greedy())
        (long,), long_margins = generate_with_margins(llm, [LONG_PROMPT],
                                                      greedy(LONG_MAX_TOKENS))
        shutdown(llm)
    for name, margin in [*enumerate(batch_margins), ("long", long_margins[0])]:
        assert margin > NEAR_TIE, (
            f"the reference of prompt {name} has a near-tie (top two logits {margin:.1e} "
            f"apart, at most NEAR_TIE {NEAR_TIE:.0e}): greedy outputs with and without "
            "drafts may differ by rounding alone; choose another prompt or model seed")
    return {"batch": batch, "long": long}


@pytest.fixture(scope="session")
def llama_reference(plain_llama_runs):
    return plain_llama_runs["batch"]


#: Distribution tests: samples per engine, and the significance of each check (one per
#: position). A run of both vLLM versions makes about 30 such checks on samples that
#: differ from run to run (vLLM batches requests as they arrive): at 0.001 one failed
#: by chance about once in 30 runs (0.0007 at position 3 in a CI run, where 6000
#: samples of the same engines with three other seeds then gave 0.48, 0.76 and 0.33).
#: At 1e-5 that is about once in 3000; the biased controls still fail it (the sampler
#: biased 20%: p below 1e-18).
SAMPLES = 1500
SIGNIFICANCE = 1e-5


def sample_tokens(llm, prompt):
    """SAMPLES 4-token samples (T=0.7, top-p 0.95) after ``prompt``, one row each."""
    import numpy as np
    from vllm import SamplingParams

    # No per-request seeds: vLLM's CPU runner crashes when a seeded request's prefill is
    # chunked ("CPU Generator does not use offset"); the engine seed keeps runs repeatable.
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outputs])


def same_distribution_pvalue(a, b) -> float:
    """Chi-square homogeneity test; tokens rarer than 10 in both samples are pooled."""
    import numpy as np
    from scipy.stats import chi2_contingency

    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    common = tokens[counts >= 10]
    table = [[np.sum(x == t) for t in common] + [np.sum(~np.isin(x, common))] for x in (a, b)]
    table = np.array(table)
    table = table[:, table.sum(axis=0) > 0]
    return chi2_contingency(table).pvalue


@pytest.fixture(scope="session")
def plain_samples(llama_path):
    """(prompt, plain decoding's samples after it): the reference distribution."""
    from vllm import LLM

    with engines_in_this_process():
        plain = LLM(llama_path, **ENGINE_KWARGS)
        # the model's own greedy loop as context: drafts are likely samples, not noise
        base = make_prompts()[0]
        prompt = base + generate(plain, [base], greedy())[0]
        reference = sample_tokens(plain, prompt)
        shutdown(plain)
    return prompt, reference
