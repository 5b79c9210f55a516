"""Rounds of several runs of one cell pooled: each round's tokens/s over no
speculation's on the same round (``benchmarks.metrics.round_speedups``), their mean
and standard error over all rounds (``by_round``). Run from the repository root:
``python3 <this file> RUN/results.json ...`` (no vLLM needed; without it the
plugin says on stderr that it cannot register)."""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from benchmarks.metrics import BASELINE, by_round, round_speedups  # noqa: E402

pooled: dict[str, list[float]] = {}
for path in sys.argv[1:]:
    measurements = json.load(open(path))["measurements"]
    baselines = {m["seed"]: m for m in measurements if m["method"] == BASELINE}
    for m in sorted(measurements, key=lambda m: m["seed"]):
        if m["method"] != BASELINE:
            pooled.setdefault(m["method"], []).extend(round_speedups(m, baselines[m["seed"]]))
for method, ratios in pooled.items():
    summary = by_round(ratios)
    print(f"{method}: {summary['mean']:.3f} ± {summary['stderr']:.3f} over {len(ratios)} rounds "
          f"({sum(r < 1 for r in ratios)} below no speculation)")
if len(pooled.get("lookahead", ())) == len(pooled.get("suffix", ())) > 0:  # both in every run
    ahead = sum(a > b for a, b in zip(pooled["lookahead"], pooled["suffix"]))
    print(f"lookahead above suffix in {ahead} of {len(pooled['lookahead'])} rounds")
