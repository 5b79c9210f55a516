"""Where a tree step's time goes, piece by piece, next to a linear step of the same
token count (issue 93).

One engine, in this process, at batch size 1, with trees on in every step (issue 93's
``trees: "on"``, 4 candidates, window 4, no cost-aware cut). Two parts:

- ``fixed``: ``tree_cost.measure``'s fixed random drafts of T tokens, verified as a chain
  (``linear``) or as four chains from the root (``tree``), the same token count; and
  ``linear`` once more without the timers (``linear-bare``: what the timers cost).
- ``served``: the real proposer on a HumanEval prompt, its trees switched off
  (``linear``) and on (``tree``); steps differ in token count, and the proposer's own
  tree growing shows.

Each piece is timed by wrapping, at run time in this process only, the function or
method the step runs (``time.perf_counter`` on entry and exit; a piece's time excludes
the pieces timed inside it, so the pieces and ``rest`` add up to the engine step):

    python -m benchmarks.tree_breakdown --model smollm2-135m --dtype float32

Writes ``benchmarks/results/<date>-<name>/`` (``--name``, default
``<machine>-<model>-tree-step-breakdown``): results.json, results.md, breakdown.png,
command.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from benchmarks import machine
from benchmarks.models import MODELS, fetch
from benchmarks.run_folder import add_arguments, command_line, make_run_folder
from benchmarks.tree_cost import measure

#: The pieces, in the order of a step, and what each times (exclusive of those inside).
PIECES = {
    "scheduler": "engine core's Scheduler.schedule and update_from_output",
    "prepare inputs (vLLM)": "runner._prepare_inputs, without the tree planning",
    "tree planning": "tree_step._trees_of_step: draft_tree, positions, branches, step tensors",
    "root block copies": "tree_attention.copy_root_blocks",
    "metadata build (vLLM)": "each metadata builder's build, without the split",
    "metadata split": "tree_attention.split_metadata: the branch sequences",
    "model, without attention": "runner.model.forward, without the attention forwards",
    "attention kernel": "the attention implementation's forward (every layer), without "
                        "the scratch writes",
    "scratch path writes": "tree_attention.prepare_layer (every layer)",
    "logits": "runner.model.compute_logits",
    "sampling (vLLM)": "runner.rejection_sampler.forward, without what follows",
    "verification (vLLM)": "rejection_sampler.rejection_sample, without what follows",
    "tree verification": "sampler._verify_trees",
    "KV move": "sampler.move_accepted_paths (the accepted path's keys and values)",
    "drafter captures": "sampler.capture_verification, top_k_logprobs, the drafter's "
                        "on_verification and on_last_top_k",
    "drafting": "runner.propose_draft_token_ids (and the drafter's propose)",
    "tree growing (proposer)": "lookahead.trees.grow_trees",
}
TREE_PIECES = ("tree planning", "root block copies", "metadata split", "scratch path writes",
               "tree verification", "KV move", "tree growing (proposer)")


class StepTimers:
    """Wraps the pieces' functions; records each engine step's pieces (ms, calls)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[float]] = []
        self.steps: list[dict] = []
        self.patches: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, owner: Any, attr: str, piece: str,
             observe: Callable[..., None] | None = None) -> None:
        own = attr in vars(owner)
        original = getattr(owner, attr)
        stack, current, calls = self.stack, self.current, self.calls

        def timed(*args, **kwargs):
            if observe is not None:
                observe(*args, **kwargs)
            frame = [0.0]  # time of the pieces inside
            stack.append(frame)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                stack.pop()
                current[piece] += elapsed - frame[0]
                calls[piece] += 1
                if stack:
                    stack[-1][0] += elapsed

        self.patches.append((owner, attr, own, vars(owner).get(attr)))
        setattr(owner, attr, timed)

    def install(self, llm: Any, runner: Any, drafter: Any) -> None:
        from vllm.v1.sample import rejection_sampler

        from vllm_lookahead.lookahead import trees
        from vllm_lookahead.worker import sampler, tree_attention, tree_step
        from vllm_lookahead.worker.tree_step import attention_layers

        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        for attr in ("schedule", "update_from_output"):
            self.wrap(scheduler, attr, "scheduler")

        def count_tokens(scheduler_output, *args, **kwargs):
            self.current["tokens"] += scheduler_output.total_num_scheduled_tokens

        self.wrap(runner, "_prepare_inputs", "prepare inputs (vLLM)", count_tokens)
        self.wrap(tree_step, "_trees_of_step", "tree planning")
        self.wrap(tree_attention, "copy_root_blocks", "root block copies")
        for group in runner.attn_groups[0]:
            for builder in group.metadata_builders:
                self.wrap(builder, "build", "metadata build (vLLM)")
        self.wrap(tree_attention, "split_metadata", "metadata split")
        self.wrap(runner.model, "forward", "model, without attention")
        for cls in {type(layer.impl) for layer in attention_layers(runner)}:
            self.wrap(cls, "forward", "attention kernel")
        self.wrap(tree_attention, "prepare_layer", "scratch path writes")
        self.wrap(runner.model, "compute_logits", "logits")
        self.wrap(runner.rejection_sampler, "forward", "sampling (vLLM)")
        self.wrap(rejection_sampler, "rejection_sample", "verification (vLLM)")
        self.wrap(sampler, "_verify_trees", "tree verification")
        self.wrap(sampler, "move_accepted_paths", "KV move")
        for owner, attr in ((sampler, "capture_verification"), (sampler, "top_k_logprobs"),
                            (drafter, "on_verification"), (drafter, "on_last_top_k")):
            self.wrap(owner, attr, "drafter captures")
        self.wrap(runner, "propose_draft_token_ids", "drafting")
        self.wrap(trees, "grow_trees", "tree growing (proposer)")
        original = engine.step

        def recorded_step():  # the whole step, then its pieces
            self.current.clear()
            self.calls.clear()
            start = time.perf_counter()
            outputs = original()
            self.steps.append({"ms": 1e3 * (time.perf_counter() - start),
                               "tokens": self.current.pop("tokens", 0),
                               "pieces": {k: 1e3 * v for k, v in self.current.items()},
                               "calls": dict(self.calls)})
            return outputs

        self.patches.append((engine, "step", "step" in vars(engine), vars(engine).get("step")))
        engine.step = recorded_step

    def uninstall(self) -> None:
        for owner, attr, own, value in reversed(self.patches):
            if own:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)
        self.patches.clear()


def summarize(steps: list[dict]) -> dict:
    """Mean ms a step of each piece, the rest, the total; calls a step; tokens a step."""
    pieces = {name: float(np.mean([s["pieces"].get(name, 0.0) for s in steps]))
              for name in PIECES}
    total = float(np.mean([s["ms"] for s in steps]))
    return {"steps": len(steps), "ms_per_step": total,
            "tokens_per_step": float(np.mean([s["tokens"] for s in steps])),
            "pieces": pieces, "rest": total - sum(pieces.values()),
            "calls_per_step": {name: float(np.mean([s["calls"].get(name, 0) for s in steps]))
                               for name in PIECES}}


def recording_generate(llm: Any, outputs: list) -> Callable[[], None]:
    """Keep every generated token sequence (instance attribute); returns the undo."""
    original = llm.generate

    def generate(*args, **kwargs):
        results = original(*args, **kwargs)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
        return results

    llm.generate = generate
    return lambda: delattr(llm, "generate")


def fixed_drafts(llm, runner, drafter, timers, prompt, sizes, repeats, new_tokens) -> list:
    rows = []
    for size in sizes:
        runs: dict[str, list] = defaultdict(list)
        outputs: dict[str, list] = defaultdict(list)
        for _ in range(repeats):
            for variant in ("linear-bare", "linear", "tree"):
                kept: list = []
                undo = recording_generate(llm, kept)
                if variant != "linear-bare":
                    timers.install(llm, runner, drafter)
                measured = measure(llm, drafter, prompt, size, variant.split("-")[0],
                                   new_tokens)
                timers.uninstall()
                undo()
                outputs[variant].append(kept[-1])
                steps = timers.steps[-measured["decode_steps"]:] if variant != "linear-bare" \
                    else []
                runs[variant].append((measured["ms_per_step"], steps))
        reference = outputs["linear-bare"][0]
        for variant, measured in runs.items():
            row = summarize([s for _, steps in measured for s in steps]) \
                if variant != "linear-bare" else {}
            rows.append({**row, "part": "fixed", "shape": variant, "draft_tokens": size,
                         "prompt_tokens": len(prompt),
                         "engine_ms_per_step_runs": [ms for ms, _ in measured],
                         "engine_ms_per_step": float(np.mean([ms for ms, _ in measured])),
                         "outputs_equal_linear_bare": all(o == reference
                                                          for o in outputs[variant])})
            print({k: v for k, v in rows[-1].items() if k != "calls_per_step"}, flush=True)
    return rows


def served(llm, runner, drafter, timers, prompt, new_tokens) -> list:
    """The real proposer, trees off then on (toggled in this process: ``_trees.on`` and
    the recycled top-k, as ``TreeSwitch.turn_off`` leaves them), each on a fresh corpus
    (finished outputs join it), after a warm-up run."""
    from vllm import SamplingParams

    from vllm_lookahead.lookahead.sources.corpus import ResponseCorpus

    for attr in ("propose", "draft_tree"):  # measure's fixed drafts: the proposer's own again
        vars(drafter).pop(attr, None)
    recycled = drafter._sources.recycled
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    rows = []
    for shape in ("linear", "tree"):
        drafter._trees.on = shape == "tree"
        drafter._sources.recycled = recycled if shape == "tree" else None
        for timed in (False, True):
            drafter._sources.corpus = ResponseCorpus(drafter.options.corpus_tokens)
            if timed:
                timers.install(llm, runner, drafter)
            done = len(timers.steps)
            result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            timers.uninstall()
        tokens = list(result[0].outputs[0].token_ids)
        steps = timers.steps[done + 1:]  # the first step is the prefill
        rows.append({**summarize(steps), "part": "served", "shape": shape,
                     "prompt_tokens": len(prompt), "new_tokens": len(tokens),
                     "tokens_per_decode_step": (len(tokens) - 1) / len(steps),
                     "output": tokens})
        print({k: v for k, v in rows[-1].items() if k not in ("calls_per_step", "output")},
              flush=True)
    rows[-1]["output_equal_linear"] = rows[-1]["output"] == rows[0]["output"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", default="16,8")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--served-tokens", type=int, default=96,
                        help="tokens generated in each served run (0: no served part)")
    add_arguments(parser, "<machine>-<model>-tree-step-breakdown")
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.tree_breakdown", argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner lives in this process
    from vllm import LLM

    from benchmarks.datasets import ChatPrompter, load

    path = str(fetch(args.model))
    llm = LLM(path, speculative_config={"method": "lookahead", "trees": "on",
                                        "tree_candidates": 4, "tree_window": 4,
                                        "cost_aware_drafts": False},
              enforce_eager=True, dtype=args.dtype, max_model_len=4096,
              kv_cache_memory_bytes=1 << 30, seed=0)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafter, timers = runner.drafter, StepTimers()
    prompt = np.random.default_rng(1).integers(3, 30000, args.prompt_tokens).tolist()
    rows = fixed_drafts(llm, runner, drafter, timers, prompt,
                        [int(size) for size in args.draft_tokens.split(",")],
                        args.repeats, args.new_tokens)
    if args.served_tokens:
        rows += served(llm, runner, drafter, timers,
                       ChatPrompter(path).prompt(load("humaneval", 1)[0], []),
                       args.served_tokens)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    folder = make_run_folder(
        args.output_dir,
        args.name or f"{machine.default_name()}-{args.model}-tree-step-breakdown",
        args.command)
    results = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "model": args.model, "dtype": args.dtype, "machine": machine.describe(),
               "software": machine.software_versions(), "repository": machine.git_state(),
               "pieces": PIECES, "tree_pieces": TREE_PIECES, "rows": rows}
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    columns = [r for r in rows if "pieces" in r]
    names = [*PIECES, "rest"]
    lines = [f"# Tree step vs linear step, piece by piece: {args.model} ({args.dtype}), "
             "batch 1, ms per decode step", ""]
    for r in rows:
        if r["shape"] == "linear-bare":
            timed = next(c for c in columns if c["part"] == "fixed" and c["shape"] == "linear"
                         and c["draft_tokens"] == r["draft_tokens"])
            lines.append(f"- T {r['draft_tokens']}: linear step without timers "
                         f"{r['engine_ms_per_step']:.2f} ms, with "
                         f"{timed['engine_ms_per_step']:.2f} ms (runs "
                         f"{[round(x, 2) for x in r['engine_ms_per_step_runs']]} / "
                         f"{[round(x, 2) for x in timed['engine_ms_per_step_runs']]})")
    lines.append("- outputs equal to the bare linear run's (fixed drafts): "
                 + ", ".join(f"T {r['draft_tokens']} {r['shape']} {r['outputs_equal_linear_bare']}"
                             for r in rows if r["part"] == "fixed"))
    lines += [""]
    groups = sorted({(r["part"], r.get("draft_tokens", 0)) for r in columns},
                    key=lambda g: (g[0], -g[1]))
    for part, size in groups:
        pair = {r["shape"]: r for r in columns
                if r["part"] == part and r.get("draft_tokens", 0) == size}
        linear, tree = pair["linear"], pair["tree"]
        title = f"fixed drafts of {size} tokens" if part == "fixed" else \
            "served (the real proposer, HumanEval/0)"
        lines += [f"## {title}", "",
                  f"tokens a step: linear {linear['tokens_per_step']:.1f}, tree "
                  f"{tree['tokens_per_step']:.1f}; decode steps {linear['steps']} / "
                  f"{tree['steps']}" + (f"; tokens a decode step {linear['tokens_per_decode_step']:.2f}"
                                       f" / {tree['tokens_per_decode_step']:.2f}"
                                       if part == "served" else ""), "",
                  "| piece | linear | tree | tree - linear | tree calls a step |",
                  "|---|---|---|---|---|"]
        for name in names:
            a = linear["rest"] if name == "rest" else linear["pieces"][name]
            b = tree["rest"] if name == "rest" else tree["pieces"][name]
            calls = "" if name == "rest" else f"{tree['calls_per_step'][name]:.0f}"
            lines.append(f"| {name} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {calls} |")
        lines += [f"| **step** | **{linear['ms_per_step']:.2f}** | **{tree['ms_per_step']:.2f}** "
                  f"| **{tree['ms_per_step'] - linear['ms_per_step']:+.2f}** | |", ""]
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    plot(columns, names, f"{args.model} ({args.dtype}): where a step's time goes",
         folder / "breakdown.png")
    print((folder / "results.md").read_text())
    print(f"results: {folder}/")


def plot(columns: list[dict], names: list[str], title: str, path) -> None:
    """Stacked bars, one a shape: the pieces (tree pieces hatched) and the rest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{'T ' + str(r['draft_tokens']) if r['part'] == 'fixed' else 'served'}\n"
              f"{r['shape']}" for r in columns]
    figure, axis = plt.subplots(figsize=(max(6, 1.3 * len(columns)), 5))
    bottoms, colors = np.zeros(len(columns)), plt.get_cmap("tab20")
    for index, name in enumerate(names):
        values = np.array([r["rest"] if name == "rest" else r["pieces"][name] for r in columns])
        if values.max() >= 0.05:
            axis.bar(labels, values, bottom=bottoms, label=name, color=colors(index % 20),
                     hatch="//" if name in TREE_PIECES else None)
            bottoms += values
    axis.set(ylabel="ms per decode step", title=title)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    figure.tight_layout()
    figure.savefig(path)

if __name__ == "__main__":
    main()
