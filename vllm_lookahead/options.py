"""The lookahead method's options: defaults, documentation and validation.

Options travel from ``speculative_config`` (keys that vLLM's ``SpeculativeConfig``
does not know) to the workers inside ``VllmConfig.additional_config``, so they are
validated once, at startup, in the process that parses the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: Key under which the options are stored in ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "vllm_lookahead"

MIN_SPEC_TOKENS = 1
MAX_SPEC_TOKENS = 128  # vLLM's rejection sampler asserts max_spec_len <= 128
DEFAULT_SPEC_TOKENS = 6


def _option(default: Any, low: int | None, doc: str):
    return field(default=default, metadata={"low": low, "doc": doc})


@dataclass(frozen=True)
class LookaheadOptions:
    """Options of ``{"method": "lookahead"}``; every field is a ``speculative_config`` key."""

    ngram_size: int = _option(
        4, 2, "N: n-gram length in the pool (a key token plus N-1 continuation tokens)."
    )
    window_size: int = _option(
        8, 1,
        "W: Jacobi columns harvested per verification pass (the target's predictions "
        "at the draft positions, also after the first rejection).",
    )
    guess_set_size: int = _option(
        8, 0,
        "G: most recent pool entries ranked per key when a draft comes from the pool; "
        "0 drafts from prompt/output suffix matches only.",
    )
    pool_from_prompt: bool = _option(True, None, "Seed the pool with the prompt's n-grams.")
    pool_max_per_key: int = _option(
        8, 1, "Pool bound: entries kept per key token (least recently used evicted)."
    )
    pool_max_keys: int = _option(
        65536, 1, "Pool bound: key tokens kept per request (least recently used evicted)."
    )
    suffix_match_min: int = _option(
        2, 1, "Shortest context suffix that a prompt/output match must repeat."
    )
    suffix_match_max: int = _option(
        4, 1, "Longest context suffix tried for a prompt/output match."
    )
    corpus_tokens: int = _option(
        262144, 0,
        "Cross-request memory: tokens of finished responses kept (per worker, oldest "
        "dropped) and searched for repeats of the context's suffix; 0 turns it off.",
    )
    harvest_jacobi: bool = _option(
        True, None, "Feed the pool with the target's predictions captured at verification."
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "LookaheadOptions":
        """Build validated options; errors name the option and what it accepts."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"lookahead: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"accepted options: {', '.join(cls.names())} "
                f"(plus num_speculative_tokens)"
            )
        for f in dataclasses.fields(cls):
            if f.name in values:
                values[f.name] = _check_value(f, values[f.name])
        options = cls(**values)
        if options.suffix_match_min > options.suffix_match_max:
            raise ValueError(
                "lookahead: suffix_match_min must be <= suffix_match_max "
                f"(got {options.suffix_match_min} > {options.suffix_match_max})"
            )
        return options

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_value(f: dataclasses.Field, value: Any) -> Any:
    low = f.metadata["low"]
    if isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"lookahead: {f.name} must be true or false (got {value!r})")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"lookahead: {f.name} must be an integer >= {low} (got {value!r})")
    if value < low:
        raise ValueError(f"lookahead: {f.name} must be an integer >= {low} (got {value})")
    return value


def check_num_speculative_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
        MIN_SPEC_TOKENS <= value <= MAX_SPEC_TOKENS
    ):
        raise ValueError(
            "lookahead: num_speculative_tokens must be an integer in "
            f"[{MIN_SPEC_TOKENS}, {MAX_SPEC_TOKENS}] (got {value!r})"
        )
    return value


def options_table() -> str:
    """Markdown table of the options, for the README (kept in sync by a test)."""
    rows = ["| option | default | accepted | meaning |", "|---|---|---|---|"]
    rows.append(
        f"| `num_speculative_tokens` (K) | {DEFAULT_SPEC_TOKENS} | integer in "
        f"[{MIN_SPEC_TOKENS}, {MAX_SPEC_TOKENS}] | Draft tokens verified per step. |"
    )
    for f in dataclasses.fields(LookaheadOptions):
        if isinstance(f.default, bool):
            accepted = "true / false"
        else:
            accepted = f"integer >= {f.metadata['low']}"
        default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        rows.append(f"| `{f.name}` | {default} | {accepted} | {f.metadata['doc']} |")
    return "\n".join(rows)
