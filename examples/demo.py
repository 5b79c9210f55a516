"""Demo: greedy generation with and without lookahead on a real model, side by side.

Fetches SmolLM2-135M-Instruct (pinned, checksummed, cached; see benchmarks/models.py),
runs a few chat prompts from the vendored prompt sets one at a time, and prints
tokens/s, the speedup, the compression ratio S (generated tokens per target forward
pass, counted by the step loop) and whether the outputs are identical. vLLM's log and
the engine processes' other output go to a log file (its path is printed first) unless
``--verbose`` is given.

    python -m examples.demo [--model smollm2-135m] [--max-tokens 192] [--prompts 6] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.cpu_env import configure_cpu_env
from benchmarks.latency import LatencyResult, run_one_by_one
from benchmarks.models import fetch
from benchmarks.offline import proposer_delta, proposer_stats

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data"
ENGINE_KWARGS = dict(enforce_eager=True, max_model_len=4096, kv_cache_memory_bytes=1 << 30,
                     seed=0)


def demo_questions(count: int) -> list[str]:
    """Alternate Spec-Bench categories: summarization, math, QA, translation, RAG, writing."""
    rows = [json.loads(line) for line in (DATA / "spec_bench_question.jsonl").open()]
    by_category: dict[str, list[str]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    order = ["summarization", "math_reasoning", "qa", "translation", "rag", "writing"]
    return [by_category[order[i % len(order)]][i // len(order)] for i in range(count)]


def run(model_path: str, prompts: list[list[int]], speculative_config, max_tokens: int,
        dtype: str):
    """Latency result and, for lookahead, the proposer's steps and seconds in the worker."""
    from vllm import LLM, SamplingParams

    llm = LLM(model_path, speculative_config=speculative_config, dtype=dtype,
              **ENGINE_KWARGS)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    run_one_by_one(llm, prompts[:1], params)  # warm-up, not timed
    before = proposer_stats(llm)
    result = run_one_by_one(llm, prompts, params)
    proposer = proposer_delta(before, proposer_stats(llm))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result, proposer


@contextlib.contextmanager
def output_to_log_file():
    """File descriptors 1 and 2 into a log file while vLLM runs: its log lines (stdout),
    progress bars and warnings, from this process and from the engine processes, which
    inherit the descriptors."""
    log, path = tempfile.mkstemp(prefix="vllm-lookahead-demo-", suffix=".log")
    print(f"vLLM log: {path}", flush=True)
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    done = False
    try:
        yield
        done = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in enumerate(saved, start=1):
            os.dup2(original, fd)
            os.close(original)
        if not done:
            print(f"demo failed; vLLM's log: {path}", file=sys.stderr, flush=True)


def report(label: str, result: LatencyResult, baseline: LatencyResult) -> str:
    return (f"{label:<12} {result.tokens_per_second:8.1f} tok/s   speedup "
            f"{result.tokens_per_second / baseline.tokens_per_second:4.2f}x   "
            f"S = {result.compression:4.2f} tokens/forward pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="K, the cap of the draft length (default: the plugin's)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): exact on CPU, so 'identical outputs' is a "
                             "real check; bfloat16 is faster but two correct runs may differ")
    parser.add_argument("--verbose", action="store_true",
                        help="show vLLM's log and progress bars here instead of in a log file")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # lets LLM.collective_rpc ship a function to the local worker (proposer timing)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    configure_cpu_env()

    model_path = str(fetch(args.model))  # a first download reports its progress here
    with contextlib.nullcontext() if args.verbose else output_to_log_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                 add_generation_prompt=True, tokenize=True)
                   for q in demo_questions(args.prompts)]
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]

        plain, _ = run(model_path, prompts, None, args.max_tokens, args.dtype)
        spec = {"method": "lookahead"}
        if args.num_speculative_tokens is not None:
            spec["num_speculative_tokens"] = args.num_speculative_tokens
        lookahead, proposer = run(model_path, prompts, spec, args.max_tokens, args.dtype)
    identical = sum(a == b for a, b in zip(plain.outputs, lookahead.outputs))
    print(f"\n{args.model} ({args.dtype}), {len(prompts)} Spec-Bench prompts, greedy, "
          f"batch 1, {plain.generated_tokens} tokens generated per method")
    print(report("no spec", plain, plain))
    print(report("lookahead", lookahead, plain))
    print(f"identical outputs: {identical}/{len(prompts)}")
    step_ms = 1000 * lookahead.seconds / lookahead.forward_passes
    seconds = proposer["seconds"]
    print(f"proposer: {1000 * seconds / proposer['steps']:.3f} ms per step "
          f"({100 * seconds / lookahead.seconds:.2f}% of generation time; "
          f"a step takes {step_ms:.1f} ms)")


if __name__ == "__main__":
    main()
