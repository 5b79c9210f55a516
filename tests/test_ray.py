"""The plugin inside vLLM's Ray executor (``distributed_executor_backend="ray"``), tensor
parallel 1 and 2, offline and served: vLLM's own plugin loading binds the drafter in
every Ray worker, every rank drafts alike, and the output is plain decoding's.

There is no GPU here: ``ray_without_gpu/`` (on ``PYTHONPATH`` of every process of the
test's Ray cluster, the engines and the server) gives vLLM's CPU platform the Ray
device key ``"GPU"``, and the cluster offers two logical GPUs, one per worker. NCCL,
GPU workers and several nodes are not exercised (scripts/gpu_validate.sh runs this
module on CUDA when a GPU host is lent).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import (
    ENGINE_KWARGS,
    LOOKAHEAD,
    TREE,
    generate,
    greedy,
    make_prompts,
    proposer_stats,
    shutdown,
)
from test_server import Server
from test_tensor_parallel import DECISIONS, _cheap_tokens_on_first_rank

pytest.importorskip("ray", reason="Ray is installed by the test set-up (.[ray])")

TESTS = Path(__file__).parent
RAY = str(Path(sys.executable).parent / "ray")


def _ray_processes(marker: str) -> list[str]:
    """Command lines of the processes whose command line holds ``marker``."""
    found = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster with two logical GPUs, which every engine of the module
    joins (``RAY_ADDRESS``); stopped at the end, leaving no process and no shared memory
    behind."""
    on_gpu = _has_cuda()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # socket paths stay short
    saved = {name: os.environ.get(name) for name in
             ("PYTHONPATH", "RAY_ADDRESS", "VLLM_CPU_OMP_THREADS_BIND")}
    # the workers unpickle this module's functions (collective_rpc) by importing it
    path = [str(TESTS), str(TESTS.parent)]
    if not on_gpu:
        path.insert(0, str(TESTS / "ray_without_gpu"))
    os.environ["PYTHONPATH"] = os.pathsep.join(path + [p for p in [saved["PYTHONPATH"]] if p])
    if not on_gpu:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
    gpus = [] if on_gpu else ["--num-gpus", "2"]
    # One OpenMP thread a worker, which Ray's workers inherit from the cluster: vLLM 0.32's
    # multiprocessing executor sets each CPU worker's OpenMP threads and cores as it
    # spawns it, Ray's workers get none of that, and two ranks each running a thread on
    # every core made their spinning all-reduce 100 times slower (0.4 s a decode step).
    cluster_env = os.environ if on_gpu else {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([RAY, "start", "--head", "--num-cpus", "4", *gpus, "--temp-dir", temp_dir,
                    "--include-dashboard", "false", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=120, env=cluster_env)
    os.environ["RAY_ADDRESS"] = "auto"
    try:
        if not on_gpu:  # the test process's own engine cores fork from it
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.ray_device_key = "GPU"
        yield temp_dir
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not on_gpu:
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.ray_device_key = ""
    left = _ray_processes(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, f"Ray processes left behind: {left}"


def _remove_shared_memory(ident: str | None) -> None:
    """Remove the shared memory of an engine's CPU all-reduce, named by the port of its
    distributed init method (``VLLM_DIST_IDENT``): Ray kills the workers before they
    unlink it, and vLLM 0.26 takes the port from 100 up, so a later engine on this
    machine would find the name taken ("create shm in SHMManager failed. errno: 17")."""
    if not ident:
        return
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"{ident}-") and "cpushm" in name:
            os.unlink(f"/dev/shm/{name}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _need_two_devices() -> None:
    import torch

    if _has_cuda() and torch.cuda.device_count() < 2:
        pytest.skip("tensor parallel 2 needs two GPUs on this host")


def _worker_facts(worker) -> dict:
    """Where a worker runs and what the plugin did in it."""
    import sys

    import ray

    runner = worker.model_runner
    return {"pid": os.getpid(), "ray_actor": ray.get_runtime_context().get_actor_id(),
            "plugin_loaded": "vllm_lookahead.plugin" in sys.modules,
            "dist_ident": os.environ.get("VLLM_DIST_IDENT"),
            "drafter": type(runner.drafter).__module__,
            "bound": getattr(runner.drafter, "_runner", None) is runner}


def _ray_llm(model: str, **kwargs):
    from vllm import LLM

    return LLM(model, distributed_executor_backend="ray", **{**ENGINE_KWARGS, **kwargs})


def _assert_plugin_in_ray_workers(facts: list[dict], ranks: int) -> None:
    assert len(facts) == ranks, facts
    assert len({f["pid"] for f in facts}) == ranks and os.getpid() not in [f["pid"] for f in facts]
    for fact in facts:
        assert fact["ray_actor"], f"not a Ray actor: {fact}"
        assert fact["plugin_loaded"], f"vLLM did not load the plugin in a Ray worker: {fact}"
        assert fact["drafter"].startswith("vllm_lookahead.") and fact["bound"], fact


def test_tp1_defaults_match_plain_decoding(ray_cluster, llama_path, llama_reference):
    llm = _ray_llm(llama_path, speculative_config=LOOKAHEAD)
    try:
        facts = llm.collective_rpc(_worker_facts)
        outputs = generate(llm, make_prompts(), greedy())
        stats = proposer_stats(llm)
    finally:
        shutdown(llm)
    _remove_shared_memory(facts[0]["dist_ident"])
    print("TP1 rank counters:", stats)  # the evidence, with -s
    _assert_plugin_in_ray_workers(facts, 1)
    assert outputs == llama_reference
    assert stats[0].generated_tokens > 1.5 * stats[0].request_passes  # really speculated


def test_tp2_plain_and_tree_drafts_match_and_ranks_decide_alike(ray_cluster, llama_path,
                                                                 llama_reference):
    """Plain decoding under Ray at TP 2 (the same engine's requests without drafts,
    ``lookahead_num_speculative_tokens: 0``) and lookahead with trees and the cost-aware
    cut (every rank times its own steps; the first rank's budget decides) both give the
    single-process reference; both ranks take every drafting decision alike."""
    _need_two_devices()
    llm = _ray_llm(llama_path, tensor_parallel_size=2,
                   speculative_config={**TREE, "cost_aware_drafts": True})
    try:
        facts = llm.collective_rpc(_worker_facts)
        # before any step: the first rank's cost model sees no step of this machine's
        # clock, whose fit (a few ms a step) would leave the simulated one no free tokens
        llm.collective_rpc(_cheap_tokens_on_first_rank)
        undrafted = greedy()
        undrafted.extra_args = {"lookahead_num_speculative_tokens": 0}
        plain_outputs = generate(llm, make_prompts(), undrafted)
        plain_stats = proposer_stats(llm)
        outputs = generate(llm, make_prompts(), greedy())
        stats = proposer_stats(llm)
    finally:
        shutdown(llm)
    _remove_shared_memory(facts[0]["dist_ident"])
    decisions = [{name: getattr(s, name) for name in DECISIONS} for s in stats]
    print("TP2 rank decisions:", decisions)  # the evidence, with -s
    _assert_plugin_in_ray_workers(facts, 2)
    assert [s.drafts for s in plain_stats] == [0, 0]  # plain decoding: no drafts
    assert plain_outputs == llama_reference
    assert outputs == llama_reference
    assert [s.tree_check for s in stats] == [1, 1]
    assert stats[0].drafts > 0 and stats[0].tree_branches > 0 and stats[0].cut_tokens > 0
    assert decisions[0] == decisions[1]


def test_server_tp2_serves_plain_decodings_tokens_and_shuts_down_clean(
        ray_cluster, llama_path, llama_reference, tmp_path):
    _need_two_devices()
    server = Server(llama_path, ["--distributed-executor-backend", "ray",
                                 "--tensor-parallel-size", "2", "--speculative-config",
                                 "lookahead"], tmp_path / "server.log")
    try:
        server.wait_ready()
        model = server.client.models.list().data[0].id
        prompts = make_prompts()[:4]
        answers = []
        for index, prompt in enumerate(prompts):
            request = dict(model=model, prompt=prompt, max_tokens=96, temperature=0,
                           extra_body={"ignore_eos": True, "return_token_ids": True})
            if index % 2:
                chunks = server.client.completions.create(stream=True, **request)
                answers.append([t for c in chunks for t in (c.choices[0].token_ids or [])])
            else:
                answers.append(server.client.completions.create(**request).choices[0].token_ids)
        counters = {name: server.metric(name) for name in (
            "vllm:speculative_drafts_total", "vllm:speculative_generated_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")}
    finally:
        server.stop()
        idents = re.findall(r"distributed_init_method=tcp://[^:]+:(\d+)",
                            server.log_path.read_text())
        _remove_shared_memory(idents[0] if idents else None)
    assert server.process.returncode is not None
    assert answers == llama_reference[:4]
    assert all(value > 0 for value in counters.values()), counters
    deadline = time.monotonic() + 30  # the server's Ray actors end with it
    while _ray_processes("ray::RayWorker") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes("ray::RayWorker")
