"""Prompt sets (vendored in benchmarks/data/, see its README) as chat conversations.

A sample is a conversation: one or more user turns. Every turn after the first is
asked after the model's own answer to the previous one (MT-Bench's protocol), so
the prompts of later turns depend on what the method under test generated.
Selection is deterministic: the first N samples, taken round-robin across the
sub-categories where a set is ordered by category, so that every category counts.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

#: Instruct-style HumanEval: chat models answer a request, they do not continue code.
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. "
    "Return the whole function in a ```python code block.\n\n```python\n{prompt}```"
)
#: Copy-heavy code edits, as users ask coding assistants for them: a whole function and
#: a small change to make, answered with the whole function again, so most of the
#: answer repeats the prompt. Built from HumanEval's reference solutions, from the last
#: task backwards (the humaneval set takes the first ones); (category, instruction).
CODE_EDIT_INSTRUCTIONS = (
    ("rename", "Rename the function's parameters to longer, more descriptive names."),
    ("type_hints", "Add type hints to every local variable you can."),
    ("comments", "Add a short comment above each statement of the body."),
    ("logging", "Log the arguments with the logging module when the function is called."),
)
CODE_EDIT_PROMPT = (
    "Here is a Python function:\n\n```python\n{code}```\n\n{instruction} Keep everything "
    "else unchanged, and return the whole modified function in a ```python code block."
)
#: Spec-Bench labels its MT-Bench part with MT-Bench's eight categories.
MT_BENCH_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
)
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
DATASETS = ("humaneval", "mt_bench", "spec_bench", "code_edit")


@dataclass(frozen=True)
class Sample:
    id: str
    dataset: str
    category: str
    turns: tuple[str, ...]


#: Warms each engine up; outside every measured set, because suffix decoding caches
#: past outputs across requests and would otherwise be handed a measured answer.
WARMUP = Sample("warm-up", "warm-up", "warm-up", ("Write a short poem about the sea.",))
WARMUP_TOKENS = 16


def load(dataset: str, count: int) -> list[Sample]:
    """`count` samples of `dataset`; for spec_bench, `count` per category."""
    loaders = {"humaneval": _humaneval, "mt_bench": _mt_bench, "spec_bench": _spec_bench,
               "code_edit": _code_edit}
    if dataset not in loaders:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    return loaders[dataset](count)


def _humaneval(count: int) -> list[Sample]:
    with gzip.open(DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in itertools.islice(f, count)]
    return [Sample(row["task_id"], "humaneval", "humaneval",
                   (HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]),)) for row in rows]


def _code_edit(count: int) -> list[Sample]:
    with gzip.open(DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f][::-1][:count]
    samples = []
    for index, row in enumerate(rows):
        category, instruction = CODE_EDIT_INSTRUCTIONS[index % len(CODE_EDIT_INSTRUCTIONS)]
        code = row["prompt"] + row["canonical_solution"]
        samples.append(Sample(f"code_edit/{row['task_id']}", "code_edit", category, (
            CODE_EDIT_PROMPT.format(code=code, instruction=instruction),)))
    return samples


def _mt_bench(count: int) -> list[Sample]:
    rows = _read_jsonl("mt_bench_question.jsonl")
    return [Sample(f"mt_bench/{row['question_id']}", "mt_bench", row["category"],
                   tuple(row["turns"])) for row in round_robin(rows, "category")[:count]]


def _spec_bench(count: int) -> list[Sample]:
    by_category: dict[str, list[dict]] = {c: [] for c in SPEC_BENCH_CATEGORIES}
    for row in _read_jsonl("spec_bench_question.jsonl"):
        category = "mt_bench" if row["category"] in MT_BENCH_CATEGORIES else row["category"]
        by_category[category].append(row)
    by_category["mt_bench"] = round_robin(by_category["mt_bench"], "category")
    return [Sample(f"spec_bench/{row['question_id']}", "spec_bench", category, tuple(row["turns"]))
            for category, rows in by_category.items() for row in rows[:count]]


def round_robin(rows: list[dict], key: str) -> list[dict]:
    """Rows reordered as first of each group, then second of each, ... (groups in first-seen order)."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    columns = itertools.zip_longest(*groups.values())
    return [row for column in columns for row in column if row is not None]


def _read_jsonl(name: str) -> list[dict]:
    with open(DATA_DIR / name) as f:
        return [json.loads(line) for line in f]


class ChatPrompter:
    """Token-id prompts in the model's chat template, turn by turn.

    Earlier answers enter the conversation as their decoded text, as a chat client
    would send them back.
    """

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def prompt(self, sample: Sample, answers: list[list[int]]) -> list[int] | None:
        """Prompt of the turn after `answers`, or None when the conversation is over."""
        turn = len(answers)
        if turn >= len(sample.turns):
            return None
        messages = []
        for question, answer in zip(sample.turns, answers):
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": self.decode(answer)})
        messages.append({"role": "user", "content": sample.turns[turn]})
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(encoded["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class Conversations:
    """`next_prompt` for the request loops, first turns tokenized up front (outside timing)."""

    def __init__(self, samples: list[Sample], prompter: ChatPrompter):
        self.samples = samples
        self.prompter = prompter
        self._first_turns = [prompter.prompt(sample, []) for sample in samples]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_requests(self) -> int:
        return sum(len(sample.turns) for sample in self.samples)

    def next_prompt(self, conversation: int, answers: list[list[int]]) -> list[int] | None:
        if not answers:
            return self._first_turns[conversation]
        return self.prompter.prompt(self.samples[conversation], answers)
