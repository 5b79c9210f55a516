"""Lookahead replayed over traces on a simulated clock (45 ms + 1.6 ms a token) with
another response's match required to be MARGIN tokens longer than the context's own
(1: any longer, the rule before; 99: never where the context matches), and over the
HumanEval requests of two traces asked twice (the second time, the first answer is in
the corpus). Prints a Markdown table. Run from the repository root:
PYTHONPATH=. python benchmarks/results/2026-12-06-smollm2-135m-replay-corpus-margin/margins.py"""
import collections
import json
from pathlib import Path

from benchmarks.methods import DEFAULT_METHODS
from benchmarks.replay import loop
from benchmarks.replay.loop import Request, StepCost, replay
from benchmarks.replay.replayers import REPLAYERS
from vllm_lookahead.lookahead.sources import drafts

TRACES = Path("benchmarks/traces")
NAMES = ["smollm2-135m-sampled-t07", "smollm2-135m-sampled-t10",
         "smollm2-135m-humaneval-mtbench-specbench", "smollm2-135m-code-edit-reasoning",
         "qwen2.5-coder-0.5b-humaneval-mtbench-specbench"]
MARGINS = (1, 4, 99)


def load(name):
    return [Request(**row) for row in json.loads((TRACES / f"{name}.json").read_text())]


def asked_twice(name):
    humaneval = [row for row in load(name) if row.dataset == "humaneval"]
    return humaneval + humaneval


traces = {name: load(name) for name in NAMES}
traces["HumanEval asked twice, greedy"] = asked_twice("smollm2-135m-humaneval-mtbench-specbench")
traces["HumanEval asked twice, T 0.7"] = asked_twice("smollm2-135m-sampled-t07")
cost = StepCost.parse("45,1.6")
first_tokens = collections.Counter()
accepted_length = loop.accepted_length


def counting(draft, output, done):
    accepted = accepted_length(draft, output, done)
    first_tokens["drafts"] += bool(draft)
    first_tokens["accepted"] += bool(draft) and accepted > 0
    return accepted


loop.accepted_length = counting
spec = DEFAULT_METHODS["lookahead"].config
print("| trace | " + " | ".join(f"margin {m}: S, tok/s, first token" for m in MARGINS)
      + " | margin 4 / 1 | 99 / 1 |")
print("|---|" + "---|" * (len(MARGINS) + 2))
for name, trace in traces.items():
    cells, speeds = [], []
    for margin in MARGINS:
        drafts.CORPUS_MATCH_MARGIN = margin
        first_tokens.clear()
        results = replay(lambda: REPLAYERS["lookahead"](spec, 1), trace, cost)
        generated, passes = sum(r[0] for r in results), sum(r[1] for r in results)
        speed = sum(r[0] - 1 for r in results) / sum(r[3] for r in results)
        speeds.append(speed)
        cells.append(f"{generated / passes:.3f}, {speed:.2f}, "
                     f"{first_tokens['accepted'] / max(1, first_tokens['drafts']):.3f}")
    print(f"| {name} | " + " | ".join(cells)
          + f" | {speeds[1] / speeds[0]:.3f} | {speeds[2] / speeds[0]:.3f} |", flush=True)
