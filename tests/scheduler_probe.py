"""An engine with its core in this test's reach: greedy outputs beside what the engine
core's scheduler and the drafter's counters show, for tests of the scheduler's side
(scratch blocks held back, lookahead slots)."""

from __future__ import annotations

import os

#: Runs an engine with its core in process (the scheduler in reach) in a fresh
#: interpreter, so that the in-process engine's process groups and worker-side patches
#: end with it instead of staying in the test process.
SCHEDULER_PROBE = """
import dataclasses, json, sys
from vllm import LLM, SamplingParams

config = json.loads(sys.argv[1])
if config["start_cost"] is not None:  # the worker runs in this process: its measurement
    from vllm_lookahead.worker import start_cost
    measured = start_cost.StartCost(*config["start_cost"])
    start_cost.measure = lambda runner: measured
llm = LLM(config["model"], speculative_config=config["speculative_config"],
          disable_log_stats=False, **config["engine"])
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
pool = scheduler.kv_cache_manager.block_pool
free_at_start = pool.get_num_free_blocks()
params = SamplingParams(temperature=0, max_tokens=config["max_tokens"], ignore_eos=True)
outputs = llm.generate([{"prompt_token_ids": p} for p in config["prompts"]], params,
                       use_tqdm=False)
stats = llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats)[0]
print("RESULT " + json.dumps({
    "outputs": [list(o.outputs[0].token_ids) for o in outputs],
    "preemptions": next(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"),
    "block_size": scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size,
    "num_blocks": scheduler.kv_cache_config.num_blocks,
    "free_blocks_at_start": free_at_start,
    "free_blocks_at_end": pool.get_num_free_blocks(),
    "num_spec_tokens": scheduler.num_spec_tokens,
    "num_lookahead_tokens": scheduler.num_lookahead_tokens,
    "config_lookahead_tokens": getattr(scheduler.vllm_config, "num_lookahead_tokens", None),
    "step_blocks": getattr(scheduler, "_spec_decode_step_blocks", None),
    "stats": dataclasses.asdict(stats),
}))
"""


def run_beside_scheduler(model: str, speculative_config: dict, engine: dict,
                         prompts: list[list[int]], max_tokens: int,
                         start_cost: tuple[float, float] | None = None) -> dict:
    """Greedy outputs of ``prompts`` with what the engine core's scheduler and the
    drafter's counters show (``SCHEDULER_PROBE``); ``start_cost``: (seconds of a pass,
    of each token more) for the workers' start-up measurement (trees ``auto``) to
    report instead of timing the target."""
    import json
    import subprocess
    import sys

    config = {"model": model, "speculative_config": speculative_config, "engine": engine,
              "prompts": prompts, "max_tokens": max_tokens, "start_cost": start_cost}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", SCHEDULER_PROBE, json.dumps(config)],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
