"""The run folder of ``benchmarks.tree_breakdown``: the pieces it times, the tables
(linear against tree, piece by piece) and the stacked bars."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import numpy as np

from benchmarks import machine
from benchmarks.run_folder import make_run_folder

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
    "tree growing (proposer)": "lookahead.trees.grow_trees, as the planner calls it "
                               "(lookahead.planning's name)",
}
MODEL_PIECES = ("model, without attention", "attention kernel", "logits")
TREE_PIECES = ("tree planning", "root block copies", "metadata split", "scratch path writes",
               "tree verification", "KV move", "tree growing (proposer)")



def write(rows: list[dict], args: argparse.Namespace, timer_us: float) -> None:
    """The run folder: results.json, results.md (a table a part and draft size), the plot."""
    folder = make_run_folder(
        args.output_dir,
        args.name or f"{machine.default_name()}-{args.model}-tree-step-breakdown",
        args.command)
    results = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "model": args.model, "dtype": args.dtype, "machine": machine.describe(),
               "software": machine.software_versions(), "repository": machine.git_state(),
               "pieces": PIECES, "tree_pieces": TREE_PIECES, "timer_us_per_call": timer_us,
               "rows": rows}
    (folder / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Tree step vs linear step, piece by piece: {args.model} ({args.dtype}), "
             "batch 1, ms per decode step", ""]
    by = {(r["part"], r["shape"], r.get("draft_tokens")): r for r in rows}
    for (part, shape, size), r in by.items():
        if shape == "linear-bare":
            timed = by["fixed", "linear", size]
            lines.append(f"- T {size}: linear step without timers {r['engine_ms_per_step']:.2f} "
                         f"ms, with {timed['engine_ms_per_step']:.2f} ms (runs "
                         f"{np.round(r['engine_ms_per_step_runs'], 1).tolist()} / "
                         f"{np.round(timed['engine_ms_per_step_runs'], 1).tolist()})")
        elif shape == "tree":
            calls = sum(r["calls_per_step"].values()) + 1
            lines.append(f"- {part} tree{f', T {size}' if size else ''}: {calls:.0f} timed "
                         f"calls a step, at "
                         f"{results['timer_us_per_call']:.2f} us each: "
                         f"{calls * results['timer_us_per_call'] / 1e3:.3f} ms a step")
    lines += ["- outputs equal: " + ", ".join(
        f"{p}{f' T {t}' if t else ''} {s} "
        f"{r.get('outputs_equal_linear_bare', r.get('outputs_equal_linear'))}"
        for (p, s, t), r in by.items() if s != "linear" or p == "fixed"), ""]
    names = [*PIECES, "rest", "step"]
    for (part, shape, size), tree in by.items():
        if shape != "tree":
            continue
        linear = by[part, "linear", size]
        lines += [f"## {part}" + (f", drafts of {size} tokens" if size else
                                  f" (the real proposer, {tree['prompts']} HumanEval prompts)"),
                  "", f"tokens a step: linear {linear['tokens_per_step']:.1f}, tree "
                  f"{tree['tokens_per_step']:.1f}; decode steps {linear['steps']} / "
                  f"{tree['steps']}" + (f"; tokens a decode step {linear['tokens_per_decode_step']:.2f}"
                                       f" / {tree['tokens_per_decode_step']:.2f}" if not size
                                       else ""), "",
                  "| piece | linear | tree | tree - linear | by repeat (min, max) | tree calls |",
                  "|---|---|---|---|---|---|"]
        for name in names:
            repeats = [value(t, name) - value(a, name)
                       for a, t in zip(linear.get("runs", []), tree.get("runs", []))]
            cells = [name, *(f"{x:.2f}" for x in (value(linear, name), value(tree, name))),
                     f"{value(tree, name) - value(linear, name):+.2f}",
                     f"{min(repeats):+.2f}, {max(repeats):+.2f}" if repeats else "",
                     f"{tree['calls_per_step'].get(name, 0):.0f}" if name in PIECES else ""]
            if name == "step":
                cells = [f"**{cell}**" if cell else "" for cell in cells]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    (folder / "results.md").write_text("\n".join(lines) + "\n")
    plot([r for r in rows if "pieces" in r], names[:-1],
         f"{args.model} ({args.dtype}): where a step's time goes", folder / "breakdown.png")
    print((folder / "results.md").read_text())
    print(f"results: {folder}/")


def value(row: dict, name: str) -> float:
    return row["ms_per_step"] if name == "step" else row["rest"] if name == "rest" \
        else row["pieces"][name]


def plot(columns: list[dict], names: list[str], title: str, path) -> None:
    """Stacked bars, one a shape: the pieces (tree pieces hatched) and the rest; on the
    right without the model's own compute (its layers, attention kernel, logits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{'T ' + str(r['draft_tokens']) if r['part'] == 'fixed' else 'served'}\n"
              f"{r['shape']}" for r in columns]
    figure, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(columns)), 5))
    colors = plt.get_cmap("tab20")
    for side, axis in enumerate(axes):
        shown = [n for n in names if not side or n not in MODEL_PIECES]
        bottoms = np.zeros(len(columns))
        for index, name in enumerate(names):
            values = np.array([value(r, name) for r in columns])
            if name in shown and values.max() >= 0.01:
                axis.bar(labels, values, bottom=bottoms, color=colors(index % 20),
                         label=name if (name in MODEL_PIECES) != bool(side) else None,
                         hatch="//" if name in TREE_PIECES else None)
                bottoms += values
        axis.set(ylabel="ms per decode step")
    axes[0].set_title(title, fontsize=9)
    axes[1].set_title("without the model's layers, attention kernel and logits", fontsize=9)
    axes[0].legend(fontsize=7, loc="lower left")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    figure.tight_layout()
    figure.savefig(path)
