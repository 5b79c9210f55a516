import json, sys
from pathlib import Path
import os; ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3); sys.path.insert(0, ROOT)
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay import replayers
T = Path(ROOT) / "benchmarks" / "traces"
for cost in [StepCost(0.020, 0.0022), StepCost(0.030, 0.0016)]:
  for name in ["smollm2-135m-sampled-t10.json", "smollm2-135m-sampled-t07.json"]:
    trace = [Request(**r) for r in json.loads((T / name).read_text())]
    for bs in (16, 32):
        out = {}
        for label, spec, oracle in [("none", None, False), ("la", {"method": "lookahead"}, False), ("la-oracle", {"method": "lookahead"}, True)]:
            holder = {}
            def make():
                holder["r"] = (replayers.NoDraftReplayer(spec, bs) if spec is None else replayers.LookaheadReplayer(spec, bs)); return holder["r"]
            s = summarize(trace, replay(make, trace, cost, oracle_cut=oracle))["all"]
            out[label] = s
        print(cost.label, name[13:], bs, " ".join(f"{k}: S {v[0]:.3f} x{v[2]/out['none'][2]:.4f}" for k, v in out.items()), flush=True)
