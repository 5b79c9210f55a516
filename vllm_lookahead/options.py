"""What every method's options share: declaration, validation, documentation, and the
one place that reads them back from the engine configuration.

Options travel from ``speculative_config`` (keys that vLLM's ``SpeculativeConfig``
does not know) to the workers inside ``VllmConfig.additional_config``, so they are
validated once, at startup, in the process that parses the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar

#: Key under which the options are stored in ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "vllm_lookahead"

MIN_SPEC_TOKENS = 1
MAX_SPEC_TOKENS = 128  # vLLM's rejection sampler asserts max_spec_len <= 128


def method_config(vllm_config: Any) -> dict[str, Any]:
    """Our method's name (``"method"``) and options as stored in the engine config; empty
    when the engine runs none of our methods."""
    return dict((vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY, {}))


def method_options(vllm_config: Any, options_cls: type) -> Any:
    """The running method's validated options."""
    values = method_config(vllm_config)
    values.pop("method", None)
    return options_cls.from_dict(values)


def option_field(default: Any, low: float | None, doc: str, high: float | None = None,
            choices: tuple[str, ...] = (), low_open: bool = False, auto: bool = False):
    """A validated option: ints in [``low``, ``high``] (no upper bound without ``high``;
    every size is bounded, so that a large value is refused here and not in the worker
    as a MemoryError or an overflow; or the string ``"auto"`` if ``auto``); floats in
    [``low``, ``high``] (default [0, 1], ``low`` excluded if ``low_open``); strings among
    ``choices``."""
    return field(default=default, metadata={"low": low, "high": high, "choices": choices,
                                            "low_open": low_open, "auto": auto, "doc": doc})


class MethodOptions:
    """Shared parsing for one method's options dataclass (``METHOD`` names it in errors)."""

    METHOD = ""
    #: options of earlier releases, and why each is gone (its error says so)
    RETIRED: ClassVar[dict[str, str]] = {}

    def scheduled_tokens(self, num_speculative_tokens: int) -> int:
        """Draft tokens vLLM schedules a request for, given the user's K."""
        return num_speculative_tokens

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None):
        """Build validated options; errors name the option and what it accepts."""
        values = dict(values or {})
        for name in sorted(set(values) & set(cls.RETIRED)):
            raise ValueError(f"{cls.METHOD}: option {name!r} is gone: {cls.RETIRED[name]}")
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"{cls.METHOD}: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"accepted options: {', '.join(cls.names())} "
                f"(plus num_speculative_tokens)"
            )
        for f in dataclasses.fields(cls):
            if f.name in values:
                values[f.name] = check_value(f, values[f.name], f"{cls.METHOD}: {f.name}")
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"{cls.METHOD}: option {f.name!r} is required "
                                 f"({f.metadata['doc']})")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_value(f: dataclasses.Field, value: Any, label: str | None = None) -> Any:
    """The value, checked against ``f``'s type and range; errors start with ``label``
    (default ``lookahead: <option>``)."""
    label = label or f"lookahead: {f.name}"
    low = f.metadata["low"]
    if f.metadata["choices"]:
        if value not in f.metadata["choices"]:
            accepted = " or ".join(map(repr, f.metadata["choices"]))
            raise ValueError(f"{label} must be {accepted} (got {value!r})")
        return value
    if f.metadata["auto"] and value == "auto":
        return value
    if f.type in ("str", str):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty string (got {value!r})")
        return value
    if isinstance(f.default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be true or false (got {value!r})")
        return value
    if isinstance(f.default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            _float_low_ok(f, value) and value <= _float_range(f)[1]
        ):
            raise ValueError(f"{label} must be a number in {_float_range_text(f)} "
                             f"(got {value!r})")
        return float(value)
    high = f.metadata["high"]
    accepted = (f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
                ) + ' or "auto"' * f.metadata["auto"]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label} must be {accepted} (got {value!r})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{label} must be {accepted} (got {value})")
    return value


def _float_range(f: dataclasses.Field) -> tuple[float, float]:
    low, high = f.metadata["low"], f.metadata["high"]
    return (0.0 if low is None else low, 1.0 if high is None else high)


def _float_low_ok(f: dataclasses.Field, value: float) -> bool:
    low = _float_range(f)[0]
    return value > low if f.metadata["low_open"] else value >= low


def _float_range_text(f: dataclasses.Field) -> str:
    low, high = _float_range(f)
    return f"{'(' if f.metadata['low_open'] else '['}{low:g}, {high:g}]"


def accepted_text(f: dataclasses.Field) -> str:
    """What ``check_value`` accepts for ``f``, for documentation tables."""
    if f.metadata["choices"]:
        return " / ".join(f"`{c}`" for c in f.metadata["choices"])
    if f.type in ("str", str):
        return "path or model name"
    if isinstance(f.default, bool):
        return "true / false"
    if isinstance(f.default, float):
        return f"number in {_float_range_text(f)}"
    low, high = f.metadata["low"], f.metadata["high"]
    accepted = f"integer >= {low}" if high is None else f"integer in [{low}, {high}]"
    return accepted + " or `auto`" * f.metadata["auto"]


def check_num_speculative_tokens(value: Any, method: str = "lookahead") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
        MIN_SPEC_TOKENS <= value <= MAX_SPEC_TOKENS
    ):
        raise ValueError(
            f"{method}: num_speculative_tokens must be an integer in "
            f"[{MIN_SPEC_TOKENS}, {MAX_SPEC_TOKENS}] (got {value!r})"
        )
    return value


def options_table(options_cls: type, default_k: int, k_meaning: str) -> str:
    """Markdown table of a method's options, for its docs page (kept in sync by a test)."""
    rows = ["| option | default | accepted | meaning |", "|---|---|---|---|"]
    rows.append(
        f"| `num_speculative_tokens` (K) | {default_k} | integer in "
        f"[{MIN_SPEC_TOKENS}, {MAX_SPEC_TOKENS}] | {k_meaning} |"
    )
    rows.extend(option_rows(options_cls))
    return "\n".join(rows)


def option_rows(options_cls: type) -> list[str]:
    """One Markdown table row per option of ``options_cls``."""
    rows = []
    for f in dataclasses.fields(options_cls):
        if f.default is dataclasses.MISSING:
            default = "required"
        else:
            default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        rows.append(f"| `{f.name}` | {default} | {accepted_text(f)} | {f.metadata['doc']} |")
    return rows
