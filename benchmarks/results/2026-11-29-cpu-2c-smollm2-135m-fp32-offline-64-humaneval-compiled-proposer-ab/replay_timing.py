"""The lookahead proposer's own time per step on a replay (no model; benchmarks/replay),
and a fingerprint of what it decided, to compare two versions of the code.

    PYTHONPATH=<checkout> python replay_timing.py BATCH DATASET [REPEATS]

DATASET: humaneval, mt_bench or all (of benchmarks/traces/smollm2-135m-humaneval-mtbench-64.json).
Each step costs a simulated 117 ms + 4.24 ms a token ((dj)'s fit at 64 requests), so the
cut decides the same on every run; the proposer's seconds are real (the least of REPEATS
runs). The fingerprint hashes each request's generated tokens, passes, verified draft
tokens and simulated seconds, and the proposer's counters but its seconds (among them the
cut's summed estimates, floats): equal fingerprints, equal decisions.
"""
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.replay.loop import Request, StepCost, replay
from benchmarks.replay.replayers import LookaheadReplayer

TRACE = Path(__file__).resolve().parents[2] / "traces" / "smollm2-135m-humaneval-mtbench-64.json"


def main() -> None:
    batch, dataset = int(sys.argv[1]), sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    trace = [Request(**row) for row in json.loads(TRACE.read_text())]
    trace = [request for request in trace if dataset in ("all", request.dataset)]
    LookaheadReplayer({"method": "lookahead"}, batch)  # imports and compiles, untimed
    best, made = None, []

    def make():
        made.append(LookaheadReplayer({"method": "lookahead"}, batch))
        return made[-1]

    for _ in range(repeats):
        made.clear()
        start = time.perf_counter()
        results = replay(make, trace, StepCost.parse("117,4.24"))
        wall = time.perf_counter() - start
        seconds = sum(replayer.proposer.stats.seconds for replayer in made)
        best = (seconds, wall) if best is None else min(best, (seconds, wall))
    counters = [{k: v for k, v in dataclasses.asdict(replayer.proposer.stats).items()
                 if k != "seconds"} for replayer in made]
    fingerprint = hashlib.sha1(json.dumps([results, counters], default=str).encode())
    steps = sum(replayer.proposer.stats.steps for replayer in made)
    print(f"batch {batch} {dataset}: proposer {best[0]:.3f} s in {steps} steps = "
          f"{1e3 * best[0] / steps:.2f} ms a step (replay wall {best[1]:.2f} s); "
          f"fingerprint {fingerprint.hexdigest()[:12]}")


if __name__ == "__main__":
    main()
