import json, sys
from pathlib import Path
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import LookaheadReplayer
from vllm_lookahead.lookahead import rests
T = Path(sys.path[0]) / "benchmarks" / "traces"
cost = StepCost(0.020, 0.0022)
for trace_name in ["smollm2-135m-humaneval-mtbench-64.json", "smollm2-135m-sampled-t07.json", "smollm2-135m-humaneval-mtbench-specbench.json", "smollm2-135m-sampled-t10.json"]:
    trace = [Request(**r) for r in json.loads((T / trace_name).read_text())]
    for bs in (8, 16, 32):
        line = f"{trace_name[13:35]:22s} bs {bs:2d}"
        base = None
        for mx, mn in [(0, 12), (2, 12), (2, 8)]:
            rests.MAX_REST_STEPS, rests.MIN_REQUESTS = mx, mn
            holder = {}
            def make():
                holder["r"] = LookaheadReplayer({"method": "lookahead"}, bs); return holder["r"]
            s = summarize(trace, replay(make, trace, cost))["all"]
            st = holder["r"].proposer.stats
            base = base or s[2]
            line += f" | max{mx} min{mn}: S {s[0]:.3f} {s[2]/base:.4f} rest {st.resting_drafts/st.request_passes:.2f} prop {st.seconds/st.steps*1e3:.2f}ms"
        print(line, flush=True)
