"""What a tree step costs next to a linear step of the same token count (issue 8).

One engine, in this process, at batch size 1. The proposer is replaced by fixed random
drafts of T tokens (so nearly every step yields one token and the step count is the
token count): verified as a chain (``linear``), or as a tree of four chains of T/4
tokens hanging from the root (``tree``: three quarters of the nodes are off the first
chain, three branch sequences in the attention kernel's batch, each with its scratch
block filled per layer). ``none`` runs the same engine
without drafts (T = 0). Step time: mean wall time of the engine's decode steps (the
prefill step excluded), after a warm-up run; the shapes of one size are measured in turn
``--repeats`` times and each reports its median (this machine's step times drift).

    python -m benchmarks.tree_cost --model smollm2-135m --dtype bfloat16

Writes the run folder ``benchmarks/results/<date>-<name>/`` (``--name``, default
``<machine>-<model>-tree-cost``): results.json, results.md, step-cost.png, command.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone

import numpy as np

from benchmarks import machine
from benchmarks.models import MODELS, fetch
from benchmarks.run_folder import add_arguments, command_line, make_run_folder


def tree_parents(size: int, branches: int = 4) -> np.ndarray:
    """Parents of ``[root] + size`` nodes: ``branches`` chains from the root, in order."""
    parents = [-1]
    length = -(-size // branches)
    for node in range(1, size + 1):
        parents.append(0 if (node - 1) % length == 0 else node - 1)
    return np.array(parents)


def measure(llm, drafter, prompt: list[int], size: int, shape: str, new_tokens: int) -> dict:
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def propose(sampled_token_ids, *args, **kwargs):
        return [rng.integers(3, vocab, size).tolist() if tokens else []
                for tokens in sampled_token_ids]

    drafter.propose = propose
    drafter.draft_tree = (lambda req_id, scheduled: tree_parents(len(scheduled))
                          if shape == "tree" else None)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up
    durations = []
    original = llm.llm_engine.step

    def timed_step():
        start = time.perf_counter()
        outputs = original()
        durations.append(time.perf_counter() - start)
        return outputs

    llm.llm_engine.step = timed_step
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    llm.llm_engine.step = original
    decode = durations[1:]  # the first step is the prefill
    return {"shape": shape, "draft_tokens": size, "prompt_tokens": len(prompt),
            "decode_steps": len(decode), "ms_per_step": 1e3 * sum(decode) / len(decode)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", default="128,1024")
    parser.add_argument("--draft-tokens", default="8,16,24")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    add_arguments(parser, "<machine>-<model>-tree-cost")
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.tree_cost", argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the drafter lives in this process
    from vllm import LLM

    # tree_window on: the scheduler holds back the branches' scratch blocks
    llm = LLM(str(fetch(args.model)), speculative_config={"method": "lookahead",
                                                          "tree_window": 1},
              enforce_eager=True, dtype=args.dtype, max_model_len=4096,
              kv_cache_memory_bytes=1 << 30, seed=0)
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
    rng = np.random.default_rng(1)
    rows = []
    for prompt_tokens in map(int, args.prompt_tokens.split(",")):
        prompt = rng.integers(3, 30000, prompt_tokens).tolist()
        for size, shapes in [(0, ("none",))] + [
                (size, ("linear", "tree")) for size in map(int, args.draft_tokens.split(","))]:
            runs = {shape: [] for shape in shapes}
            for _ in range(args.repeats):
                for shape in shapes:
                    runs[shape].append(measure(llm, drafter, prompt, size, shape,
                                               args.new_tokens))
            for shape, measured in runs.items():
                times = [run["ms_per_step"] for run in measured]
                rows.append({**measured[0], "ms_per_step": float(np.median(times)),
                             "ms_per_step_runs": times})
                print(rows[-1], flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    now = datetime.now(timezone.utc)
    folder = make_run_folder(args.output_dir,
                             args.name or f"{machine.default_name()}-{args.model}-tree-cost",
                             args.command)
    results = {"created": now.isoformat(timespec="seconds"), "model": args.model,
               "dtype": args.dtype, "machine": machine.describe(),
               "software": machine.software_versions(), "repository": machine.git_state(),
               "rows": rows}
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Tree step vs linear step, {args.model} ({args.dtype}), batch 1", "",
             "| prompt tokens | draft tokens | shape | ms / step | vs linear |",
             "|---|---|---|---|---|"]
    linear = {(r["prompt_tokens"], r["draft_tokens"]): r["ms_per_step"]
              for r in rows if r["shape"] in ("linear", "none")}
    for r in rows:
        ratio = r["ms_per_step"] / linear[(r["prompt_tokens"], r["draft_tokens"])]
        lines.append(f"| {r['prompt_tokens']} | {r['draft_tokens']} | {r['shape']} | "
                     f"{r['ms_per_step']:.1f} | {ratio:.2f}x |")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    figure, axis = plt.subplots(figsize=(6, 4))
    for prompt_tokens in sorted({r["prompt_tokens"] for r in rows}):
        for shape, style in (("linear", "-o"), ("tree", "--s")):
            points = [(0, linear[(prompt_tokens, 0)])] + [
                (r["draft_tokens"], r["ms_per_step"]) for r in rows
                if r["prompt_tokens"] == prompt_tokens and r["shape"] == shape]
            axis.plot(*zip(*points), style, label=f"{shape}, prompt {prompt_tokens}")
    axis.set_xlabel("draft tokens per step")
    axis.set_ylabel("ms per step")
    axis.set_title(f"{args.model}: tree vs linear step cost")
    axis.legend()
    figure.tight_layout()
    figure.savefig(folder / "step-cost.png")
    print((folder / "results.md").read_text())
    print(f"results: {folder}/")


if __name__ == "__main__":
    main()
