"""Replay recorded greedy generations through draft proposers, without the model.

Under greedy verification a step accepts the longest draft prefix that equals the
target's own continuation, plus one token. Given a request's prompt and its plain
greedy output, the compression S of any proposer is therefore determined exactly,
with no forward pass, except for what a proposer learns from the target's
predictions at rejected positions (lookahead's Jacobi harvest is absent here, so
replayed lookahead S is a lower bound). This makes proposer variants cheap to
compare; end-to-end speed still comes from benchmarks.run.

Sampled traces (``record --temperature``) replay the same way, in expectation: a draft
token without probabilities (every method here) is accepted with the target's
probability of it, the chance that the sampled text holds it at that place, and the
text after a rejection follows the target's distribution either way. So a replayed S
over a sampled trace estimates the sampled S (one sample, without noise from timing),
but not its spread over samples.

With ``--step-cost FIXED_MS,TOKEN_MS[,DRAFT_MS]`` every decode pass takes a simulated
FIXED + TOKEN x (its requests) + DRAFT x (its draft tokens) milliseconds (DRAFT = TOKEN
if not given): lookahead's cost-aware cut times the
passes on that clock (deterministically, unlike a real machine), and the table adds
the simulated decode tokens/s (and the speedup over ``none``, no drafts, where it is
among the methods). Several ``--step-cost`` give one table each.

``--batch-size N[,N...]`` replays N requests at a time, as a server at concurrency N
(default 1): each pass verifies every running request's draft and costs the clock the
batch's tokens, so the cut weighs a draft token against the whole batch's step, as it
does under load. One table per batch size.

``--oracle-cut`` adds a column per method whose drafts are cut to exactly the tokens
verification will accept (known here, never in an engine): the same S with no draft
token wasted, the ceiling of what any acceptance estimate and cut can make of that
method's drafts.

The method ``copy-oracle`` (replay only) is the ceiling of drafts copied after the
longest match of the context's suffix: each step it finds the longest suffix of the
context (up to 16 tokens, the last token at least) that the request's prompt and output
so far, or the outputs of the requests finished before it, repeat, reads the output
ahead and, of that suffix's occurrences, copies the continuation that verification
will accept furthest (with ``"min_match": N``, only after a match of at least N
tokens). A drafter that copies one continuation of the longest match (ngram, suffix,
lookahead's context and corpus matches) chooses among the same occurrences without
knowing the output; drafts chained from several spans, such as lookahead's pool and its
Jacobi predictions, are outside it.

    python -m benchmarks.replay record --model smollm2-135m --num-prompts 20 -o trace.json
    python -m benchmarks.replay run trace.json --methods ngram,suffix,lookahead \
        --method-config lookahead-n5='{"method": "lookahead", "ngram_size": 5}'
    python -m benchmarks.replay run trace.json --step-cost 30,1.1 --step-cost 30,7.5
    python -m benchmarks.replay run trace.json --methods none,suffix,lookahead \
        --step-cost 60,3.2 --batch-size 1,32 --oracle-cut

`run` prints the table; with ``--name`` it also writes it, with the command and commit, to
the run folder benchmarks/results/<date>-<name>/ (results.md, command.txt).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.methods import DEFAULT_METHODS, with_overrides
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import REPLAY_ONLY_METHODS, REPLAYERS
from benchmarks.run import positive_ints
from benchmarks.run_folder import add_arguments, command_line, make_run_folder


def record(model: str, datasets: list[str], num_prompts: int, max_tokens: int,
           categories: list[str] | None = None, temperature: float = 0.0,
           top_p: float = 1.0) -> list[dict]:
    """Plain generations of the benchmark prompts (all turns), in request order, greedy
    or sampled (from the engine's seed, 0: no per-request seed, which vLLM's CPU runner
    does not take with chunked prompts); with ``categories``, only the samples of those
    categories."""
    from vllm import LLM, SamplingParams

    from benchmarks import datasets as prompt_sets
    from benchmarks.models import fetch

    path = str(fetch(model))
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=2 << 30, seed=0)
    prompter = prompt_sets.ChatPrompter(path)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    trace = []
    for dataset in datasets:
        samples = prompt_sets.load(dataset, num_prompts)
        if categories:
            samples = [s for s in samples if s.category in categories]
        answers: list[list[list[int]]] = [[] for _ in samples]
        while True:  # one turn of every conversation per batch
            pending = [(i, prompter.prompt(s, answers[i])) for i, s in enumerate(samples)]
            pending = [(i, p) for i, p in pending if p is not None]
            if not pending:
                break
            outputs = llm.generate([{"prompt_token_ids": p} for _, p in pending], params,
                                   use_tqdm=False)
            for (i, prompt), output in zip(pending, outputs):
                tokens = list(output.outputs[0].token_ids)
                answers[i].append(tokens)
                trace.append({"dataset": dataset, "category": samples[i].category,
                              "prompt": prompt, "output": tokens})
    llm.llm_engine.engine_core.shutdown()
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="smollm2-135m")
    rec.add_argument("--datasets", default="humaneval,mt_bench,spec_bench")
    rec.add_argument("--num-prompts", type=int, default=20)
    rec.add_argument("--max-tokens", type=int, default=256)
    rec.add_argument("--categories", default="",
                     help="comma list: record only the samples of these categories")
    rec.add_argument("--temperature", type=float, default=0.0,
                     help="sampled traces (0: greedy); see the module's docstring")
    rec.add_argument("--top-p", type=float, default=1.0)
    rec.add_argument("-o", "--output", required=True)
    run = sub.add_parser("run")
    run.add_argument("trace")
    run.add_argument("--methods", default="ngram,suffix,lookahead")
    run.add_argument("--method-config", action="append", default=[],
                     help="NAME=JSON: a variant (with 'method') or overrides of NAME")
    run.add_argument("--step-cost", action="append", type=StepCost.parse, default=[],
                     metavar="FIXED_MS,TOKEN_MS[,DRAFT_MS]",
                     help="simulated decode pass time: fixed, a request's token, a draft "
                          "token's (TOKEN_MS if not given; repeatable: one table each)")
    run.add_argument("--batch-size", type=positive_ints, default=[1], metavar="N[,N...]",
                     help="requests replayed at a time (one table each; default 1)")
    run.add_argument("--oracle-cut", action="store_true",
                     help="also each method with its drafts cut to what will be accepted")
    add_arguments(run, None)
    args = parser.parse_args()

    if args.command == "record":
        trace = record(args.model, args.datasets.split(","), args.num_prompts, args.max_tokens,
                       [c for c in args.categories.split(",") if c], args.temperature,
                       args.top_p)
        Path(args.output).write_text(json.dumps(trace))
        return
    trace = [Request(**row) for row in json.loads(Path(args.trace).read_text())]
    methods = with_overrides({**DEFAULT_METHODS, **REPLAY_ONLY_METHODS}, args.method_config)
    names = args.methods.split(",") + [c.partition("=")[0] for c in args.method_config]
    specs = {name: methods[name].config for name in dict.fromkeys(names)}
    table = []
    for step_cost in args.step_cost or [None]:
        for batch_size in args.batch_size:
            table += replay_table(trace, specs, step_cost, batch_size, args.oracle_cut)
    print("\n".join(table))
    if args.name:
        from benchmarks.machine import git_state

        git = git_state()
        dirty = " (with uncommitted changes)" if git["dirty"] else ""
        command = command_line("benchmarks.replay")
        folder = make_run_folder(args.output_dir, args.name, command)
        header = [f"# Replay of {args.trace}", "",
                  f"* Command: `{command}`",
                  f"* Repository: commit {git['commit']}{dirty}",
                  "* Methods: " + "; ".join(f"**{n}** `{json.dumps(c)}`" for n, c in specs.items()),
                  "", __doc__.split("\n\n")[1].replace("\n", " "), ""]
        (folder / "results.md").write_text("\n".join(header + table))
        print(f"results: {folder}/")


def replay_table(trace: list[Request], specs: dict[str, dict | None],
                 step_cost: StepCost | None, batch_size: int, oracle_cut: bool) -> list[str]:
    """The Markdown table of every method (and its oracle cut) at one step cost and
    batch size: per row of ``summarize``, S (draft tokens per pass), and where passes
    are timed the decode tokens/s and its ratio to ``none``'s."""
    rows = {}
    for name, spec in specs.items():
        replayer = REPLAYERS[spec["method"] if spec else "none"]
        for cut in (False, True) if oracle_cut and spec else (False,):
            rows[name + " (oracle cut)" * cut] = summarize(trace, replay(
                lambda: replayer(spec, batch_size), trace, step_cost, cut))
    title = "S (draft tokens per pass)" + (
        f" decode tokens/s at {step_cost.label}" if step_cost else "") + (
        f", batch {batch_size}" if batch_size > 1 else "")
    table = [f"| {title} | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    baseline = rows.get("none")
    for key in next(iter(rows.values())):
        base_rate = baseline[key][2] if baseline else None
        cells = []
        for summary in rows.values():
            compression, drafted, rate = summary[key]
            cell = f"{compression:.3f} ({drafted:.1f})"
            if rate is not None:
                cell += f" {rate:.1f}/s"
                if base_rate:
                    cell += f" {rate / base_rate:.2f}x"
            cells.append(cell)
        table.append(f"| {key} | " + " | ".join(cells) + " |")
    return table + [""]

