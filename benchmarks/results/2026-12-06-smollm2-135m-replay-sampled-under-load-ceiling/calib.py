import json, sys
from pathlib import Path
import os; ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3); sys.path.insert(0, ROOT)
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay import replayers
T = Path(ROOT) / "benchmarks" / "traces"
cost = StepCost(0.020, 0.0022)
for name in ["smollm2-135m-sampled-t10.json", "smollm2-135m-sampled-t07.json"]:
    trace = [Request(**r) for r in json.loads((T / name).read_text())]
    for bs in (16, 32):
        holder = []
        def make():
            holder.append(replayers.LookaheadReplayer({"method": "lookahead"}, bs)); return holder[-1]
        s = summarize(trace, replay(make, trace, cost))["all"]
        print(name[13:], bs, f"S {s[0]:.3f}")
        import numpy as np
        tot = {}
        for r in holder:
            for row in r.proposer.calibration.table():
                t = tot.setdefault(row["estimate_from"], [0, 0.0, 0.0])
                t[0] += row["tokens"]; t[1] += row["tokens"] * row["mean_estimate"]; t[2] += row["tokens"] * row["matched_rate"]
            st = r.proposer.stats
        for k, (n, e, m) in sorted(tot.items()):
            print(f"   bin {k:.1f}: kept {n:5d} est {e/n:.3f} matched {m/n:.3f}")
