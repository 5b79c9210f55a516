"""Rounds of several runs of one cell pooled: each round's tokens/s over no
speculation's on the same round (same seed), mean ± standard error over all rounds."""
import json
import statistics
import sys


def round_ratios(path):
    by = {}
    for m in json.load(open(path))["measurements"]:
        by.setdefault(m["method"], {})[m["seed"]] = [
            r["output_tokens"] / r["wall_seconds"] for r in m["rounds"]]
    none = by["none"]
    return {method: [x / y for seed in sorted(seeds) for x, y in zip(seeds[seed], none[seed])]
            for method, seeds in by.items() if method != "none"}


pooled = {}
for path in sys.argv[1:]:
    for method, ratios in round_ratios(path).items():
        pooled.setdefault(method, []).extend(ratios)
for method, ratios in pooled.items():
    se = statistics.stdev(ratios) / len(ratios) ** 0.5
    below = sum(r < 1 for r in ratios)
    print(f"{method}: {statistics.mean(ratios):.3f} ± {se:.3f} over {len(ratios)} rounds "
          f"({below} below no speculation)")
if len(pooled.get("lookahead", ())) == len(pooled.get("suffix", ())) > 0:  # both in every run
    ahead = sum(a > b for a, b in zip(pooled["lookahead"], pooled["suffix"]))
    print(f"lookahead above suffix in {ahead} of {len(pooled['lookahead'])} rounds")
