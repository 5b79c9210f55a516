"""Per method, replayed over a trace on a simulated clock (45 ms + 1.6 ms a token, about
run (ep)'s host): S, simulated decode tokens/s, the passes with a draft, tokens a draft,
the first token's acceptance and the accepted tokens a pass. Run from the repository
root: PYTHONPATH=. python drafted_passes.py TRACE [NAME=JSON ...]"""
import collections
import json
import sys
from pathlib import Path

from benchmarks.methods import DEFAULT_METHODS, with_overrides
from benchmarks.replay import loop
from benchmarks.replay.loop import Request, StepCost, replay
from benchmarks.replay.replayers import REPLAYERS

trace = [Request(**row) for row in json.loads(Path(sys.argv[1]).read_text())]
configs = sys.argv[2:]
methods = with_overrides(DEFAULT_METHODS, configs)
names = ["suffix", "lookahead"] + [c.partition("=")[0] for c in configs]
cost = StepCost.parse("45,1.6")
stats = collections.defaultdict(collections.Counter)
accepted_length = loop.accepted_length
current = {}


def counting(draft, output, done):
    n = accepted_length(draft, output, done)
    s = stats[current["name"]]
    s["passes"] += 1
    if draft:
        s["drafted"] += 1
        s["tokens"] += len(draft)
        s["first"] += n > 0
    s["accepted"] += n
    return n


loop.accepted_length = counting
for name in dict.fromkeys(names):
    spec = methods[name].config
    current["name"] = name
    results = replay(lambda: REPLAYERS[spec["method"]](spec, 1), trace, cost)
    generated = sum(r[0] for r in results)
    passes = sum(r[1] for r in results)
    seconds = sum(r[3] for r in results)
    s = stats[name]
    print(f"| {name} | {generated / passes:.3f} | {sum(r[0] - 1 for r in results) / seconds:.2f} "
          f"| {s['drafted'] / s['passes']:.2f} | {s['tokens'] / max(1, s['drafted']):.2f} "
          f"| {s['first'] / max(1, s['drafted']):.3f} | {s['accepted'] / s['passes']:.3f} |")
