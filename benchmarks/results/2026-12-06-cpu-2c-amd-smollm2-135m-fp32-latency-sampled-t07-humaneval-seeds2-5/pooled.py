"""HumanEval at T 0.7 over the seeds of (eu) and this run: each seed's speedups over no
speculation (tokens/s from each method's requests), their mean and spread, and the mean
of lookahead / `suffix` by seed."""
import json
import statistics
from collections import defaultdict

RUNS = ("../2026-12-06-cpu-2c-amd-smollm2-135m-fp32-latency-sampled-t07-interleaved/results.json",
        "results.json")
rates = defaultdict(dict)
for path in RUNS:
    for m in json.load(open(path))["measurements"]:
        if m["dataset"] == "humaneval":
            tokens = sum(len(r["output_tokens"]) for r in m["requests"])
            rates[m["seed"]][m["method"]] = tokens / sum(r["seconds"] for r in m["requests"])
for method in ("ngram", "suffix", "lookahead"):
    speedups = [r[method] / r["none"] for r in rates.values()]
    print(f"{method}: {statistics.mean(speedups):.2f}x ± {statistics.stdev(speedups):.2f} "
          f"over {len(speedups)} seeds")
ratios = [r["lookahead"] / r["suffix"] for r in rates.values()]
print(f"none: {statistics.mean(r['none'] for r in rates.values()):.1f} tok/s")
print(f"lookahead / suffix: {statistics.mean(ratios):.3f} ± {statistics.stdev(ratios):.3f}, "
      f"by seed {[round(x, 3) for x in ratios]}")
