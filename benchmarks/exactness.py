"""Greedy exactness of lookahead against no speculation, in the modes users serve it.

    python -m benchmarks.exactness --model PATH --output-dir DIR [--configurations A,B]
        [--datasets humaneval,mt_bench] [--num-prompts 4] [--max-tokens 256] [--jobs 4]

A *configuration* is how the engines run: dtype, CUDA graphs (vLLM's default mode) or
eager, and the environment (vLLM's batch-invariant kernels, Triton's float32 dot
products). In each, one process (vLLM and Triton read the variables once): a reference engine without
speculation decodes every prompt greedily all at once (batch 8 by default) and at batch 1 (one
at a time), keeping the top two raw logits of every position; then each lookahead
*variant* (the defaults; trees on and drafts not filled; the defaults under chunked
prefill and preemption) does the same on an engine of its own, and each output is
compared with the reference of its batch. At a request's first divergence the report
gives the reference's gap between its two best logits there, also in units of the
dtype's spacing at that logit (ulp): a flip at a near-tie (``divergence.NEAR_TIE_ULPS``) is
rounding, a flip at a wide gap is a bug. The reference's own batch 1 against the whole batch is
the yardstick of how much plain decoding moves with the batch alone.

Counters prove what ran: steps by graph mode (``graph_modes``), filled and tree steps,
preemptions. A configuration fails the run (exit status 1) unless some steps were filled
to K, some grew trees and the pressure variants were preempted, and its outputs are all
identical (``exact``) or, where the engine itself is known to round differently by
batch shape, every divergence is rounding: a flip at a near-tie or within plain
decoding's own noise. Results: DIR/exactness.json and DIR/exactness.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks import graph_modes
from benchmarks.divergence import compare, near_tie_share, wobble
from benchmarks.exactness_report import where_measured, write_report

#: Variables a configuration sets in its process (vLLM and Triton read them at start);
#: the others' values are removed.
CONTROLLED_ENV = ("VLLM_BATCH_INVARIANT", "TRITON_F32_DEFAULT")


@dataclass(frozen=True)
class Configuration:
    name: str
    dtype: str
    graphs: bool  # vLLM's default CUDA graph mode (torch.compile) instead of eager
    env: tuple[tuple[str, str], ...] = ()
    exact: bool = True  # identical outputs required (else: every divergence rounding)
    variants: tuple[str, ...] = ("defaults", "trees", "defaults-pressure")


CONFIGURATIONS = {c.name: c for c in (
    # plain decoding's own output moves with the batch shape in these three (run (cl))
    Configuration("bf16", "bfloat16", graphs=True, exact=False),
    Configuration("bf16-batch-invariant", "bfloat16", graphs=True,
                  env=(("VLLM_BATCH_INVARIANT", "1"),), exact=False),
    # FlashAttention takes no float32: TRITON_ATTN, whose dot products Triton runs in
    # TF32 unless told otherwise
    Configuration("fp32", "float32", graphs=True, exact=False),
    Configuration("fp32-ieee", "float32", graphs=True, env=(("TRITON_F32_DEFAULT", "ieee"),)),
    # CPU (CI): no graphs, so nothing fills by itself: the defaults with filling forced
    Configuration("cpu-fp32", "float32", graphs=False, variants=("filled-pressure", "trees")),
)}

#: Lookahead's variants: the defaults; drafts filled to K wherever the batch can be
#: uniform, with trees where it cannot; trees on, drafts never filled.
VARIANTS = {
    "defaults": {"method": "lookahead"},
    "filled": {"method": "lookahead", "uniform_drafts": "on", "trees": "on"},
    "trees": {"method": "lookahead", "trees": "on", "uniform_drafts": "off"},
}
#: "VARIANT-pressure": chunked prefill on this token budget, and a KV pool of half the
#: tokens the batch needs (at least two of its longest requests), so that vLLM preempts
#: and recomputes requests.
PRESSURE_SUFFIX = "-pressure"
PRESSURE_BATCHED_TOKENS = 128


def engine_args(configuration: Configuration, max_model_len: int, kv_bytes: int) -> dict:
    args = dict(dtype=configuration.dtype, enforce_eager=not configuration.graphs,
                max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes, seed=0,
                disable_log_stats=False)
    if "LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION" in os.environ:  # several engines on one GPU
        args["gpu_memory_utilization"] = float(os.environ["LOOKAHEAD_TEST_GPU_MEMORY_UTILIZATION"])
    return args


def run_configuration(configuration: Configuration, model: str, prompts: list[list[int]],
                      max_tokens: int, max_model_len: int, kv_bytes: int,
                      on_progress=lambda result: None) -> dict:
    """The reference and every variant of ``configuration``, in this process (whose
    environment must already hold the configuration's ``env``: vLLM and Triton read it
    once); ``on_progress`` gets the result so far after each engine."""
    from vllm import LLM, SamplingParams

    wanted = dict(configuration.env)
    if any(os.environ.get(key) != wanted.get(key) for key in CONTROLLED_ENV):
        raise ValueError(f"configuration {configuration.name} runs with exactly these of "
                         f"{', '.join(CONTROLLED_ENV)} set: {wanted or 'none'}")
    args = engine_args(configuration, max_model_len, kv_bytes)
    reference_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                      logprobs=2)
    llm = LLM(model, logprobs_mode="raw_logits", **args)
    try:
        engine = describe_engine(llm)
        batch_all = _generate(llm, prompts, reference_params)
        batch_1 = [_generate(llm, [prompt], reference_params)[0] for prompt in prompts]
        kv_bytes_per_token = engine.pop("kv_bytes_per_token")
    finally:
        _shutdown(llm)
    reference = {len(prompts): batch_all, 1: batch_1}
    noise = wobble(batch_1, batch_all)
    result = {**dataclasses.asdict(configuration), **engine,
              "prompts": len(prompts), "max_tokens": max_tokens, "reference_wobble": noise,
              "reference_batch_1_vs_all": compare([tokens for tokens, _ in batch_1], batch_all,
                                                configuration.dtype, noise["max"]),
              "near_tie_positions": near_tie_share(batch_all, configuration.dtype),
              "runs": []}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    result.update(passed=False, complete=False)
    for variant in configuration.variants:
        on_progress(result)
        overrides = (pressure_args(prompts, max_tokens, kv_bytes_per_token)
                     if variant.endswith(PRESSURE_SUFFIX) else {})
        result["runs"] += run_variant(model, variant, {**args, **overrides}, overrides, prompts,
                                      params, reference, configuration.dtype, noise["max"])
    result.update(passed=passed(result), complete=True)
    return result


def pressure_args(prompts: list[list[int]], max_tokens: int, kv_bytes_per_token: float) -> dict:
    requests = [len(p) + max_tokens + 1 for p in prompts]
    tokens = max(sum(requests) // 2, 2 * max(requests))
    return dict(enable_chunked_prefill=True, max_num_batched_tokens=PRESSURE_BATCHED_TOKENS,
                max_model_len=max(requests), kv_cache_memory_bytes=int(kv_bytes_per_token * tokens))


def run_variant(model: str, variant: str, args: dict, overrides: dict, prompts, params,
                reference: dict, dtype: str, noise: float) -> list[dict]:
    """One engine of ``variant``: the whole batch, then batch 1; a record for each."""
    from vllm import LLM

    speculative_config = VARIANTS[variant.removesuffix(PRESSURE_SUFFIX)]
    llm = LLM(model, speculative_config=speculative_config, **args)
    records = []
    try:
        engine = describe_engine(llm)
        graph_modes.install(llm)
        for batch in (len(prompts), 1):
            before = _counters(llm)
            if batch > 1:
                outputs = [tokens for tokens, _ in _generate(llm, prompts, params)]
            else:
                outputs = [_generate(llm, [p], params)[0][0] for p in prompts]
            after = _counters(llm)
            record = {"variant": variant, "speculative_config": speculative_config,
                      "engine_overrides": overrides,
                      "kv_cache_tokens": engine["kv_cache_tokens"], "batch": batch,
                      **compare(outputs, reference[batch], dtype, noise),
                      **{name: after[name] - before[name] for name in after
                         if name != "graph_modes"},
                      "steps_by_graph_mode": graph_modes.difference(after["graph_modes"],
                                                                    before["graph_modes"])}
            records.append(record)
    finally:
        _shutdown(llm)
    return records


def passed(result: dict) -> bool:
    """Every output identical (``exact``) or every divergence rounding, and the steps
    that users' defaults run were run (filled to K, with trees; preemptions where the
    variant forces them)."""
    runs = result["runs"]
    if result["exact"]:
        identical = all(run["identical"] == run["total"] for run in runs)
    else:
        identical = all(d.get("near_tie") or d.get("within_noise")
                        for run in runs for d in run["divergences"])
    filled = sum(run["filled_steps"] for run in runs) > 0
    trees = sum(run["tree_steps"] for run in runs) > 0
    preempted = all(run["preemptions"] > 0 for run in runs
                    if run["variant"].endswith(PRESSURE_SUFFIX) and run["batch"] > 1)
    return identical and filled and trees and preempted


def describe_engine(llm) -> dict:
    """The attention backend and graph mode the engine chose, and its KV cache size."""
    def read(worker):
        runner = worker.model_runner
        groups = getattr(runner, "attn_groups", None) or [[]]
        backend = groups[0][0].backend.get_name() if groups[0] else "unknown"
        spec = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        tokens = runner.kv_cache_config.num_blocks * spec.block_size
        total = sum(t.size for t in runner.kv_cache_config.kv_cache_tensors)
        return backend, tokens, total / max(tokens, 1)

    backend, tokens, per_token = llm.collective_rpc(read)[0]
    compilation = llm.llm_engine.vllm_config.compilation_config
    return {"attention_backend": backend, "kv_cache_tokens": tokens,
            "kv_bytes_per_token": per_token,
            "cudagraph_mode": getattr(compilation.cudagraph_mode, "name",
                                      str(compilation.cudagraph_mode))}


def _counters(llm) -> dict:
    stats = llm.collective_rpc(
        lambda worker: dataclasses.asdict(worker.model_runner.drafter.stats))[0]
    preemptions = next((m.value for m in llm.get_metrics()
                        if m.name == "vllm:num_preemptions"), 0)
    return {"filled_steps": stats["filled_steps"], "tree_steps": stats["tree_steps"],
            "tree_nodes": stats["tree_nodes"], "drafts": stats["drafts"],
            "draft_tokens": stats["draft_tokens"], "request_passes": stats["request_passes"],
            "generated_tokens": stats["generated_tokens"], "preemptions": preemptions,
            "graph_modes": graph_modes.read(llm)}


def _generate(llm, prompts, params) -> list:
    """(tokens, per-position top two (token, logit) pairs, or None) of each prompt."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tops = None
        if completion.logprobs is not None:
            tops = [sorted(((token, entry.logprob) for token, entry in position.items()),
                           key=lambda pair: -pair[1])[:2] for position in completion.logprobs]
        results.append((list(completion.token_ids), tops))
    return results


def _shutdown(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# -- command line -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--configurations", default="bf16,bf16-batch-invariant,fp32")
    parser.add_argument("--datasets", default="humaneval,mt_bench")
    parser.add_argument("--num-prompts", type=int, default=4, help="per dataset")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    parser.add_argument("--jobs", type=int, default=1,
                        help="configurations run at once, each in its own process")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the configurations' JSON files in "
                             "--output-dir (those of a run that was stopped included)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker process: this configuration
    args = parser.parse_args(argv)
    names = args.configurations.split(",")
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        parser.error(f"--configurations: unknown {', '.join(unknown)}; "
                     f"known: {', '.join(CONFIGURATIONS)}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.one:
        return _run_one(args)
    if args.report_only:
        codes = [0 if (args.output_dir / f"exactness-{n}.json").exists() else 1 for n in names]
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            codes = list(pool.map(lambda name: _spawn(name, argv or sys.argv[1:], args), names))
    paths = [args.output_dir / f"exactness-{n}.json" for n in names]
    results = [json.loads(path.read_text()) for path in paths if path.exists()]
    write_report(args.output_dir, args.model, results,
                 failed=[n for n, code in zip(names, codes) if code != 0])
    return 0 if all(code == 0 for code in codes) and all(r["passed"] for r in results) else 1


def _spawn(name: str, argv: list[str], args) -> int:
    env = dict(os.environ)
    for key in CONTROLLED_ENV:
        env.pop(key, None)
    env.update(CONFIGURATIONS[name].env)
    with open(args.output_dir / f"exactness-{name}.log", "w") as log:
        return subprocess.run([sys.executable, "-m", "benchmarks.exactness", *argv,
                               "--one", name], env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode


def _run_one(args) -> int:
    from benchmarks.datasets import ChatPrompter, load

    prompter = ChatPrompter(args.model)
    samples = [s for d in args.datasets.split(",") for s in load(d, args.num_prompts)]
    prompts = [prompter.prompt(sample, []) for sample in samples]
    path = args.output_dir / f"exactness-{args.one}.json"
    measured = where_measured()

    def save(result: dict) -> None:
        path.write_text(json.dumps({**result, "samples": [s.id for s in samples],
                                    "measured": measured}, indent=1))

    save(run_configuration(CONFIGURATIONS[args.one], args.model, prompts, args.max_tokens,
                           args.max_model_len, args.kv_cache_memory_bytes, on_progress=save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
