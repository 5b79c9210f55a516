"""Side-by-side benchmark of speculative methods on one machine, in one run.

    python -m benchmarks.run --model smollm2-135m --methods none,ngram,suffix,lookahead \\
        --datasets humaneval,mt_bench,spec_bench --num-prompts 20 --max-tokens 256 \\
        --mode latency

Every method gets a fresh engine with identical engine arguments, the same sampling
(greedy unless --temperature) and the same prompts; with --seeds, once per engine
seed. The methods take turns on each dataset (and seed and concurrency) before the
next one starts, so that a machine whose speed drifts over minutes slows them alike.
Writes a run folder benchmarks/results/<date>-<name>/ (name: --name, default
<machine>-<model>-<modes>) with command.txt, results.json (all raw numbers, saved
after every measurement), then results.md and PNG plots (regenerate them with
`python -m benchmarks.report <folder>/results.json`).
See docs/benchmarking.md for what each number means.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import traceback
from pathlib import Path

from benchmarks import machine
from benchmarks import methods as methods_module
from benchmarks.arguments import comma_list, positive_ints, prompt_counts, seed_list
from benchmarks.cpu_env import configure_cpu_env
from benchmarks.datasets import DATASETS, ChatPrompter, Conversations, load
from benchmarks.models import MODELS, fetch
from benchmarks.offline import MODES as OFFLINE_MODES
from benchmarks.run_folder import add_arguments, command_line, make_run_folder

MODES = (*OFFLINE_MODES, "server")
SCHEMA_VERSION = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"one of {', '.join(MODELS)}, or a Hugging Face model folder")
    parser.add_argument("--methods", type=comma_list(), default="none,ngram,suffix,lookahead",
                        help=f"comma list; built in: {', '.join(methods_module.DEFAULT_METHODS)}")
    parser.add_argument("--method-config", action="append", default=[], metavar="NAME=JSON",
                        help="override a method's options (merged over its default), or define "
                             "a variant with its own name and a \"method\" key (added to the run)")
    parser.add_argument("--datasets", type=comma_list(DATASETS), default=",".join(DATASETS),
                        help="comma list")
    parser.add_argument("--num-prompts", type=prompt_counts, default="20",
                        help="conversations per dataset (Spec-Bench: per category), "
                             "e.g. 20 or 20,spec_bench=10")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per turn")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of every request (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of every request")
    parser.add_argument("--seeds", type=seed_list, default="0",
                        help="engine seeds, comma list: each method and dataset is measured "
                             "once per seed (greedy: the same outputs again, so repeats "
                             "that show how much the timings move)")
    parser.add_argument("--interleave", action="store_true",
                        help="every method's engine (server) up at once, the methods taking "
                             "turns on each conversation (latency) or round of "
                             "--round-size conversations (throughput, server), so that the "
                             "machine's drift cancels (memory: all engines at once)")
    parser.add_argument("--round-size", type=int, default=16,
                        help="--interleave: conversations a round, answered by each method "
                             "in turn, at once (throughput) or at the concurrency (server: "
                             "at least the concurrency)")
    parser.add_argument("--mode", type=comma_list(MODES), default="latency",
                        help="latency (batch 1), throughput (offline, all prompts at once), "
                             "server (OpenAI server at each --concurrency); comma list")
    parser.add_argument("--concurrency", type=positive_ints, default="1,4,16,32",
                        help="server mode: concurrent conversations")
    parser.add_argument("--dtype", default="float32",
                        help="float32 keeps greedy outputs comparable across methods on CPU")
    parser.add_argument("--max-model-len", type=int, default=4096, help="engine argument")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                        help="engine argument; the CPU backend needs an explicit KV budget")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="more engine keyword arguments as JSON, identical for all methods")
    parser.add_argument("--method-engine-args", action="append", default=[],
                        metavar="NAME=JSON",
                        help="engine keyword arguments of one method, merged over "
                             "--engine-args (e.g. a method's best compilation_config)")
    parser.add_argument("--machine", default=machine.default_name(),
                        help="machine label in the run folder's name")
    add_arguments(parser, "<machine>-<model>-<modes>")
    parser.add_argument("--request-timeout", type=float, default=600,
                        help="server mode: seconds a request may wait for its next chunk")
    parser.add_argument("--server-startup-timeout", type=float, default=900,
                        help="server mode: seconds until a new server must be healthy")
    return parser


def main(argv: list[str] | None = None) -> Path:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        selected = _selected_methods(args)
        args.method_engine_args = _method_engine_args(args.method_engine_args, selected)
    except ValueError as exc:
        parser.error(str(exc))
    counts = {name: args.num_prompts.get(name, args.num_prompts.get("*"))
              for name in args.datasets}
    if None in counts.values():
        parser.error(f"--num-prompts gives no count for some of {', '.join(args.datasets)}")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be positive")
    if args.round_size < 1:
        parser.error("--round-size must be positive")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the progress bar readable
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # proposer stats via RPC
    configure_cpu_env()

    model_name = args.model if args.model in MODELS else Path(args.model).name
    model_path = str(fetch(args.model)) if args.model in MODELS else args.model
    prompter = ChatPrompter(model_path)
    datasets = {name: Conversations(load(name, count), prompter)
                for name, count in counts.items()}
    engine_args = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": args.max_model_len,
                   "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "seed": args.seeds[0],
                   **args.engine_args}
    results = _new_results(args, argv, model_name, model_path, counts, datasets, engine_args,
                           selected)
    folder = make_run_folder(args.output_dir, run_name(args, model_name), results["command"])
    path = folder / "results.json"

    from tqdm import tqdm

    requests = {dataset: c.num_requests for dataset, c in datasets.items()}
    total = sum(requests[dataset] for _, dataset, *_ in
                measurement_plan(args.mode, selected, datasets, args.seeds, args.concurrency))
    runs = {(mode, name): _new_run(mode, name, method, model_name)
            for mode in args.mode for name, method in selected.items()}
    results["runs"] = list(runs.values())
    with tqdm(total=total, unit="req", dynamic_ncols=True) as progress:
        plan = measurement_plan(args.mode, selected, datasets, args.seeds, args.concurrency)
        for (mode, dataset, seed, concurrency), group in itertools.groupby(
                plan, key=lambda step: step[:4]):
            names = [name for *_, name in group if runs[mode, name]["status"] == "ok"]
            done_before = progress.n
            if args.interleave:
                progress.set_description(f"{mode} {dataset} interleaved")
                _measure_interleaved([runs[mode, name] for name in names], model_path,
                                     engine_args, dataset, datasets[dataset], seed,
                                     concurrency, args, results["measurements"],
                                     progress.update)
            else:
                for name in names:
                    progress.set_description(f"{mode} {dataset} {name}")
                    _measure(runs[mode, name], model_path, engine_args, dataset,
                             datasets[dataset], seed, concurrency, args,
                             results["measurements"], progress.update)
            for name in names:
                if runs[mode, name]["status"] != "ok":
                    tqdm.write(f"{mode} {name}: {runs[mode, name]['status']}: "
                               f"{runs[mode, name]['reason']}")
            progress.update(max(0, done_before + requests[dataset] * len(selected) - progress.n))
            _save(results, path)

    from benchmarks.report import write_report

    write_report(results, path)
    print(f"results: {folder}/")
    return path


def run_name(args, model_name: str) -> str:
    """The run folder's name after the date: --name, or <machine>-<model>-<modes>."""
    return args.name or f"{args.machine}-{model_name}-{'-'.join(args.mode)}"


def _selected_methods(args) -> dict[str, methods_module.Method]:
    """--methods plus the new variants that --method-config defines, in that order."""
    registry = methods_module.with_overrides(methods_module.DEFAULT_METHODS, args.method_config)
    variants = [text.partition("=")[0].strip() for text in args.method_config]
    names = list(dict.fromkeys(args.methods + [name for name in variants
                                               if name not in methods_module.DEFAULT_METHODS]))
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    return {name: registry[name] for name in names}


def _method_engine_args(texts: list[str], selected: dict) -> dict[str, dict]:
    """--method-engine-args NAME=JSON of the selected methods, as {name: dict}."""
    by_method = {}
    for text in texts:
        name, sep, body = text.partition("=")
        if not sep or name.strip() not in selected:
            raise ValueError(f"--method-engine-args expects NAME=JSON with NAME one of "
                             f"{', '.join(selected)}, got {text!r}")
        try:
            values = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"--method-engine-args {name}: invalid JSON {body!r}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"--method-engine-args {name}: expected a JSON object")  # noqa: TRY004
        by_method[name.strip()] = values
    return by_method


def _new_results(args, argv, model_name: str, model_path: str, counts: dict[str, int],
                 datasets: dict[str, Conversations], engine_args: dict,
                 selected: dict[str, methods_module.Method]) -> dict:
    """Everything that describes the run, before any measurement."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line("benchmarks.run", argv),
        "machine": {"name": args.machine, **machine.describe()},
        "software": machine.software_versions(),
        "git": machine.git_state(),
        "environment": {key: os.environ.get(key) for key in (
            "LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")},
        "model": {"name": model_name, "path": model_path},
        "settings": {"modes": args.mode, "datasets": args.datasets,
                     "num_prompts": counts,
                     "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "top_p": args.top_p, "seeds": args.seeds, "concurrency": args.concurrency,
                     "interleave": args.interleave, "round_size": args.round_size,
                     "prompts": {name: [s.id for s in c.samples] for name, c in datasets.items()}},
        "engine_args": engine_args,
        "method_engine_args": args.method_engine_args,
        "methods": {name: method.config for name, method in selected.items()},
        "runs": [],
        "measurements": [],
    }


def measurement_plan(modes: list[str], methods: dict, datasets: dict, seeds: list[int],
                     concurrency: list[int]):
    """(mode, dataset, seed, concurrency, method) in the order measured: every method in
    turn on one dataset, seed and concurrency before the next."""
    for mode in modes:
        for dataset, seed, level in itertools.product(
                datasets, seeds, concurrency if mode == "server" else [None]):
            for name in methods:
                yield mode, dataset, seed, level, name


def _new_run(mode: str, name: str, method, model_name: str) -> dict:
    """One method's record in one mode: its status and speculative configuration."""
    run = {"method": name, "mode": mode, "status": "ok", "reason": None,
           "speculative_config": None}
    reason = methods_module.unavailable_reason(method, model_name)
    if reason:
        return {**run, "status": "unavailable", "reason": reason}
    try:
        run["speculative_config"] = methods_module.speculative_config(method)
    except Exception as exc:  # noqa: BLE001 - reported in the results, the run goes on
        return {**run, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    return run


def _measure(run: dict, model_path: str, engine_args: dict, dataset: str,
             conversations: Conversations, seed: int, concurrency: int | None, args,
             measurements: list[dict], on_request) -> None:
    """Measure one method on one dataset (fresh engine or server), appending the
    measurement; a failure marks the method's run failed, and the run goes on."""
    from benchmarks.offline import measure_offline
    from benchmarks.server import measure_server

    sampling = _sampling(args)
    seeded = _seeded_engine_args(run, engine_args, seed, args)
    config = run["speculative_config"]
    try:
        if run["mode"] == "server":
            outcome = measure_server(
                model_path, config, seeded, dataset, conversations, sampling, concurrency,
                args.request_timeout, args.server_startup_timeout, on_request)
        else:
            outcome = measure_offline(run["mode"], model_path, config, seeded, dataset,
                                      conversations, sampling, on_request)
    except Exception as exc:  # noqa: BLE001 - reported in the results, the run goes on
        outcome = exc
    _record(run, outcome, seed, args, measurements)


def _measure_interleaved(runs: list[dict], model_path: str, engine_args: dict, dataset: str,
                         conversations: Conversations, seed: int, concurrency: int | None,
                         args, measurements: list[dict], on_request) -> None:
    """Measure the methods of `runs` (one mode) taking turns on each conversation or round
    (offline.measure_interleaved, server.measure_server_interleaved); a method that
    fails is marked so alone."""
    from benchmarks.offline import measure_interleaved
    from benchmarks.server import measure_server_interleaved

    methods = {run["method"]: (run["speculative_config"],
                               _seeded_engine_args(run, engine_args, seed, args))
               for run in runs}
    mode = runs[0]["mode"]
    if mode == "server":
        outcome = measure_server_interleaved(
            model_path, methods, dataset, conversations, _sampling(args), concurrency,
            args.round_size, args.request_timeout, args.server_startup_timeout, on_request)
    else:
        outcome = measure_interleaved(mode, model_path, methods, dataset, conversations,
                                      _sampling(args), on_request,
                                      1 if mode == "latency" else args.round_size)
    for run in runs:
        _record(run, outcome[run["method"]], seed, args, measurements)


def _sampling(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_p": args.top_p}


def _seeded_engine_args(run: dict, engine_args: dict, seed: int, args) -> dict:
    return {**engine_args, **args.method_engine_args.get(run["method"], {}), "seed": seed}


def _record(run: dict, outcome: dict | Exception, seed: int, args,
            measurements: list[dict]) -> None:
    """A method's measurement into the results, or its failure into its run (the
    traceback printed; the run goes on)."""
    if isinstance(outcome, Exception):
        traceback.print_exception(outcome)
        run.update(status="failed", reason=f"{type(outcome).__name__}: {outcome}")
    else:
        measurements.append({"method": run["method"], "seed": seed,
                             "temperature": args.temperature, **outcome})


def _save(results: dict, path: Path) -> None:
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results, indent=1) + "\n")
    partial.replace(path)


if __name__ == "__main__":
    main()
