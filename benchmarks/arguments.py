"""The harness's command-line value types: comma lists, per-dataset prompt counts, seeds,
positive integers; each refusal names what was expected."""

from __future__ import annotations

import argparse

from benchmarks.datasets import DATASETS


def comma_list(choices: tuple[str, ...] | None = None):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if choices and item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
        return items
    return parse


def prompt_counts(text: str) -> dict[str, int]:
    """`20`, or `20,spec_bench=10`: conversations per dataset ("*" for the others)."""
    counts = {}
    for item in comma_list()(text):
        name, sep, value = item.rpartition("=")
        key = name.strip() if sep else "*"
        if key != "*" and key not in DATASETS:
            raise argparse.ArgumentTypeError(f"unknown dataset {key!r} in {text!r}")
        if not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected a positive count in {item!r}")
        counts[key] = int(value)
    return counts


def _integers(text: str, example: str) -> list[int]:
    """A comma list of integers; an empty item (``1,,2``) is refused."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected integers like {example}: {text!r}") from exc


def positive_ints(text: str) -> list[int]:
    """A comma list of positive integers."""
    values = _integers(text, "1,4,16")
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def seed_list(text: str) -> list[int]:
    """Distinct non-negative integers."""
    values = _integers(text, "0,1,2")
    if min(values) < 0 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative integers: {text!r}")
    return values
