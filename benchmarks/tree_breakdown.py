"""Where a tree step's time goes, piece by piece, next to a linear step of the same
token count (issue 93).

One engine, in this process, at batch size 1, with trees on in every step (issue 93's
``trees: "on"``, 4 candidates, window 4, no cost-aware cut). Two parts:

- ``fixed``: ``tree_cost.measure``'s fixed random drafts of T tokens, verified as a chain
  (``linear``) or as four chains from the root (``tree``), the same token count; and
  ``linear`` once more without the timers (``linear-bare``: what the timers cost).
- ``served``: the real proposer on HumanEval prompts, its trees switched off
  (``linear``) and on (``tree``); steps differ in token count, and the proposer's own
  tree growing shows.

Each piece is timed by wrapping, at run time in this process only, the function or
method the step runs (``time.perf_counter`` on entry and exit; a piece's time excludes
the pieces timed inside it, so the pieces and ``rest`` add up to the engine step):

    python -m benchmarks.tree_breakdown --model smollm2-135m --dtype float32

Writes ``benchmarks/results/<date>-<name>/`` (``--name``, default
``<machine>-<model>-tree-step-breakdown``): results.json, results.md, breakdown.png,
command.txt.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from benchmarks.models import MODELS, fetch
from benchmarks.run_folder import add_arguments, command_line
from benchmarks.tree_breakdown_report import PIECES, write
from benchmarks.tree_cost import measure

class StepTimers:
    """Wraps the pieces' functions; records each engine step's pieces (ms, calls)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[float]] = []
        self.steps: list[dict] = []
        self.patches: list[tuple[Any, str, bool, Any]] = []

    def wrap(self, owner: Any, attr: str, piece: str,
             observe: Callable[..., None] | None = None) -> None:
        own = attr in vars(owner)
        original = getattr(owner, attr)
        stack, current, calls = self.stack, self.current, self.calls

        def timed(*args, **kwargs):
            if observe is not None:
                observe(*args, **kwargs)
            frame = [0.0]  # time of the pieces inside
            stack.append(frame)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                stack.pop()
                current[piece] += elapsed - frame[0]
                calls[piece] += 1
                if stack:
                    stack[-1][0] += elapsed

        self.patches.append((owner, attr, own, vars(owner).get(attr)))
        setattr(owner, attr, timed)

    def install(self, llm: Any, runner: Any, drafter: Any) -> None:
        from vllm.v1.sample import rejection_sampler

        from vllm_lookahead.lookahead import planning
        from vllm_lookahead.worker import sampler, tree_attention, tree_step
        from vllm_lookahead.worker.tree_step import attention_layers

        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        for attr in ("schedule", "update_from_output"):
            self.wrap(scheduler, attr, "scheduler")

        def count_tokens(scheduler_output, *args, **kwargs):
            self.current["tokens"] += scheduler_output.total_num_scheduled_tokens

        self.wrap(runner, "_prepare_inputs", "prepare inputs (vLLM)", count_tokens)
        self.wrap(tree_step, "_trees_of_step", "tree planning")
        self.wrap(tree_attention, "copy_root_blocks", "root block copies")
        for group in runner.attn_groups[0]:
            for builder in group.metadata_builders:
                self.wrap(builder, "build", "metadata build (vLLM)")
        self.wrap(tree_attention, "split_metadata", "metadata split")
        self.wrap(runner.model, "forward", "model, without attention")
        for cls in {type(layer.impl) for layer in attention_layers(runner)}:
            self.wrap(cls, "forward", "attention kernel")
        self.wrap(tree_attention, "prepare_layer", "scratch path writes")
        self.wrap(runner.model, "compute_logits", "logits")
        self.wrap(runner.rejection_sampler, "forward", "sampling (vLLM)")
        self.wrap(rejection_sampler, "rejection_sample", "verification (vLLM)")
        self.wrap(sampler, "_verify_trees", "tree verification")
        self.wrap(sampler, "move_accepted_paths", "KV move")
        for owner, attr in ((sampler, "capture_verification"), (sampler, "top_k_logprobs"),
                            (drafter, "on_verification"), (drafter, "on_last_top_k")):
            self.wrap(owner, attr, "drafter captures")
        self.wrap(runner, "propose_draft_token_ids", "drafting")
        # where the planner looks it up (it imports the name)
        self.wrap(planning, "grow_trees", "tree growing (proposer)")
        original = engine.step

        def recorded_step():  # the whole step, then its pieces
            self.current.clear()
            self.calls.clear()
            start = time.perf_counter()
            outputs = original()
            self.steps.append({"ms": 1e3 * (time.perf_counter() - start),
                               "tokens": self.current.pop("tokens", 0),
                               "pieces": {k: 1e3 * v for k, v in self.current.items()},
                               "calls": dict(self.calls)})
            return outputs

        self.patches.append((engine, "step", "step" in vars(engine), vars(engine).get("step")))
        engine.step = recorded_step

    def uninstall(self) -> None:
        for owner, attr, own, value in reversed(self.patches):
            if own:
                setattr(owner, attr, value)
            else:
                delattr(owner, attr)
        self.patches.clear()


def summarize(steps: list[dict]) -> dict:
    """Mean ms a step of each piece, the rest, the total; calls a step; tokens a step."""
    pieces = {name: float(np.mean([s["pieces"].get(name, 0.0) for s in steps]))
              for name in PIECES}
    total = float(np.mean([s["ms"] for s in steps]))
    return {"steps": len(steps), "ms_per_step": total,
            "tokens_per_step": float(np.mean([s["tokens"] for s in steps])),
            "pieces": pieces, "rest": total - sum(pieces.values()),
            "calls_per_step": {name: float(np.mean([s["calls"].get(name, 0) for s in steps]))
                               for name in PIECES}}


def recording_generate(llm: Any, outputs: list) -> Callable[[], None]:
    """Keep every generated token sequence (instance attribute); returns the undo."""
    original = llm.generate

    def generate(*args, **kwargs):
        results = original(*args, **kwargs)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
        return results

    llm.generate = generate
    return lambda: delattr(llm, "generate")


def fixed_drafts(llm, runner, drafter, timers, prompt, sizes, repeats, new_tokens) -> list:
    rows = []
    for size in sizes:
        runs: dict[str, list] = defaultdict(list)
        outputs: dict[str, list] = defaultdict(list)
        for _ in range(repeats):
            for variant in ("linear-bare", "linear", "tree"):
                kept: list = []
                undo = recording_generate(llm, kept)
                if variant != "linear-bare":
                    timers.install(llm, runner, drafter)
                measured = measure(llm, drafter, prompt, size, variant.split("-")[0],
                                   new_tokens)
                timers.uninstall()
                undo()
                outputs[variant].append(kept[-1])
                steps = timers.steps[-measured["decode_steps"]:] if variant != "linear-bare" \
                    else []
                runs[variant].append((measured["ms_per_step"], steps))
        reference = outputs["linear-bare"][0]
        for variant, measured in runs.items():
            row = {} if variant == "linear-bare" else {
                **summarize([s for _, steps in measured for s in steps]),
                "runs": [{k: v for k, v in summarize(steps).items() if k != "calls_per_step"}
                         for _, steps in measured]}
            rows.append({**row, "part": "fixed", "shape": variant, "draft_tokens": size,
                         "prompt_tokens": len(prompt),
                         "engine_ms_per_step_runs": [ms for ms, _ in measured],
                         "engine_ms_per_step": float(np.mean([ms for ms, _ in measured])),
                         "outputs_equal_linear_bare": all(o == reference
                                                          for o in outputs[variant])})
            print({k: v for k, v in rows[-1].items() if k not in ("calls_per_step", "runs")},
                  flush=True)
    return rows


def served(llm, runner, drafter, timers, prompts, new_tokens) -> list:
    """The real proposer, trees off then on (toggled in this process: ``_trees.on`` and
    the recycled top-k, as ``TreeSwitch.turn_off`` leaves them), one prompt at a time,
    each on a fresh corpus (finished outputs join it), after a warm-up on the first."""
    from vllm import SamplingParams

    from vllm_lookahead.lookahead.sources.corpus import ResponseCorpus

    for attr in ("propose", "draft_tree"):  # measure's fixed drafts: the proposer's own again
        vars(drafter).pop(attr, None)
    recycled = drafter._sources.recycled
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    rows = []
    for shape in ("linear", "tree"):
        drafter._trees.on = shape == "tree"
        drafter._sources.recycled = recycled if shape == "tree" else None
        steps, outputs = [], []
        for index, prompt in enumerate(prompts):
            drafter._sources.corpus = ResponseCorpus(drafter.options.corpus_tokens)
            if index:
                timers.install(llm, runner, drafter)
            done = len(timers.steps)
            result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            timers.uninstall()
            if index:
                steps += timers.steps[done + 1:]  # the first step is the prefill
                outputs.append(list(result[0].outputs[0].token_ids))
        rows.append({**summarize(steps), "part": "served", "shape": shape,
                     "prompts": len(prompts) - 1, "new_tokens": sum(map(len, outputs)),
                     "tokens_per_decode_step": sum(len(o) - 1 for o in outputs) / len(steps),
                     "outputs": outputs})
        print({k: v for k, v in rows[-1].items() if k not in ("calls_per_step", "outputs")},
              flush=True)
    rows[-1]["outputs_equal_linear"] = rows[-1]["outputs"] == rows[0]["outputs"]
    return rows


def timer_cost_us(calls: int = 200_000) -> float:
    """What one timed call adds (microseconds): a wrapped no-op against the bare one."""
    timers, owner = StepTimers(), argparse.Namespace(f=lambda: None)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            owner.f()
        return time.perf_counter() - start

    bare = min(loop() for _ in range(5))
    timers.wrap(owner, "f", "no-op")
    return 1e6 * (min(loop() for _ in range(5)) - bare) / calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", default="16,8")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--served-tokens", type=int, default=128)
    parser.add_argument("--served-prompts", type=int, default=4,
                        help="HumanEval prompts timed with the real proposer (0: none)")
    add_arguments(parser, "<machine>-<model>-tree-step-breakdown")
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.tree_breakdown", argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner lives in this process
    from vllm import LLM

    from benchmarks.datasets import ChatPrompter, load

    path = str(fetch(args.model))
    llm = LLM(path, speculative_config={"method": "lookahead", "trees": "on",
                                        "tree_candidates": 4, "tree_window": 4,
                                        "cost_aware_drafts": False},
              enforce_eager=True, dtype=args.dtype, max_model_len=4096,
              kv_cache_memory_bytes=1 << 30, seed=0)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafter, timers = runner.drafter, StepTimers()
    prompt = np.random.default_rng(1).integers(3, 30000, args.prompt_tokens).tolist()
    rows = fixed_drafts(llm, runner, drafter, timers, prompt,
                        [int(size) for size in args.draft_tokens.split(",")],
                        args.repeats, args.new_tokens)
    if args.served_prompts:
        chat = ChatPrompter(path)
        rows += served(llm, runner, drafter, timers,
                       [chat.prompt(sample, []) for sample in
                        load("humaneval", args.served_prompts + 1)], args.served_tokens)
    write(rows, args, timer_cost_us())


if __name__ == "__main__":
    main()
