import sys; sys.path.insert(0, "."); sys.path.insert(0, "tests")  # from the repository root
import numpy as np
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import LookaheadReplayer, NoDraftReplayer
from test_cost_aware_cut import noise, synthetic_requests, LOAD_TRACE
from vllm_lookahead.lookahead import step_cost
import json
def speed(make, reqs, clock):
    return summarize(reqs, replay(make, reqs, clock))["all"][2]
rng = np.random.default_rng(1)
noisy = [Request("s", "noise", noise(rng, 50), noise(rng, 200)) for _ in range(48)]
trace = [Request(**row) for row in json.loads(LOAD_TRACE.read_text())]
for name, reqs in [("noise", noisy), ("humaneval", [r for r in trace if r.dataset=="humaneval"]), ("mtbench", [r for r in trace if r.dataset!="humaneval"])]:
  for clock in [StepCost(0.040, 0.0017, 0.0017, 0.004), StepCost(0.040, 0.0017)]:
    for batch in (1, 16):
        none = speed(lambda: NoDraftReplayer(None, batch), reqs, clock)
        out = []
        for interval in (8, 1 << 30):
            step_cost.BASELINE_INTERVAL = interval
            out.append(speed(lambda: LookaheadReplayer({"method": "lookahead"}, batch), reqs, clock) / none)
        print(name, clock.label, batch, "baselines %.3f blind %.3f" % tuple(out))
