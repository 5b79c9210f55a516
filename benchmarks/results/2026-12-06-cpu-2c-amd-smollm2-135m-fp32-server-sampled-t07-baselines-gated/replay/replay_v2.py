import sys; sys.path.insert(0, "."); sys.path.insert(0, "tests")  # from the repository root
import json
from pathlib import Path
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import LookaheadReplayer, NoDraftReplayer
from vllm_lookahead.lookahead import step_cost
def speed(make, reqs, clock):
    return summarize(reqs, replay(make, reqs, clock))["all"][2]
for t in ("t07", "t10"):
  trace = [Request(**row) for row in json.loads(Path(f"benchmarks/traces/smollm2-135m-sampled-{t}.json").read_text())]
  for ds in sorted({r.dataset for r in trace}):
    reqs = [r for r in trace if r.dataset == ds]
    for clock in [StepCost(0.040, 0.0017, 0.0017, 0.004), StepCost(0.040, 0.0017)]:
      for batch in (16, 32):
        none = speed(lambda: NoDraftReplayer(None, batch), reqs, clock)
        out = []
        for interval in (8, 1 << 30):
            step_cost.BASELINE_INTERVAL = interval
            out.append(speed(lambda: LookaheadReplayer({"method": "lookahead"}, batch), reqs, clock) / none)
        print(t, ds, len(reqs), clock.label[:40], batch, "baselines %.3f blind %.3f" % tuple(out), flush=True)
