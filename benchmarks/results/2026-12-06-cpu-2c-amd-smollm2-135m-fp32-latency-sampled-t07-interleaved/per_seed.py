"""Each seed's tokens/s by set and method (the harness's own rows, benchmarks.metrics,
one seed at a time), lookahead / `suffix` by seed, and per set over all the seeds of the
runs given: each method's speedup over no speculation and lookahead / `suffix`, mean ±
standard deviation. From the repository root:

    PYTHONPATH=. .venv/bin/python <this folder>/per_seed.py RESULTS.json [RESULTS.json ...]
"""
import json
import statistics
import sys
from collections import defaultdict

from benchmarks.metrics import summarize

METHODS = ("none", "ngram", "suffix", "lookahead")

by_seed = defaultdict(list)  # (set, seed) -> that seed's measurements
for path in sys.argv[1:]:
    for m in json.load(open(path))["measurements"]:
        by_seed[(m["dataset"], m["seed"])].append(m)
rows = {key: {r["method"]: r for r in summarize(ms) if r["group"] == "all"}
        for key, ms in sorted(by_seed.items())}

print("| set | seed | " + " | ".join(METHODS) + " | lookahead / suffix |")
print("|---|---|" + "---|" * (len(METHODS) + 1))
for (dataset, seed), row in rows.items():
    cells = " | ".join(f"{row[k]['tokens_per_second']:.1f}" if k in row else "-" for k in METHODS)
    ratio = row["lookahead"]["tokens_per_second"] / row["suffix"]["tokens_per_second"]
    print(f"| {dataset} | {seed} | {cells} | {ratio:.3f} |")

for dataset in sorted({d for d, _ in rows}):
    seeds = [row for (d, _), row in rows.items() if d == dataset]
    none = statistics.mean(row["none"]["tokens_per_second"] for row in seeds)
    print(f"\n{dataset}, {len(seeds)} seeds: none {none:.1f} tok/s")
    for method in METHODS[1:]:
        speedups = [row[method]["speedup"] for row in seeds if method in row]
        if len(speedups) > 1:
            print(f"  {method}: {statistics.mean(speedups):.2f}x ± "
                  f"{statistics.stdev(speedups):.2f} no speculation")
    ratios = [row["lookahead"]["tokens_per_second"] / row["suffix"]["tokens_per_second"]
              for row in seeds]
    if len(ratios) > 1:
        print(f"  lookahead / suffix: {statistics.mean(ratios):.3f} ± "
              f"{statistics.stdev(ratios):.3f}")
