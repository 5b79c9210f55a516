"""Runs (ej) and (eo) pooled: each set's tokens/s per method and seed (generated tokens
over the requests' seconds, as the harness's tables), then the mean over all seeds."""
import json, os, statistics, sys
here = os.path.dirname(os.path.abspath(__file__))
runs = [os.path.join(here, "..", name, "results.json") for name in (
    "2026-12-03-cpu-2c-smollm2-135m-fp32-latency-sampled-t07-ej",
    "2026-12-03-cpu-2c-smollm2-135m-fp32-latency-sampled-t07-seeds34")]
by = {}
for path in runs:
    for m in json.load(open(path))["measurements"]:
        rs = m["requests"]
        tps = sum(len(r["output_tokens"]) for r in rs) / sum(r["seconds"] for r in rs)
        by.setdefault((m["dataset"], m["method"]), []).append((m["seed"], tps))
methods = ["none", "ngram", "suffix", "lookahead"]
print("| set | seeds | " + " | ".join(methods) + " | lookahead / `suffix` | lookahead above `suffix` (seeds) |")
print("|---|---|" + "---|" * (len(methods) + 2))
for dataset in ("humaneval", "mt_bench", "spec_bench"):
    means = {k: statistics.mean(t for _, t in by[(dataset, k)]) for k in methods}
    sd = {k: statistics.stdev(t for _, t in by[(dataset, k)]) for k in methods}
    seeds = sorted(s for s, _ in by[(dataset, "none")])
    la = dict(by[(dataset, "lookahead")]); su = dict(by[(dataset, "suffix")])
    wins = sum(la[s] > su[s] for s in seeds)
    cells = [f"{means['none']:.1f} ± {sd['none']:.1f}"] + [
        f"{means[k]:.1f} ± {sd[k]:.1f}, {means[k] / means['none']:.2f}x" for k in methods[1:]]
    print(f"| {dataset} | {len(seeds)} | " + " | ".join(cells)
          + f" | {means['lookahead'] / means['suffix']:.2f}x | {wins} of {len(seeds)} |")
