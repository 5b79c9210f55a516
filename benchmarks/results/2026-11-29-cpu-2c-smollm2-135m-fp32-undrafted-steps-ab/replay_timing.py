"""The lookahead proposer's own time a step on a replay (no model; benchmarks/replay),
what it decided, and the simulated decode speed, to compare two versions of the code.

    PYTHONPATH=<checkout> python replay_timing.py BATCH DATASET CLOCK [REPEATS]

DATASET: humaneval, mt_bench or all (of benchmarks/traces/smollm2-135m-humaneval-mtbench-64.json).
CLOCK: the simulated step cost, ``--step-cost``'s FIXED_MS,TOKEN_MS[,DRAFT_MS] (e.g.
60,3.5,3.85: run (do)'s measured decode step on the 2-core host). The proposer's
seconds are real (the least of REPEATS runs). The fingerprint hashes each request's
generated tokens, passes, verified draft tokens and simulated seconds, and the
proposer's counters but its seconds and ``undrafted_steps`` (a counter the older code
lacks): equal fingerprints, equal decisions.
"""
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from benchmarks.replay.loop import Request, StepCost, replay, summarize
from benchmarks.replay.replayers import LookaheadReplayer, NoDraftReplayer

TRACE = Path(__file__).resolve().parents[2] / "traces" / "smollm2-135m-humaneval-mtbench-64.json"
UNCOMPARED = ("seconds", "undrafted_steps")


def main() -> None:
    batch, dataset, clock = int(sys.argv[1]), sys.argv[2], StepCost.parse(sys.argv[3])
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
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
        results = replay(make, trace, clock)
        wall = time.perf_counter() - start
        seconds = sum(replayer.proposer.stats.seconds for replayer in made)
        best = (seconds, wall) if best is None else min(best, (seconds, wall))
    stats = [dataclasses.asdict(replayer.proposer.stats) for replayer in made]
    counters = [{k: v for k, v in row.items() if k not in UNCOMPARED} for row in stats]
    fingerprint = hashlib.sha1(json.dumps([results, counters], default=str).encode())
    steps = sum(row["steps"] for row in stats)
    undrafted = sum(row.get("undrafted_steps", 0) for row in stats)
    s, _, speed = summarize(trace, results)["all"]
    _, _, none = summarize(trace, replay(lambda: NoDraftReplayer(None, batch), trace,
                                         clock))["all"]
    print(f"batch {batch} {dataset} clock {sys.argv[3]}: proposer {best[0]:.3f} s in {steps} "
          f"steps = {1e3 * best[0] / steps:.2f} ms a step (replay wall {best[1]:.2f} s); "
          f"undrafted steps {undrafted}; S {s:.3f}; decode {speed / none:.3f}x no speculation "
          f"(simulated); fingerprint {fingerprint.hexdigest()[:12]}")


if __name__ == "__main__":
    main()
