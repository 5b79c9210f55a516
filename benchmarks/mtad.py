"""MTAD benchmark: an auxiliary model drafting for a larger target, sampling at T=1.

    python -m benchmarks.mtad [--humaneval 10] [--mt-bench 10] [--max-tokens 256]

Side by side, one engine at a time, batch 1 (one request in flight), on the first turn
of HumanEval and MT-Bench prompts: no speculation, vLLM ``draft_model`` with the same
pair, ``mtad`` with the joint rule and ``mtad`` lossless. Reported per method and
dataset: tokens/s, block efficiency (generated tokens / target forward passes,
counted by the step loop), perplexity of the generated text under the target (scored
afterwards by a plain engine from prompt log-probabilities) and HumanEval pass@1 (the
answer's code and the task's tests, run in a subprocess with a timeout). Writes the run
folder benchmarks/results/<date>-<name>/ (``--name``, default ``<machine>-<target>-mtad``):
results.json, results.md, methods.png, command.txt.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks import machine
from benchmarks.datasets import DATA_DIR, WARMUP, WARMUP_TOKENS, ChatPrompter, load
from benchmarks.engine_loop import drive
from benchmarks.models import fetch
from benchmarks.run_folder import add_arguments, command_line, make_run_folder

PASS_TIMEOUT_S = 10


def method_configs(draft_path: str, k: int) -> dict[str, dict | None]:
    """``mtad_*``: the best beam verified (linear); ``mtad_tree_*``: all beams, one tree;
    ``*_transformers``: the auxiliary model on transformers instead of vLLM's kernels."""
    mtad = {"method": "mtad", "model": draft_path, "num_speculative_tokens": k}
    return {
        "none": None,
        "draft_model": {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k},
        "mtad_joint": {**mtad, "candidates": "best"},
        "mtad_lossless": {**mtad, "candidates": "best", "acceptance": "lossless"},
        "mtad_tree_joint": {**mtad, "candidates": "all"},
        "mtad_tree_lossless": {**mtad, "candidates": "all", "acceptance": "lossless"},
        "mtad_joint_transformers": {**mtad, "candidates": "best",
                                    "auxiliary_runner": "transformers"},
    }


def generate_all(target: str, spec: dict | None, prompts: list[list[int]],
                 warmup_prompt: list[int], params, engine_args: dict) -> list[dict]:
    """Each prompt alone through a fresh engine; per prompt: tokens, passes, seconds."""
    from vllm import LLM

    llm = LLM(target, speculative_config=spec, **engine_args)
    try:
        warm = params.clone()
        warm.max_tokens = WARMUP_TOKENS
        drive(llm.llm_engine, lambda i, a: None if a else warmup_prompt, 1, warm, 1)
        loop = drive(llm.llm_engine, lambda i, a: None if a else prompts[i], len(prompts),
                     params, max_in_flight=1)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    records = sorted(loop.records, key=lambda r: r.conversation)
    return [{"output": r.output, "forward_passes": r.forward_passes,
             "decode_seconds": r.last_token - r.first_token,
             "seconds": r.finished - r.started} for r in records]


def score_under_target(target: str, prompts: list[list[int]], runs: dict[str, list[dict]],
                       engine_args: dict) -> None:
    """Adds each output's log-likelihood under the target (T=1, raw logits) to its run."""
    from vllm import LLM, SamplingParams

    llm = LLM(target, **engine_args)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    try:
        for outputs in runs.values():
            inputs = [{"prompt_token_ids": p + o["output"]} for p, o in zip(prompts, outputs)]
            for prompt, out, result in zip(prompts, outputs,
                                           llm.generate(inputs, params, use_tqdm=False)):
                tokens = out["output"]
                positions = range(len(prompt), len(prompt) + len(tokens))
                out["target_logprob"] = sum(
                    result.prompt_logprobs[i][tokens[i - len(prompt)]].logprob
                    for i in positions)
    finally:
        llm.llm_engine.engine_core.shutdown()


def code_of(answer: str) -> str:
    """The answer's first ```python block (all of it if it has none)."""
    match = re.search(r"```(?:python)?\n(.*?)(?:```|$)", answer, re.S)
    return match.group(1) if match else answer


def passes_tests(task: dict, answer: str) -> bool:
    """HumanEval check: the task's prompt (imports, stub), the answer's code, the tests."""
    program = "\n".join([task["prompt"], "    pass", code_of(answer), task["test"],
                         f"check({task['entry_point']})"])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "program.py")
        path.write_text(program)
        try:
            done = subprocess.run([sys.executable, str(path)], cwd=folder, capture_output=True,
                                  timeout=PASS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def summarize(name: str, dataset: str, outputs: list[dict], answers: list[str],
              tasks: list[dict] | None) -> dict:
    tokens = sum(len(o["output"]) for o in outputs)
    passes = sum(o["forward_passes"] for o in outputs)
    seconds = sum(o["seconds"] for o in outputs)
    row = {
        "method": name, "dataset": dataset, "requests": len(outputs), "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "block_efficiency": tokens / passes,
        "perplexity": math.exp(-sum(o["target_logprob"] for o in outputs) / tokens),
    }
    if tasks is not None:
        row["pass_at_1"] = sum(map(passes_tests, tasks, answers)) / len(tasks)
    return row


def write_results(results: dict, folder: Path) -> list[Path]:
    """results.json, results.md and methods.png in ``folder``."""
    paths = [folder / name for name in ("results.json", "results.md", "methods.png")]
    paths[0].write_text(json.dumps(results, indent=1))
    rows = results["rows"]
    base = {r["dataset"]: r["tokens_per_s"] for r in rows if r["method"] == "none"}
    rival = {r["dataset"]: r for r in rows if r["method"] == "draft_model"}
    cpu = results["machine"]
    lines = [f"# MTAD: {results['draft']} drafting for {results['target']}", "",
             f"{cpu['cpu_model']} ({cpu['cores_usable']} cores), {results['dtype']}, "
             f"T={results['temperature']}, "
             f"batch 1, K={results['k']}, up to {results['max_tokens']} new tokens, "
             f"first turns; {results['date']}.", "",
             "| dataset | method | requests | tokens/s | speedup | tokens/s vs draft_model | "
             "block efficiency | vs draft_model | perplexity | pass@1 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pass_at_1 = f"{r['pass_at_1']:.2f}" if "pass_at_1" in r else "-"
        other = rival.get(r["dataset"])
        speed_vs = f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"
        blocks_vs = (f"{r['block_efficiency'] / other['block_efficiency'] - 1:+.1%}"
                     if other else "-")
        lines.append(f"| {r['dataset']} | {r['method']} | {r['requests']} | "
                     f"{r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base[r['dataset']]:.2f}x | "
                     f"{speed_vs} | {r['block_efficiency']:.2f} | {blocks_vs} | "
                     f"{r['perplexity']:.2f} | {pass_at_1} |")
    lines += ["", "Wall time per method (engine start, warm-up, all prompts): " + ", ".join(
        f"{name} {seconds:.0f} s" for name, seconds in results["method_seconds"].items())]
    paths[1].write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(base)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for axis, metric, label in zip(axes, ("tokens_per_s", "block_efficiency", "perplexity"),
                                   ("tokens/s", "block efficiency", "perplexity (target)")):
        for i, method in enumerate(methods):
            values = [next(r[metric] for r in rows if r["method"] == method
                           and r["dataset"] == d) for d in datasets]
            width = 0.8 / len(methods)
            axis.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
        axis.set_xticks([x + 0.4 - 0.4 / len(methods) for x in range(len(datasets))], datasets)
        axis.set_title(label)
    axes[0].legend()
    figure.suptitle(f"MTAD vs draft_model: {results['draft']} -> {results['target']}")
    figure.tight_layout()
    figure.savefig(paths[2])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b",
                        help="a benchmarks.models name or a model folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b",
                        help="a benchmarks.models name or a model folder")
    parser.add_argument("--methods", default="none,draft_model,mtad_joint,mtad_lossless,"
                                              "mtad_tree_joint,mtad_tree_lossless")
    parser.add_argument("--humaneval", type=int, default=10, help="HumanEval prompts")
    parser.add_argument("--mt-bench", type=int, default=10, help="MT-Bench first turns")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help='more engine keyword arguments as JSON, e.g. '
                             '\'{"enforce_eager": false}\' for CUDA graphs')
    add_arguments(parser, "<machine>-<target>-mtad")
    args = parser.parse_args(argv)

    from vllm import SamplingParams

    target, draft = (name if Path(name).is_dir() else str(fetch(name))
                     for name in (args.target, args.draft))
    configs = method_configs(draft, args.num_speculative_tokens)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in configs]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(configs)}")
    engine_args = {**dict(enforce_eager=True, dtype=args.dtype, max_model_len=2048,
                          kv_cache_memory_bytes=1 << 30, seed=0), **args.engine_args}
    prompter = ChatPrompter(target)
    samples = {"humaneval": load("humaneval", args.humaneval),
               "mt_bench": load("mt_bench", args.mt_bench)}
    prompts = [prompter.prompt(s, []) for d in samples.values() for s in d]
    with gzip.open(DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        tasks = [json.loads(line) for line, _ in zip(f, range(args.humaneval))]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)

    runs, method_seconds = {}, {}
    for name in methods:
        started = time.perf_counter()
        runs[name] = generate_all(target, configs[name], prompts, prompter.prompt(WARMUP, []),
                                  params, engine_args)
        method_seconds[name] = time.perf_counter() - started
        print(f"{name}: {method_seconds[name]:.0f} s", flush=True)
    score_under_target(target, prompts, runs, engine_args)

    rows = []
    for name, outputs in runs.items():
        start = 0
        for dataset, dataset_samples in samples.items():
            part = outputs[start:start + len(dataset_samples)]
            start += len(dataset_samples)
            answers = [prompter.decode(o["output"]) for o in part]
            rows.append(summarize(name, dataset, part, answers,
                                  tasks if dataset == "humaneval" else None))
    results = {
        "target": args.target, "draft": args.draft, "date": date.today().isoformat(),
        "temperature": args.temperature, "dtype": args.dtype, "k": args.num_speculative_tokens,
        "max_tokens": args.max_tokens, "machine": machine.describe(),
        "software": machine.software_versions(), "git": machine.git_state(),
        "rows": rows, "method_seconds": method_seconds,
        "outputs": {name: [{"tokens": o["output"], "forward_passes": o["forward_passes"],
                            "seconds": o["seconds"], "target_logprob": o["target_logprob"]}
                           for o in outputs] for name, outputs in runs.items()},
    }
    folder = make_run_folder(args.output_dir,
                             args.name or f"{machine.default_name()}-{Path(args.target).name}-mtad",
                             command_line("benchmarks.mtad", argv))
    for path in write_results(results, folder):
        print(path)


if __name__ == "__main__":
    main()
