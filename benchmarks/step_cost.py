"""What a decode step costs by tokens per request and batch size, FULL graph against
PIECEWISE, on any model: real weights, or ``--load-format dummy`` with a config alone
(an 8B-class model reaches an offline GPU host in a few KiB; ``benchmarks.dummy_model``).

    python -m benchmarks.step_cost --model DIR --load-format dummy --ks 3,15,63 \\
        --tokens 1,2,4,8,16,32,64 --batches 1,4,16,64

One engine per K of ``--ks`` (lookahead, trees off) and one without speculation, each
in this process. The proposer is replaced by fixed random drafts, so every request
computes exactly T = 1 + draft tokens a step (random drafts are rejected: each step
yields one token per request). T = 1 + K is a *uniform* batch, which vLLM replays as
its FULL decode graph; any other T runs PIECEWISE (attention launched from Python);
no speculation is vLLM's own decode step (model runner V2). The graph mode of every
timed step is counted (``graph_modes``), not assumed. Step time: the median of the
engine's decode steps after a warm-up. Writes a run folder: results.json, results.md,
step-cost.png, command.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone

import numpy as np

from benchmarks import graph_modes, machine
from benchmarks.arguments import positive_ints
from benchmarks.run_folder import add_arguments, command_line, make_run_folder

PROMPT_TOKENS = 128


def measure(llm, batch: int, tokens: int, steps: int, rng: np.random.Generator) -> dict:
    """Median step time of ``batch`` requests each computing ``tokens`` a step."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    drafter = _drafter(llm)
    if drafter is not None:
        drafter.propose = lambda sampled, *args, **kwargs: [
            rng.integers(3, vocab, tokens - 1).tolist() if row else [] for row in sampled]
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, PROMPT_TOKENS).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: these shapes, these graphs
    durations, original = [], llm.llm_engine.step

    def timed_step():
        start = time.perf_counter()
        outputs = original()
        durations.append(time.perf_counter() - start)
        return outputs

    before, drafts_before = graph_modes.read(llm), _drafts(llm)
    llm.llm_engine.step = timed_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.step = original
    decode = durations[2:]  # the prefill, and the first step after it (no drafts yet)
    drafts, draft_tokens = (after - first for after, first in zip(_drafts(llm), drafts_before))
    return {"batch": batch, "tokens_per_request": tokens, "decode_steps": len(decode),
            "ms_per_step": 1e3 * statistics.median(decode),
            "draft_tokens_per_draft": draft_tokens / drafts if drafts else 0.0,
            "steps_by_graph_mode": graph_modes.difference(graph_modes.read(llm), before)}


def _drafts(llm) -> tuple[float, float]:
    """vLLM's counts of drafts and draft tokens verified (0 without speculation)."""
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (values.get("vllm:spec_decode_num_drafts", 0),
            values.get("vllm:spec_decode_num_draft_tokens", 0))


def _drafter(llm):
    worker = llm.llm_engine.model_executor.driver_worker.worker
    return getattr(worker.model_runner, "drafter", None)


def run_engine(model: str, k: int | None, args, rng) -> list[dict]:
    from vllm import LLM

    speculative = None if k is None else {"method": "lookahead", "num_speculative_tokens": k,
                                          "trees": "off"}
    started = time.perf_counter()
    llm = LLM(model, speculative_config=speculative, dtype=args.dtype,
              load_format=args.load_format, enforce_eager=args.enforce_eager, max_model_len=PROMPT_TOKENS + args.steps + 128,
              max_num_seqs=max(args.batches), seed=0, disable_log_stats=False,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    startup = time.perf_counter() - started
    graph_modes.install(llm)
    rows = []
    try:
        for tokens in ([1] if k is None else [t for t in args.tokens if t <= k + 1]):
            for batch in args.batches:
                row = {"engine_k": k, "startup_seconds": startup,
                       **measure(llm, batch, tokens, args.steps, rng)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder")
    parser.add_argument("--load-format", default="auto", help='vLLM load_format ("dummy")')
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ks", type=positive_ints, default="3,15,63",
                        help="engines' K (num_speculative_tokens)")
    parser.add_argument("--tokens", type=positive_ints, default="1,2,4,8,16,32,64",
                        help="tokens per request and step (at most K + 1 of the engine)")
    parser.add_argument("--batches", type=positive_ints, default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=8 << 30)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs, no torch.compile (CPU tests)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the engine without speculation")
    add_arguments(parser, "<machine>-<model>-step-cost")
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the drafter lives in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    rng = np.random.default_rng(0)
    rows = [] if args.no_baseline else run_engine(args.model, None, args, rng)
    for k in args.ks:
        rows += run_engine(args.model, k, args, rng)
    write(rows, args, command_line("benchmarks.step_cost", argv))


def write(rows: list[dict], args, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = args.name or f"{machine.default_name()}-{os.path.basename(args.model)}-step-cost"
    folder = make_run_folder(args.output_dir, name, command)
    results = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "model": args.model, "load_format": args.load_format, "dtype": args.dtype,
               "machine": machine.describe(), "software": machine.software_versions(),
               "repository": machine.git_state(), "rows": rows}
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (folder / "results.md").write_text(markdown(rows, args))
    figure, axes = plt.subplots(1, len(args.batches), figsize=(4 * len(args.batches), 3.6),
                                squeeze=False)
    for axis, batch in zip(axes[0], args.batches):
        for k in sorted({r["engine_k"] for r in rows if r["engine_k"]}):
            points = [(r["tokens_per_request"], r["ms_per_step"]) for r in rows
                      if r["engine_k"] == k and r["batch"] == batch]
            axis.plot(*zip(*points), "-o", label=f"K {k} (T = {k + 1}: FULL)")
        plain = [r["ms_per_step"] for r in rows if r["engine_k"] is None and r["batch"] == batch]
        if plain:
            axis.axhline(plain[0], color="grey", linestyle=":", label="no speculation")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per request and step (T)")
        axis.set_ylabel("ms per step")
        axis.set_title(f"batch {batch}")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(folder / "step-cost.png")
    print((folder / "results.md").read_text())
    print(f"results: {folder}/")


def markdown(rows: list[dict], args) -> str:
    lines = [f"# Step cost by tokens per request and batch: {os.path.basename(args.model)} "
             f"({args.dtype}, load_format {args.load_format})", "",
             "| engine | batch | tokens per request | ms per step | steps FULL / PIECEWISE / "
             "eager |", "|---|---|---|---|---|"]
    for r in rows:
        modes = r["steps_by_graph_mode"]
        engine = "no speculation" if r["engine_k"] is None else f"K {r['engine_k']}"
        lines.append(f"| {engine} | {r['batch']} | {r['tokens_per_request']} | "
                     f"{r['ms_per_step']:.2f} | {modes['FULL']} / {modes['PIECEWISE']} / "
                     f"{modes['NONE']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
