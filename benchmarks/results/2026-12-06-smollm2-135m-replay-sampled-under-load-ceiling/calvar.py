import json, sys
from pathlib import Path
import os; ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3); sys.path.insert(0, ROOT)
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay import replayers
from vllm_lookahead.lookahead import budget, calibration
T = Path(ROOT) / "benchmarks" / "traces"
VARIANTS = {"base": (0.99, 20.0), "decay999": (0.999, 20.0), "prior5": (0.99, 5.0), "both": (0.999, 5.0)}
names = sys.argv[1].split(","); clocks = [StepCost.parse(c) for c in sys.argv[2].split(";")]
for cost in clocks:
  for name in names:
    trace = [Request(**r) for r in json.loads((T / name).read_text())]
    for bs in (1, 4, 16, 32):
        none = summarize(trace, replay(lambda: replayers.NoDraftReplayer(None, bs), trace, cost))["all"][2]
        line = f"{cost.label[:22]:22s} {name[13:28]:15s} bs{bs:2d}"
        for v, (d, p) in VARIANTS.items():
            budget.WORKER_DECAY, calibration.PRIOR_TOKENS = d, p
            s = summarize(trace, replay(lambda: replayers.LookaheadReplayer({"method": "lookahead"}, bs), trace, cost))["all"]
            line += f" | {v} S {s[0]:.3f} x{s[2]/none:.4f}"
        print(line, flush=True)
