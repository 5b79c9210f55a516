"""Replay recorded greedy generations through draft proposers, without the model.

Under greedy verification a step accepts the longest draft prefix that equals the
target's own continuation, plus one token. Given a request's prompt and its plain
greedy output, the compression S of any proposer is therefore determined exactly,
with no forward pass, except for what a proposer learns from the target's
predictions at rejected positions (lookahead's Jacobi harvest is absent here, so
replayed lookahead S is a lower bound). This makes proposer variants cheap to
compare; end-to-end speed still comes from benchmarks.run.

With ``--step-cost FIXED_MS,TOKEN_MS`` every decode pass takes a simulated
FIXED + TOKEN x (scheduled tokens) milliseconds: lookahead's cost-aware cut times the
passes on that clock (deterministically, unlike a real machine), and the table adds
the simulated decode tokens/s. Several ``--step-cost`` give one table each.

``--oracle-cut`` adds a column per method whose drafts are cut to exactly the tokens
verification will accept (known here, never in an engine): the same S with no draft
token wasted, the ceiling of what any acceptance estimate and cut can make of that
method's drafts.

The method ``copy-oracle`` (replay only) is the ceiling of drafts copied after the
longest match of the context's suffix: each step it finds the longest suffix of the
context (up to 16 tokens, the last token at least) that the request's prompt and output
so far, or the outputs of the requests replayed before it, repeat, reads the output
ahead and, of that suffix's occurrences, copies the continuation that verification
will accept furthest (with ``"min_match": N``, only after a match of at least N
tokens). A drafter that copies one continuation of the longest match (ngram, suffix,
lookahead's context and corpus matches) chooses among the same occurrences without
knowing the output; drafts chained from several spans, such as lookahead's pool and its
Jacobi predictions, are outside it.

    python -m benchmarks.replay record --model smollm2-135m --num-prompts 20 -o trace.json
    python -m benchmarks.replay run trace.json --methods ngram,suffix,lookahead \
        --method-config lookahead-n5='{"method": "lookahead", "ngram_size": 5}'
    python -m benchmarks.replay run trace.json --step-cost 30,1.1 --step-cost 30,7.5

`run` prints the table; with ``--name`` it also writes it, with the command and commit, to
the run folder benchmarks/results/<date>-<name>/ (results.md, command.txt).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.methods import DEFAULT_METHODS, Method, with_overrides
from benchmarks.run_folder import add_arguments, command_line, make_run_folder

MAX_MODEL_LEN = 8192
#: Vocabulary size given to lookahead's recycled top-k table: larger than any traced
#: tokenizer's (a replay has no target predictions, so the table stays empty).
REPLAY_VOCAB_SIZE = 1 << 18
#: Longest context suffix the copy oracle matches (lookahead's ``suffix_match_max``).
COPY_ORACLE_MAX_MATCH = 16


@dataclass
class Request:
    dataset: str
    category: str
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class StepCost:
    """A simulated decode pass: ``fixed`` + ``per_token`` x scheduled tokens, seconds."""

    fixed: float
    per_token: float

    @classmethod
    def parse(cls, text: str) -> "StepCost":
        """``FIXED_MS,TOKEN_MS``, e.g. ``30,1.1``."""
        try:
            fixed_ms, token_ms = (float(item) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--step-cost expects FIXED_MS,TOKEN_MS (e.g. 30,1.1), got {text!r}") from None
        if fixed_ms < 0 or token_ms <= 0:
            raise argparse.ArgumentTypeError(
                f"--step-cost: FIXED_MS must be >= 0 and TOKEN_MS > 0, got {text!r}")
        return cls(fixed_ms / 1e3, token_ms / 1e3)

    def __call__(self, num_tokens: int) -> float:
        return self.fixed + self.per_token * num_tokens

    @property
    def label(self) -> str:
        return (f"{self.fixed * 1e3:g} ms + {self.per_token * 1e3:g} ms/token "
                f"({self.fixed / self.per_token:.0f} free tokens)")


class SimulatedClock:
    """The time a replayed proposer reads, moved by the replay loop."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(model: str, datasets: list[str], num_prompts: int, max_tokens: int,
           categories: list[str] | None = None) -> list[dict]:
    """Plain greedy generations of the benchmark prompts (all turns), in request order;
    with ``categories``, only the samples of those categories."""
    from vllm import LLM, SamplingParams

    from benchmarks import datasets as prompt_sets
    from benchmarks.models import fetch

    path = str(fetch(model))
    llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=2 << 30, seed=0)
    prompter = prompt_sets.ChatPrompter(path)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    trace = []
    for dataset in datasets:
        samples = prompt_sets.load(dataset, num_prompts)
        if categories:
            samples = [s for s in samples if s.category in categories]
        answers: list[list[list[int]]] = [[] for _ in samples]
        while True:  # one turn of every conversation per batch
            pending = [(i, prompter.prompt(s, answers[i])) for i, s in enumerate(samples)]
            pending = [(i, p) for i, p in pending if p is not None]
            if not pending:
                break
            outputs = llm.generate([{"prompt_token_ids": p} for _, p in pending], params,
                                   use_tqdm=False)
            for (i, prompt), output in zip(pending, outputs):
                tokens = list(output.outputs[0].token_ids)
                answers[i].append(tokens)
                trace.append({"dataset": dataset, "category": samples[i].category,
                              "prompt": prompt, "output": tokens})
    llm.llm_engine.engine_core.shutdown()
    return trace


class Replayer:
    """One proposer, driven request by request (batch size 1) as the engine would."""

    def __init__(self, spec: dict):
        self.k = spec["num_speculative_tokens"]
        self.tokens = np.zeros((1, MAX_MODEL_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(1, dtype=np.int32)

    def start(self, request_id: str, prompt: list[int]) -> None:
        self.num_tokens[0] = len(prompt)
        self.tokens[0, : len(prompt)] = prompt

    def append(self, tokens: list[int]) -> None:
        n = int(self.num_tokens[0])
        self.tokens[0, n : n + len(tokens)] = tokens
        self.num_tokens[0] = n + len(tokens)

    def see_output(self, output: list[int]) -> None:
        """The request's whole output, given before it starts: only oracles look."""

    def propose(self, request_id: str, sampled: list[int]) -> list[int]:
        raise NotImplementedError

    def use_clock(self, clock: SimulatedClock) -> None:
        """Time passes on ``clock`` (a proposer without a cost model ignores it)."""

    def before_pass(self, num_tokens: int) -> None:
        """A decode pass of ``num_tokens`` scheduled tokens starts (simulated clock)."""

    def finish(self, request_id: str) -> None:
        pass


class LookaheadReplayer(Replayer):
    def __init__(self, spec: dict):
        from vllm_lookahead.lookahead.options import DEFAULT_SPEC_TOKENS
        from vllm_lookahead.lookahead.proposer import LookaheadProposer
        from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY

        spec = {"num_speculative_tokens": DEFAULT_SPEC_TOKENS, **spec}
        super().__init__(spec)

        options = {k: v for k, v in spec.items() if k not in ("method", "num_speculative_tokens")}
        self.runner = SimpleNamespace(
            input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(1, np.int32)),
            requests={})
        config = SimpleNamespace(
            speculative_config=SimpleNamespace(num_speculative_tokens=self.k),
            model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN,
                                         get_vocab_size=lambda: REPLAY_VOCAB_SIZE),
            scheduler_config=SimpleNamespace(max_num_seqs=1),
            additional_config={ADDITIONAL_CONFIG_KEY: options})
        self.proposer = LookaheadProposer(config)
        self.proposer.bind_model_runner(self.runner)

    def start(self, request_id, prompt):
        super().start(request_id, prompt)
        self.runner.input_batch.req_ids = [request_id]
        self.runner.input_batch.num_prompt_tokens[0] = len(prompt)
        self.runner.requests[request_id] = None

    def propose(self, request_id, sampled):
        return self.proposer.propose([sampled], self.num_tokens, self.tokens)[0]

    def use_clock(self, clock):
        self.proposer.clock = clock

    def before_pass(self, num_tokens):
        self.proposer.on_step_start(num_tokens, decode_only=True)

    def finish(self, request_id):
        del self.runner.requests[request_id]
        self.proposer.on_requests_removed({request_id}, set())


class NgramReplayer(Replayer):
    def __init__(self, spec: dict):
        super().__init__(spec)
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        config = SimpleNamespace(
            speculative_config=SimpleNamespace(
                num_speculative_tokens=self.k, prompt_lookup_min=spec["prompt_lookup_min"],
                prompt_lookup_max=spec["prompt_lookup_max"]),
            model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
            scheduler_config=SimpleNamespace(max_num_seqs=1),
            parallel_config=SimpleNamespace(tensor_parallel_size=1))
        self.proposer = NgramProposer(config)

    def propose(self, request_id, sampled):
        return self.proposer.propose(self.k, [sampled], self.num_tokens, self.tokens)[0]


class SuffixReplayer(Replayer):
    """Arctic Inference's cache, called as vLLM's SuffixDecodingProposer calls it."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.depth = spec.get("suffix_decoding_max_tree_depth", 24)
        self.spec_factor = spec.get("suffix_decoding_max_spec_factor", 1.0)
        self.min_prob = spec.get("suffix_decoding_min_token_prob", 0.1)
        self.cache = SuffixDecodingCache(
            max_tree_depth=self.depth,
            max_cached_requests=spec.get("suffix_decoding_max_cached_requests", 10000))

    def start(self, request_id, prompt):
        super().start(request_id, prompt)
        self.cache.start_request(request_id, np.asarray(prompt, dtype=np.int32))

    def propose(self, request_id, sampled):
        self.cache.add_active_response(request_id, sampled)
        n = int(self.num_tokens[0])
        pattern = self.tokens[0, max(0, n - self.depth) : n]
        draft = self.cache.speculate(request_id, pattern, max_spec_tokens=self.k,
                                     max_spec_factor=self.spec_factor,
                                     min_token_prob=self.min_prob)
        return list(draft.token_ids)

    def finish(self, request_id):
        self.cache.stop_request(request_id)


class CopyOracleReplayer(Replayer):
    """``copy-oracle``: the best copy of an earlier span, chosen knowing the output
    (the module's docstring)."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        #: shortest match it copies after ("min_match"; 1: the last token alone)
        self.min_match = spec.get("min_match", 1)
        self.future = np.zeros(0, dtype=np.int32)
        self.output_start = 0
        #: the outputs of the requests replayed before, each followed by a separator
        self.earlier_outputs = np.zeros(0, dtype=np.int32)

    def start(self, request_id, prompt):
        super().start(request_id, prompt)
        self.output_start = len(prompt)

    def see_output(self, output):
        self.future = np.asarray(output, dtype=np.int32)

    def propose(self, request_id, sampled):
        n = int(self.num_tokens[0])
        truth = self.future[n - self.output_start : n - self.output_start + self.k]
        suffix = self.tokens[0, max(0, n - COPY_ORACLE_MAX_MATCH) : n]
        copies = [(best_copy(text, size, suffix, truth), text) for text, size in (
            (self.tokens[0], n), (self.earlier_outputs, len(self.earlier_outputs)))]
        (match, start, length), text = max(copies, key=lambda copy: (copy[0][0], copy[0][2]))
        return text[start : start + length].tolist() if match >= self.min_match else []

    def finish(self, request_id):
        output = self.tokens[0, self.output_start : int(self.num_tokens[0])]
        self.earlier_outputs = np.concatenate([self.earlier_outputs, output, [-1]]).astype(np.int32)


def best_copy(text: np.ndarray, size: int, suffix: np.ndarray, truth: np.ndarray
              ) -> tuple[int, int, int]:
    """(match length, start, length) of the best copy in ``text[:size]``: among the
    occurrences of the longest suffix of ``suffix`` (its last token at least) that
    ``text[: size - 1]`` repeats, the one whose continuation ``text[start : start +
    length]`` (within ``text[:size]``) equals the longest prefix of ``truth`` (ties:
    the latest); length 0 where none equals even its first token. A negative token
    separates texts."""
    ends = np.flatnonzero(text[: max(size - 1, 0)] == suffix[-1])
    if not len(ends):
        return 0, 0, 0
    match = _run_lengths(text, ends[:, None] - np.arange(1, len(suffix)), suffix[-2::-1], size) + 1
    ends = ends[match == match.max()]
    agree = _run_lengths(text, ends[:, None] + 1 + np.arange(len(truth)), truth, size)
    best = len(agree) - 1 - int(np.argmax(agree[::-1]))  # the latest of the longest
    return int(match.max()), int(ends[best]) + 1, int(agree[best])


def _run_lengths(text: np.ndarray, positions: np.ndarray, wanted: np.ndarray,
                 size: int) -> np.ndarray:
    """Per row of ``positions``: how many leading positions hold ``wanted``'s tokens (a
    position outside ``text[:size]`` ends the run)."""
    inside = (positions >= 0) & (positions < size)
    equal = inside & (text[np.clip(positions, 0, len(text) - 1)] == wanted)
    return np.cumprod(equal, axis=1).sum(axis=1)


REPLAYERS = {"lookahead": LookaheadReplayer, "ngram": NgramReplayer, "suffix": SuffixReplayer,
             "copy-oracle": CopyOracleReplayer}
#: Methods only a replay can run (they read the output ahead), for ``--methods``.
REPLAY_ONLY_METHODS = {"copy-oracle": Method("copy-oracle", {"method": "copy-oracle",
                                                             "num_speculative_tokens": 24})}


def replay(make_replayer: Callable[[], Replayer], trace: list[Request],
           step_cost: StepCost | None = None, oracle_cut: bool = False
           ) -> list[tuple[int, int, int, float]]:
    """(generated tokens, forward passes, draft tokens verified, simulated decode
    seconds) per request; the seconds are 0 without ``step_cost``. ``oracle_cut``:
    each draft is verified as far as it will be accepted, no further.

    Each dataset gets a fresh proposer, as each gets a fresh engine in benchmarks.run
    (Spec-Bench repeats MT-Bench's questions: a shared memory would see the answers).
    The prefill pass counts as one forward pass (it yields the first token), not as
    decode time.
    """
    results = []
    replayer, dataset, clock = None, None, SimulatedClock()
    for index, request in enumerate(trace):
        if request.dataset != dataset:
            replayer, dataset = make_replayer(), request.dataset
            if step_cost is not None:
                replayer.use_clock(clock)
        request_id = f"replay-{index}"
        replayer.see_output(request.output)
        replayer.start(request_id, request.prompt)
        output, done, passes, drafted = request.output, 1, 1, 0
        replayer.append(output[:1])
        sampled = output[:1]
        started = clock.now
        while done < len(output):
            draft = replayer.propose(request_id, sampled)[: replayer.k]
            if oracle_cut:
                draft = draft[: accepted_length(draft, output, done)]
            drafted += len(draft)
            if step_cost is not None:
                replayer.before_pass(1 + len(draft))
                clock.now += step_cost(1 + len(draft))
            accepted = accepted_length(draft, output, done)
            sampled = output[done : done + accepted + 1]
            replayer.append(sampled)
            done += len(sampled)
            passes += 1
        replayer.finish(request_id)
        results.append((len(output), passes, drafted, clock.now - started))
    return results


def accepted_length(draft: list[int], output: list[int], done: int) -> int:
    """How many of ``draft``'s tokens greedy verification accepts after ``done``
    tokens of ``output``."""
    accepted = 0
    while accepted < len(draft) and done + accepted < len(output) \
            and draft[accepted] == output[done + accepted]:
        accepted += 1
    return accepted


def summarize(trace: list[Request], results: list[tuple[int, int, int, float]]
              ) -> dict[str, str]:
    """'S (draft tokens per pass)' for all requests, per dataset and per category, and
    the simulated decode tokens/s where passes were timed."""
    totals: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(5))
    for request, counts in zip(trace, results):
        for key in ("all", request.dataset, f"{request.dataset}/{request.category}"):
            totals[key] += (*counts, 1)
    cells = {}
    for key, (tokens, passes, drafted, seconds, requests) in sorted(totals.items()):
        cells[key] = f"{tokens / passes:.3f} ({drafted / passes:.1f})"
        if seconds:  # each request's first token comes from its prefill pass
            cells[key] += f" {(tokens - requests) / seconds:.1f}/s"
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="smollm2-135m")
    rec.add_argument("--datasets", default="humaneval,mt_bench,spec_bench")
    rec.add_argument("--num-prompts", type=int, default=20)
    rec.add_argument("--max-tokens", type=int, default=256)
    rec.add_argument("--categories", default="",
                     help="comma list: record only the samples of these categories")
    rec.add_argument("-o", "--output", required=True)
    run = sub.add_parser("run")
    run.add_argument("trace")
    run.add_argument("--methods", default="ngram,suffix,lookahead")
    run.add_argument("--method-config", action="append", default=[],
                     help="NAME=JSON: a variant (with 'method') or overrides of NAME")
    run.add_argument("--step-cost", action="append", type=StepCost.parse, default=[],
                     metavar="FIXED_MS,TOKEN_MS",
                     help="simulated decode pass time (repeatable: one table each)")
    run.add_argument("--oracle-cut", action="store_true",
                     help="also each method with its drafts cut to what will be accepted")
    add_arguments(run, None)
    args = parser.parse_args()

    if args.command == "record":
        trace = record(args.model, args.datasets.split(","), args.num_prompts, args.max_tokens,
                       [c for c in args.categories.split(",") if c])
        Path(args.output).write_text(json.dumps(trace))
        return
    trace = [Request(**row) for row in json.loads(Path(args.trace).read_text())]
    methods = with_overrides({**DEFAULT_METHODS, **REPLAY_ONLY_METHODS}, args.method_config)
    names = args.methods.split(",") + [c.partition("=")[0] for c in args.method_config]
    specs = {name: methods[name].config for name in dict.fromkeys(names)}
    table = []
    for step_cost in args.step_cost or [None]:
        rows = {}
        for name, spec in specs.items():
            for oracle_cut in (False, True) if args.oracle_cut else (False,):
                rows[name + " (oracle cut)" * oracle_cut] = summarize(trace, replay(
                    lambda: REPLAYERS[spec["method"]](spec), trace, step_cost, oracle_cut))
        keys = list(next(iter(rows.values())))
        title = "S (draft tokens per pass)" + (
            f" decode tokens/s at {step_cost.label}" if step_cost else "")
        table += [f"| {title} | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
        table += [f"| {key} | " + " | ".join(rows[n][key] for n in rows) + " |" for key in keys]
        table.append("")
    print("\n".join(table))
    if args.name:
        from benchmarks.machine import git_state

        git = git_state()
        dirty = " (with uncommitted changes)" if git["dirty"] else ""
        command = command_line("benchmarks.replay")
        folder = make_run_folder(args.output_dir, args.name, command)
        header = [f"# Replay of {args.trace}", "",
                  f"* Command: `{command}`",
                  f"* Repository: commit {git['commit']}{dirty}",
                  "* Methods: " + "; ".join(f"**{n}** `{json.dumps(c)}`" for n, c in specs.items()),
                  "", __doc__.split("\n\n")[1].replace("\n", " "), ""]
        (folder / "results.md").write_text("\n".join(header + table))
        print(f"results: {folder}/")


if __name__ == "__main__":
    main()
