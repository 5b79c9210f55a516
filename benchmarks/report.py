"""Markdown tables and PNG plots from a results JSON, recomputed from its raw numbers.

    python -m benchmarks.report benchmarks/results/<date>-<name>/results.json

Writes <stem>.md (results.md), speedup.png, compression.png (offline modes) and
concurrency.png (server mode) next to the JSON. A plot is written only where it has data:
no speedup.png without the `none` baseline and another method.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.metrics import BASELINE, summarize

MODE_TITLES = {
    "latency": "Latency (batch 1, one request at a time)",
    "throughput": "Throughput (offline, conversations submitted at once: all, or each round)",
    "server": "OpenAI server (streaming, by concurrency)",
}
PER_POSITION_SHOWN = 4


def write_report(results: dict, json_path: Path) -> list[Path]:
    rows = summarize(results["measurements"])
    markdown = json_path.with_suffix(".md")
    markdown.write_text(render_markdown(results, rows))
    return [markdown, *write_plots(results, rows, json_path.parent)]


# -- Markdown -------------------------------------------------------------------------

def render_markdown(results: dict, rows: list[dict]) -> str:
    settings, machine = results["settings"], results["machine"]
    lines = [
        f"# {results['model']['name']} on {machine['name']}, {results['created']}",
        "",
        (f"* Machine: {machine['cpu_model']}, {machine['cores_usable']} cores usable, "
         f"{machine['memory_gib']} GiB, {machine['platform']}"),
        "* Software: " + ", ".join(f"{k} {v}" for k, v in results["software"].items()),
        f"* Repository: commit {results['git']['commit'] or 'none'}"
        + (" (work tree modified)" if results["git"]["dirty"] else ""),
        f"* Command: `{results['command']}`",
        f"* {_sampling(settings)}, up to {settings['max_tokens']} new tokens per turn; "
        "conversations: "
        + ", ".join(f"{name} {count}" + (" per category" if name == "spec_bench" else "")
                    for name, count in settings["num_prompts"].items())
        + f"; engine arguments (all methods): `{json.dumps(results['engine_args'])}`"
        + "".join(f"; {name} also `{json.dumps(values)}`"
                  for name, values in results.get("method_engine_args", {}).items()),
        "* Methods: " + "; ".join(f"**{name}** `{json.dumps(config)}`"
                                  for name, config in results["methods"].items()),
        "",
    ]
    problems = [run for run in results["runs"] if run["status"] != "ok"]
    if problems:
        lines += ["Not measured:", ""]
        lines += [f"* {run['method']} ({run['mode']}): **{run['status']}**: {run['reason']}"
                  for run in problems]
        lines.append("")
    for mode in settings["modes"]:
        mode_rows = [row for row in rows if row["mode"] == mode]
        if mode_rows:
            lines += [f"## {MODE_TITLES[mode]}", "", *_table(mode, mode_rows), ""]
    lines += _start_table(results["measurements"])
    lines += _cut_table(results["measurements"])
    lines += [
        ("S = generated tokens / target forward passes, counted by the harness (server: "
         "token-carrying stream chunks). Acceptance: vLLM's counters, over steps that had a "
         "draft; per position = accepted at that draft position / drafts. Identical: greedy "
         f"output equal to `{BASELINE}`'s per turn (t2 compared only where t1 was identical); "
         "first divergence = token index of the first difference (mean/min). Accepted by "
         "source: lookahead's accepted draft tokens by the source that drafted them (tree: "
         "nodes off the main draft; server: read from /metrics, which may lag by a second). "
         "See docs/benchmarking.md."),
        "",
    ]
    return "\n".join(lines)


def _table(mode: str, rows: list[dict]) -> list[str]:
    columns = [("dataset", _dataset_label)]
    if mode == "server":
        columns.append(("conc.", lambda r: str(r["concurrency"])))
    columns += [
        ("method", lambda r: r["method"]),
        ("tok/s", lambda r: _spread(r, "tokens_per_second", 1)),
        ("speedup", lambda r: _spread(r, "speedup", 2, "x")),
        ("S", lambda r: _spread(r, "compression", 2)),
        ("mean acc. len", lambda r: _spread(r, "mean_acceptance_length", 2)),
        (f"acc. by position (first {PER_POSITION_SHOWN})", _per_position),
        ("identical", _identical),
        ("first div. mean/min", _divergence),
    ]
    if mode == "server":
        columns += [("TTFT ms", lambda r: _num(r["ttft_ms_mean"], 0)),
                    ("ITL ms", lambda r: _num(r["itl_ms"], 1)),
                    ("TPOT ms", lambda r: _num(r["tpot_ms"], 1))]
    else:
        if mode == "latency":
            columns.append(("decode tok/s", lambda r: _spread(r, "decode_tokens_per_second", 1)))
        columns += [("step ms", lambda r: _num(r["step_ms"], 2)),
                    ("steps FULL / PIECEWISE / eager", _graph_steps)]
    if any(row.get("speedup_by_round") for row in rows):
        after = [name for name, _ in columns].index("speedup") + 1
        columns.insert(after, ("speedup by round: mean ± s.e. (n)", _by_round))
    columns += [("proposer ms/step (% of step)", _proposer),
                ("kept draft tokens: estimated / matched", _kept),
                ("tree steps (nodes off main / tree step)", _trees)]
    columns.append(("accepted by source", _accepted_by_source))
    lines = ["| " + " | ".join(name for name, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in _ordered(rows)]
    return lines


def _start_table(measurements: list[dict]) -> list[str]:
    """Per method, what its first offline engine decided at start-up (KV blocks held
    back as scratch; lookahead's trees: the start-up cost and the self-check)."""
    first: dict[str, dict] = {}
    for m in measurements:
        if "start" in m:
            first.setdefault(m["method"], m)
    if not first:
        return []
    checks = {1: "passed", 0: "failed", -1: "not run"}
    lines = ["## Start-up (each method's first engine)", "",
             "| method | start-up s | KV blocks | held as scratch | free tokens measured | "
             "tree self-check |", "|---|---|---|---|---|---|"]
    for method, m in first.items():
        start = m["start"]
        free = start.get("start_free_tokens")
        measured = "-" if free is None or math.isnan(free) else _num(free, 0)
        passes = start.get("start_passes")
        if passes and passes["sizes"]:  # the one-token and the longest pass
            measured += (f" ({passes['sizes'][0]}: {passes['seconds'][0] * 1e3:.2f} ms, "
                         f"{passes['sizes'][-1]}: {passes['seconds'][-1] * 1e3:.2f} ms)")
        lines.append(
            f"| {method} | {m['startup_seconds']:.1f} | {start['kv_blocks']} | "
            f"{start['held_blocks']} | {measured} | "
            f"{checks.get(start.get('tree_check'), '-')} |")
    return [*lines, ""]


def _cut_table(measurements: list[dict]) -> list[str]:
    """Lookahead's cost-aware cut per offline measurement (its engine's whole life, the
    warm-up included): the draft tokens it kept, by bin of the acceptance it estimated
    for them, against how often the generated text matched them."""
    cut = [m for m in measurements if m.get("cut")]
    if not cut:
        return []
    lines = ["## The cost-aware cut's estimates (kept draft tokens)", "",
             "| dataset | method | kept | estimated | matched | by estimate: tokens, mean "
             "estimate -> matched rate |", "|---|---|---|---|---|---|"]
    for m in cut:
        table = m["cut"]["calibration"]
        bins = "; ".join(f"{row['estimate_from']:.1f}+: {row['tokens']}, "
                         f"{row['mean_estimate']:.2f} -> {row['matched_rate']:.2f}"
                         for row in table)
        expected = sum(row["tokens"] * row["mean_estimate"] for row in table)
        matched = sum(row["tokens"] * row["matched_rate"] for row in table)
        lines.append(f"| {m['dataset']} | {m['method']} | {sum(r['tokens'] for r in table)} "
                     f"| {expected:.0f} | {matched:.0f} | {bins} |")
    return [*lines, ""]


def _dataset_label(row: dict) -> str:
    return row["dataset"] if row["group"] == "all" else f"{row['dataset']}/{row['group']}"


def _num(value, digits: int, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def _spread(row: dict, metric: str, digits: int, suffix: str = "") -> str:
    """The mean, and over several seeds ± their standard deviation."""
    spread = (row.get("spread") or {}).get(metric)
    text = _num(row[metric], digits, suffix)
    return text if spread is None else f"{text} ± {spread:.{digits}f}"


def _sampling(settings: dict) -> str:
    seeds = settings.get("seeds") or [0]
    modes = settings.get("modes", []) if settings.get("interleave") else []
    size = settings.get("round_size")
    parts = (["on each conversation at batch 1"] * ("latency" in modes)
             + [f"on each round of {size} conversations answered at once"]
             * ("throughput" in modes)
             + [f"on each round of {size} conversations (at least the concurrency) in the "
                "server"] * ("server" in modes))
    turns = ("; every method's engine was up at once, the methods taking turns "
             + " and ".join(parts)) if parts else ""
    if not settings.get("temperature"):
        return ("Greedy" if len(seeds) < 2 else (
            f"Greedy, measured once per engine seed {', '.join(map(str, seeds))} (the same "
            "outputs, repeated for the timings' spread: mean ± standard deviation)")) + turns
    return (f"Sampled at temperature {settings['temperature']}, top-p {settings['top_p']}, "
            f"engine seeds {', '.join(map(str, settings['seeds']))} (mean ± standard "
            f"deviation){turns}")


def _by_round(row: dict) -> str:
    rounds = row.get("speedup_by_round")
    if not rounds:
        return "n/a"
    return f"{rounds['mean']:.3f}x ± {rounds['stderr']:.3f} ({rounds['rounds']:.0f})"


def _per_position(row: dict) -> str:
    rates = row["acceptance_per_position"]
    return "n/a" if rates is None else " ".join(f"{r:.2f}" for r in rates[:PER_POSITION_SHOWN])


def _identical(row: dict) -> str:
    if row["equality"] is None:
        return "n/a"
    return ", ".join(f"t{turn} {e['identical']:g}/{e['compared']:g}"  # means over seeds
                     for turn, e in row["equality"].items())


def _divergence(row: dict) -> str:
    if row["equality"] is None:
        return "n/a"
    parts = [f"t{turn} {e['first_divergence_mean']:.0f}/{e['first_divergence_min']}"
             for turn, e in row["equality"].items() if e["first_divergence_min"] is not None]
    return ", ".join(parts) or "-"


def _accepted_by_source(row: dict) -> str:
    """Shares of lookahead's accepted draft tokens, by the source that drafted them."""
    shares = row.get("accepted_share_by_source")
    if not shares:
        return "n/a"
    return " ".join(f"{source} {share:.0%}" for source, share in shares.items() if share)


def _graph_steps(row: dict) -> str:
    steps = row.get("steps_by_graph_mode")
    if not steps:
        return "-"
    return f"{steps['FULL']} / {steps['PIECEWISE']} / {steps['NONE']}"


def _proposer(row: dict) -> str:
    if row["proposer_ms_per_step"] is None:
        return "n/a"
    return f"{row['proposer_ms_per_step']:.2f} ({100 * row['proposer_share']:.1f}%)"


def _kept(row: dict) -> str:
    """The cut's kept draft tokens: their estimated acceptance summed, and matched."""
    if row.get("kept_tokens_expected") is None:
        return "n/a"
    return f"{row['kept_tokens_expected']:.0f} / {row['kept_tokens_matched']:.0f}"


def _trees(row: dict) -> str:
    """Steps that verified a tree, of the proposer's steps, and their nodes off the
    main drafts per tree step (the tree's extra tokens)."""
    if row.get("tree_steps") is None:
        return "n/a"
    if not row["tree_steps"]:  # MTAD counts tree nodes, not tree steps
        return f"n/a ({row['tree_nodes']:.0f} nodes)" if row.get("tree_nodes") else "0"
    return f"{row['tree_steps']:.0f} ({row['tree_nodes'] / row['tree_steps']:.1f})"


# -- Plots ----------------------------------------------------------------------------

def write_plots(results: dict, rows: list[dict], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    offline_modes = [m for m in results["settings"]["modes"] if m != "server"]
    title = f"{results['model']['name']}, {results['machine']['name']}"
    for metric, label in (("speedup", "speedup vs none (tokens/s)"),
                          ("compression", "S = tokens / forward pass")):
        panels = []
        for mode in offline_modes:  # the baseline's speedup is 1 by definition: not drawn
            drawn = [r for r in rows if r["mode"] == mode
                     and not (metric == "speedup" and r["method"] == BASELINE)]
            if any(r[metric] is not None for r in drawn):  # no bars, no panel
                panels.append((mode, drawn))
        if panels:
            path = folder / f"{metric}.png"
            _bar_chart(panels, metric, label, f"{title}: {label}", path)
            written.append(path)
    server_rows = [r for r in rows if r["mode"] == "server"]
    if server_rows:
        path = folder / "concurrency.png"
        _concurrency_chart(server_rows, f"{title}: OpenAI server", path)
        written.append(path)
    return written


def _bar_chart(panels, metric: str, label: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4 * len(panels)), squeeze=False)
    for ax, (mode, rows) in zip(axes[:, 0], panels):
        groups = list(dict.fromkeys(_dataset_label(r) for r in _ordered(rows)))
        methods = list(dict.fromkeys(r["method"] for r in rows))
        width = 0.8 / max(len(methods), 1)
        values = {(r["method"], _dataset_label(r)): r[metric] for r in rows}
        for index, method in enumerate(methods):
            heights = [values.get((method, g)) or 0 for g in groups]
            ax.bar([x + index * width for x in range(len(groups))], heights, width, label=method)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))])
        ax.set_xticklabels(groups, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.set_title(MODE_TITLES[mode], fontsize=10)
        if methods:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _concurrency_chart(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    panels = (("tokens_per_second", "output tokens/s"), ("ttft_ms_mean", "TTFT ms (mean)"),
              ("tpot_ms", "TPOT ms"))
    fig, axes = plt.subplots(len(datasets), len(panels), figsize=(14, 3.6 * len(datasets)),
                             squeeze=False)
    for row_axes, dataset in zip(axes, datasets):
        dataset_rows = [r for r in rows if r["dataset"] == dataset]
        for ax, (metric, label) in zip(row_axes, panels):
            for method in dict.fromkeys(r["method"] for r in dataset_rows):
                points = sorted((r["concurrency"], r[metric]) for r in dataset_rows
                                if r["method"] == method and r[metric] is not None)
                ax.plot([c for c, _ in points], [v for _, v in points], marker="o", label=method)
            ax.set_xscale("log", base=2)
            levels = sorted({r["concurrency"] for r in dataset_rows})
            ax.set_xticks(levels, [str(level) for level in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(dataset, fontsize=10)
        row_axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ordered(rows: list[dict]) -> list[dict]:
    """Datasets and groups in run order (each dataset's overall row first), then by
    concurrency; methods in run order."""
    rank: dict[tuple, int] = {}
    for row in rows:
        rank.setdefault((row["dataset"],), len(rank))
        rank.setdefault((row["dataset"], row["group"]), len(rank))
    return sorted(rows, key=lambda r: (rank[(r["dataset"],)], rank[(r["dataset"], r["group"])],
                                       r["concurrency"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="a results JSON from benchmarks.run")
    args = parser.parse_args(argv)
    for path in write_report(json.loads(args.results.read_text()), args.results):
        print(path)


if __name__ == "__main__":
    main()
