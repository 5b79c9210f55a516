"""`suffix` and lookahead replayed over the texts each method really generated (HumanEval
at T 0.7 in runs (eu) and (ew): eight prompts, six engine seeds), on a simulated clock of
45 ms + 1.6 ms a token, one fresh proposer per seed as each seed had its own engines; and
how predictable each method's texts are (S of the `suffix` replay, per seed and with a
bootstrap over texts). Prompts come from the T 0.7 trace, whose first HumanEval prompts
are the runs' (checked by length). Run from the repository root:
PYTHONPATH=. python benchmarks/results/2026-12-06-smollm2-135m-replay-real-sampled-texts/real_texts.py"""
import collections
import json
from pathlib import Path

import numpy as np

from benchmarks.methods import DEFAULT_METHODS
from benchmarks.replay.loop import Request, StepCost, replay
from benchmarks.replay.replayers import REPLAYERS

RUNS = Path("benchmarks/results")
RESULTS = ["2026-12-06-cpu-2c-amd-smollm2-135m-fp32-latency-sampled-t07-interleaved",
           "2026-12-06-cpu-2c-amd-smollm2-135m-fp32-latency-sampled-t07-humaneval-seeds2-5"]
prompts = [row["prompt"] for row in json.loads(
    Path("benchmarks/traces/smollm2-135m-sampled-t07.json").read_text())
    if row["dataset"] == "humaneval"]
texts = collections.defaultdict(list)  # method -> requests, "dataset" = the seed
for name in RESULTS:
    for m in json.loads((RUNS / name / "results.json").read_text())["measurements"]:
        if m["dataset"] != "humaneval":
            continue
        for i, request in enumerate(m["requests"]):
            assert len(prompts[i]) == request["prompt_tokens"], (name, i)
            texts[m["method"]].append(
                Request(f"seed {m['seed']}", "", prompts[i], request["output_tokens"]))

cost = StepCost.parse("45,1.6")
rng = np.random.default_rng(0)
print("| texts of | tokens | `suffix` replayed: S, tok/s | lookahead replayed: S, tok/s "
      "| lookahead / `suffix` | predictability (`suffix`'s S), 5-95 % over texts | "
      "per seed |")
print("|---|---|---|---|---|---|---|")
for method, trace in texts.items():
    cells, speeds = [], []
    for proposer in ("suffix", "lookahead"):
        spec = DEFAULT_METHODS[proposer].config
        results = np.array(replay(lambda: REPLAYERS[proposer](spec, 1), trace, cost))
        speed = (results[:, 0] - 1).sum() / results[:, 3].sum()
        speeds.append(speed)
        cells.append(f"{results[:, 0].sum() / results[:, 1].sum():.3f}, {speed:.2f}")
        if proposer == "suffix":
            draws = rng.integers(0, len(results), (2000, len(results)))
            boot = results[draws, 0].sum(1) / results[draws, 1].sum(1)
            spread = f"{np.percentile(boot, 5):.3f}-{np.percentile(boot, 95):.3f}"
            seeds = collections.defaultdict(lambda: np.zeros(2))
            for request, row in zip(trace, results):
                seeds[request.dataset] += row[:2]
            per_seed = " ".join(f"{t / p:.2f}" for t, p in seeds.values())
    print(f"| {method} | {sum(len(r.output) for r in trace)} | {cells[0]} | {cells[1]} "
          f"| {speeds[1] / speeds[0]:.3f} | {spread} | {per_seed} |", flush=True)
