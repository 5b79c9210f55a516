"""Load and abort test: the OpenAI server with lookahead under many concurrent requests.

    python -m benchmarks.load_test --requests 500 --concurrency 32 [--model smollm2-135m]

The workload is seeded: token-id prompts of mixed lengths (first turns of the
vendored prompt sets; a few filled up to just below ``max_model_len``), mixed
``max_tokens``, half of the requests streamed, a share of the streams dropped by
the client mid-way (the server aborts them), a few sampled (temperature 0.8, not
compared), a few with an out-of-range per-request option (must be HTTP 400).
Every greedy request is answered once by a server without speculation first.

Checks (a failed one makes the exit status 1): the server stays healthy; every
completed greedy response equals the reference token for token; every bad
request got 400 and every other request was served; the proposer's state count
(``vllm:speculative_active_requests``) returns to 0; resident memory of the
server's process tree grows less than ``--rss-growth-bound-mib`` from the end
of the first half of the requests to the end (the
first half warms up vLLM's and the allocator's caches). Writes the run folder
benchmarks/results/<date>-<name>/ (``--name``, default ``<machine>-<model>-load-test``):
results.json, results.md, memory-and-state.png, command.txt.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import re
import sys
import time
from pathlib import Path

from benchmarks import machine
from benchmarks.cpu_env import configure_cpu_env
from benchmarks.load_workload import Outcome, RequestSpec, build_workload, run_workload
from benchmarks.metrics import first_divergence
from benchmarks.records import prometheus_samples
from benchmarks.run_folder import add_arguments, command_line, make_run_folder
from benchmarks.server import ApiServer

STATE_DRAIN_TIMEOUT_S = 60.0
SAMPLE_PERIOD_S = 1.0
TINY_MODEL = "tiny-llama"


def prometheus_value(text: str, name: str) -> float | None:
    """Sum of a metric's samples over label sets (None when absent)."""
    values = [float(value) for sample, _, value in prometheus_samples(text)
              if sample == name]
    return sum(values) if values else None


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += map(int, (task / "children").read_text().split())
        except (OSError, TypeError):  # exited meanwhile, or a kernel thread
            continue
    return total


class ServerProbe:
    """Health, memory and lookahead gauges of one server, sampled in the background."""

    def __init__(self, base_url: str, pid: int):
        self.base_url = base_url
        self.pid = pid
        self.samples: list[dict] = []
        self.unhealthy: list[str] = []
        self._started = time.monotonic()

    async def sample(self, client) -> dict:
        row = {"t": round(time.monotonic() - self._started, 2), "rss_mib": rss_bytes(self.pid) / 2**20}
        try:
            health = await client.get(f"{self.base_url}/health", timeout=30)
            if not health.is_success:
                self.unhealthy.append(f"t={row['t']}: /health {health.status_code}")
            text = (await client.get(f"{self.base_url}/metrics", timeout=30)).text
            row["active_requests"] = prometheus_value(text, "vllm:speculative_active_requests")
            row["pool_ngrams"] = prometheus_value(text, "vllm:lookahead_pool_ngrams")
            row["live_responses"] = prometheus_value(text, "vllm:lookahead_live_responses")
            row["preemptions"] = prometheus_value(text, "vllm:num_preemptions_total")
        except Exception as exc:  # noqa: BLE001 - an unreachable server is a finding
            self.unhealthy.append(f"t={row['t']}: {type(exc).__name__}: {exc}")
        self.samples.append(row)
        return row

    async def run_until(self, done: asyncio.Event) -> None:
        import httpx

        async with httpx.AsyncClient(trust_env=False) as client:
            while not done.is_set():
                await self.sample(client)
                await asyncio.sleep(SAMPLE_PERIOD_S)

    async def wait_for_freed_state(self) -> dict:
        """Sample until no request state is left (bounded); the last sample."""
        import httpx

        deadline = time.monotonic() + STATE_DRAIN_TIMEOUT_S
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                row = await self.sample(client)
                drained = row.get("active_requests") == 0 and not row.get("live_responses")
                if drained or time.monotonic() > deadline:
                    return row
                await asyncio.sleep(SAMPLE_PERIOD_S)


async def load_server(base_url: str, model: str, pid: int, specs: list[RequestSpec],
                      concurrency: int, request_timeout: float) -> dict:
    """Run ``specs`` against a lookahead server while probing it; JSON-ready results."""
    probe = ServerProbe(base_url, pid)
    done, finished = asyncio.Event(), 0
    half_rss: list[float] = []

    def on_done() -> None:
        nonlocal finished
        finished += 1
        if finished == max(1, len(specs) // 2):
            half_rss.append(rss_bytes(pid) / 2**20)

    started = time.monotonic()
    probing = asyncio.create_task(probe.run_until(done))
    outcomes = await run_workload(base_url, model, specs, concurrency, request_timeout, on_done)
    wall = time.monotonic() - started
    done.set()
    await probing
    final = await probe.wait_for_freed_state()
    return {"outcomes": outcomes, "wall_seconds": wall, "samples": probe.samples,
            "unhealthy": probe.unhealthy, "rss_mib_at_half": half_rss[0],
            "final": final}


def evaluate(specs: list[RequestSpec], outcomes: dict[int, Outcome],
             reference: dict[int, list[int]], load: dict, rss_bound_mib: float) -> dict:
    """Counts and the pass/fail checks of one load run."""
    statuses: dict[str, int] = {}
    for outcome in outcomes.values():
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    compared = [s for s in specs if s.compared]
    mismatches = [s.index for s in compared if outcomes[s.index].tokens != reference[s.index]]
    unexpected = [f"request {s.index}: {outcomes[s.index].status} "
                  f"{outcomes[s.index].http_status} {outcomes[s.index].detail[:200]}"
                  for s in specs if not _as_expected(s, outcomes[s.index])]
    growth = load["final"]["rss_mib"] - load["rss_mib_at_half"]
    checks = {
        "server healthy throughout": not load["unhealthy"],
        "every request got its expected outcome": not unexpected,
        "completed greedy responses equal no-speculation": not mismatches,
        "proposer state count back to 0": load["final"].get("active_requests") == 0,
        "no live-corpus slot held": not load["final"].get("live_responses"),
        f"RSS growth over the second half < {rss_bound_mib:g} MiB": growth < rss_bound_mib,
    }
    return {
        "statuses": statuses,
        "compared": len(compared),
        "mismatched_requests": mismatches,
        "first_divergence": {s.index: first_divergence(outcomes[s.index].tokens,
                                                        reference[s.index])
                             for s in compared if s.index in mismatches},
        "unexpected": unexpected[:20],
        "rss_growth_mib": growth,
        "checks": checks,
        "passed": all(checks.values()),
    }


def _as_expected(spec: RequestSpec, outcome: Outcome) -> bool:
    if spec.bad_option:
        return outcome.status == "rejected" and outcome.http_status == 400
    if spec.disconnect_after_chunks is not None:
        # a short stream may end before the client drops it
        return outcome.status in ("disconnected", "completed")
    return outcome.status == "completed"


async def reference_outputs(base_url: str, model: str, specs: list[RequestSpec],
                            concurrency: int, request_timeout: float) -> dict[int, list[int]]:
    """Token ids of every compared request from a server without speculation (which
    refuses lookahead's per-request options: they go without them)."""
    plain = [dataclasses.replace(s, stream=False, options=None) for s in specs if s.compared]
    outcomes = await run_workload(base_url, model, plain, concurrency, request_timeout)
    failed = [f"{i}: {o.detail[:200]}" for i, o in outcomes.items() if o.status != "completed"]
    if failed:
        raise RuntimeError(f"the reference server failed requests: {failed[:5]}")
    return {index: outcome.tokens for index, outcome in outcomes.items()}


def _dataset_prompts(model_path: str, count: int) -> list[list[int]]:
    from benchmarks.datasets import DATASETS, ChatPrompter, load

    prompter = ChatPrompter(model_path)
    per_dataset = -(-count // len(DATASETS))
    return [prompter.prompt(sample, []) for name in DATASETS for sample in load(name, per_dataset)]


def write_results(results: dict, folder: Path) -> list[Path]:
    json_path = folder / "results.json"
    json_path.write_text(json.dumps(results, indent=1))
    md_path = folder / "results.md"
    md_path.write_text(render_markdown(results))
    png_path = folder / "memory-and-state.png"
    _plot(results, png_path)
    return [json_path, md_path, png_path]


def render_markdown(results: dict) -> str:
    ev, cfg, host = results["evaluation"], results["config"], results["machine"]
    title = (f"# Load test: {cfg['model']} ({cfg['dtype']}), {cfg['requests']} requests at "
             f"concurrency {cfg['concurrency']}")
    setting = (f"Machine: {host['cpu_model']}, {host['cores_usable']} cores, date "
               f"{results['date']}; lookahead server wall time {results['wall_seconds']:.0f} s "
               f"({results['completed_tokens_per_s']:.1f} completed tokens/s).")
    lines = [title, "", f"Command: `{results['command']}`  ", setting, "",
             "| check | result |", "|---|---|"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in ev["checks"].items()]
    lines += ["", "| outcome | requests |", "|---|---|"]
    lines += [f"| {status} | {count} |" for status, count in sorted(ev["statuses"].items())]
    divergence = (f" (first divergence at token {ev['first_divergence']})"
                  if ev["mismatched_requests"] else "")
    compared = (f"Greedy responses compared with the no-speculation server: {ev['compared']}, "
                f"mismatched: {len(ev['mismatched_requests'])}{divergence}.")
    peak = max(sample["rss_mib"] for sample in results["samples"])
    memory = (f"Server RSS (process tree): {results['rss_mib_at_half']:.0f} MiB after half "
              f"of the requests, {results['final']['rss_mib']:.0f} MiB at the end (growth "
              f"{ev['rss_growth_mib']:+.0f} MiB, bound {cfg['rss_growth_bound_mib']:g}); "
              f"peak {peak:.0f} MiB.")
    final = results["final"]
    state = (f"Proposer state after the run: {final.get('active_requests')} requests, "
             f"{final.get('pool_ngrams')} pool n-grams, {final.get('live_responses')} "
             f"live-corpus slots; vLLM preempted {final.get('preemptions')} times.")
    lines += ["", compared, memory, state, ""]
    if ev["unexpected"]:
        lines += ["Unexpected outcomes (first 20):", ""] + [f"- {u}" for u in ev["unexpected"]]
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = results["samples"]
    t = [s["t"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(t, [s["rss_mib"] for s in samples])
    top.set_ylabel("server RSS (MiB)")
    top.set_title(f"Load test, {results['config']['model']}: "
                  f"{results['config']['requests']} requests at concurrency "
                  f"{results['config']['concurrency']}")
    bottom.plot(t, [s.get("active_requests") or 0 for s in samples], label="active requests")
    pool = bottom.twinx()
    pool.plot(t, [s.get("pool_ngrams") or 0 for s in samples], color="tab:orange",
              label="pool n-grams")
    bottom.set_ylabel("proposer: active requests")
    pool.set_ylabel("pool n-grams", color="tab:orange")
    bottom.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.models import MODELS, fetch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=TINY_MODEL,
                        help=f"{TINY_MODEL} (the tests' random-weight Llama, built here), one "
                             f"of {', '.join(MODELS)}, or a model folder")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--dtype", default="float32",
                        help="float32: greedy outputs must match bit for bit")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int,
                        help="KV cache size (default: 64 MiB for the tiny model, 2 GiB else): "
                             "small enough that the first half of the run touches all of it "
                             "(its pages count in RSS once used) and that full concurrency "
                             "preempts requests")
    parser.add_argument("--speculative-config", default='{"method": "lookahead"}')
    parser.add_argument("--rss-growth-bound-mib", type=float, default=128.0)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disconnect-share", type=float, default=0.15,
                        help="share of the requests whose stream the client drops (about)")
    parser.add_argument("--sampled-share", type=float, default=0.1)
    parser.add_argument("--options-share", type=float, default=0.0,
                        help="share of the requests with their own lookahead options")
    add_arguments(parser, "<machine>-<model>-load-test")
    args = parser.parse_args(argv)
    configure_cpu_env()
    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = 64 * 2**20 if args.model == TINY_MODEL else 2 * 2**30
    if args.model == TINY_MODEL:
        from tests.tiny_models import build_model

        model_path = str(build_model(Path.home() / ".cache" / "vllm-lookahead" / "models"
                                     / TINY_MODEL, "llama", seed=0))
    else:
        model_path = str(fetch(args.model)) if args.model in MODELS else args.model
    prompts = _dataset_prompts(model_path, 60)
    specs = build_workload(prompts, args.requests, args.max_model_len, args.seed,
                           disconnect_share=args.disconnect_share,
                           sampled_share=args.sampled_share, options_share=args.options_share)
    engine_args = {"dtype": args.dtype, "enforce_eager": True,
                   "max_model_len": args.max_model_len, "seed": 0,
                   "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                   "max_num_seqs": max(args.concurrency, 1)}
    print(f"reference: {sum(s.compared for s in specs)} greedy requests, no speculation",
          flush=True)
    with ApiServer(model_path, None, engine_args, startup_timeout=900) as plain:
        reference = asyncio.run(reference_outputs(plain.base_url, plain.model, specs,
                                                  args.concurrency, args.request_timeout))
    print(f"load: {len(specs)} requests at concurrency {args.concurrency}, lookahead", flush=True)
    speculative = json.loads(args.speculative_config)
    with ApiServer(model_path, speculative, engine_args, startup_timeout=900) as server:
        load = asyncio.run(load_server(server.base_url, server.model, server.pid, specs,
                                       args.concurrency, args.request_timeout))
    evaluation = evaluate(specs, load["outcomes"], reference, load, args.rss_growth_bound_mib)
    completed_tokens = sum(len(o.tokens) for o in load["outcomes"].values()
                           if o.status == "completed")
    date = datetime.date.today().isoformat()
    results = {
        "command": command_line("benchmarks.load_test", argv),
        "date": date, "machine": machine.describe(), "software": machine.software_versions(),
        "git": machine.git_state(),
        "config": {"model": args.model, "dtype": args.dtype, "requests": args.requests,
                   "concurrency": args.concurrency, "max_model_len": args.max_model_len,
                   "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                   "speculative_config": speculative, "seed": args.seed,
                   "rss_growth_bound_mib": args.rss_growth_bound_mib},
        "workload": {"streamed": sum(s.stream for s in specs),
                     "client_disconnects": sum(s.disconnect_after_chunks is not None
                                               for s in specs),
                     "sampled": sum(s.temperature > 0 for s in specs),
                     "bad_option": sum(s.bad_option for s in specs),
                     "near_max_model_len": sum(s.near_max_model_len for s in specs),
                     "prompt_tokens": sum(len(s.prompt) for s in specs)},
        "wall_seconds": load["wall_seconds"],
        "completed_tokens_per_s": completed_tokens / load["wall_seconds"],
        "rss_mib_at_half": load["rss_mib_at_half"],
        "final": load["final"], "samples": load["samples"], "unhealthy": load["unhealthy"],
        "evaluation": evaluation,
    }
    folder = make_run_folder(args.output_dir,
                             args.name or f"{machine.default_name()}-{args.model}-load-test",
                             results["command"])
    for path in write_results(results, folder):
        print(f"wrote {path}")
    print(render_markdown(results))
    return 0 if evaluation["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
