"""The methods compared: name -> vLLM `speculative_config` (None: no speculation).

Defaults, chosen to compare like with like:
* ngram: K=6 draft tokens and a 2..4-token suffix match (vLLM's own defaults,
  min=max=5 when neither is given, are marked "arbitrarily chosen" in
  vllm/config/speculative.py; its docs' example uses K=5, max 4). ngram drafts K
  tokens whenever it matches, so a larger K only adds rejected tokens.
* suffix: vLLM's defaults (tree depth 24, spec factor 1.0, min token prob 0.1);
  suffix decoding sizes each draft itself, K=24 (vLLM's default, = tree depth) is only a cap.
* draft_model: Qwen2.5-Coder-0.5B drafting K=4 for Qwen2.5-Coder-1.5B (same tokenizer).
* lookahead: the plugin's defaults (K=24 as a cap on its adaptive draft length).

`--method-config NAME=JSON` merges JSON over NAME's default, or defines a new
variant NAME whose JSON names its "method" (merged over that method's default). A
variant of "none" is `{"method": "none"}` alone: it differs by its engine arguments
(`--method-engine-args`, e.g. vLLM's `async_scheduling`).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace

from benchmarks.models import fetch


@dataclass(frozen=True)
class Method:
    name: str
    config: dict | None = None
    #: benchmarks.models name of a draft model, filled in as config["model"] unless set.
    draft: str | None = None
    #: the only target model the default draft is meant for.
    target: str | None = None
    needs_module: str | None = None  # a Python package the method imports in the worker
    install_hint: str = ""


DEFAULT_METHODS: dict[str, Method] = {
    m.name: m for m in (
        Method("none"),
        Method("ngram", {"method": "ngram", "num_speculative_tokens": 6,
                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
        Method("suffix", {"method": "suffix", "num_speculative_tokens": 24},
               needs_module="arctic_inference",
               install_hint="pip install arctic-inference==0.1.1"),
        Method("draft_model", {"method": "draft_model", "num_speculative_tokens": 4},
               draft="qwen2.5-coder-0.5b", target="qwen2.5-coder-1.5b"),
        Method("lookahead", {"method": "lookahead"}),
    )
}


def with_overrides(methods: dict[str, Method], overrides: list[str]) -> dict[str, Method]:
    """Apply `NAME=JSON` overrides; raises ValueError with the offending text.

    A new variant starts from its method's entry in `methods` as given, so the result
    does not depend on the order of the overrides.
    """
    defaults, methods = methods, dict(methods)
    for text in overrides:
        name, sep, body = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"--method-config expects NAME=JSON, got {text!r}")
        try:
            values = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"--method-config {name}: invalid JSON {body!r}: {exc}") from exc
        if not isinstance(values, dict):
            raise ValueError(  # noqa: TRY004 - bad user input, reported like the others
                f"--method-config {name}: expected a JSON object, got {body!r}")
        base = methods.get(name) or defaults.get(values.get("method", ""))
        if base is None and "method" not in values:
            raise ValueError(
                f"--method-config {name}: a new variant must name its \"method\"; "
                f"known methods: {', '.join(defaults)}")
        if base is not None and base.config is None:
            if values != {"method": base.name}:
                raise ValueError(
                    f"--method-config {name}: {base.name!r} runs without speculation and "
                    f"has no options; a variant of it is {{\"method\": \"{base.name}\"}} "
                    "alone, with --method-engine-args for its engine")
            methods[name] = replace(base, name=name)
            continue
        base = base or Method(name)
        methods[name] = replace(base, name=name, config={**(base.config or {}), **values})
    return methods


def unavailable_reason(method: Method, model_name: str) -> str | None:
    """Why `method` cannot run with `model_name` here, or None if it can."""
    if method.needs_module and importlib.util.find_spec(method.needs_module) is None:
        return (f"{method.name} needs the Python package {method.needs_module!r}, "
                f"not installed; {method.install_hint}")
    uses_default_draft = method.draft and "model" not in (method.config or {})
    if uses_default_draft and method.target and model_name != method.target:
        return (f"{method.name} drafts with {method.draft}, which is paired with the target "
                f"{method.target} only (this run's target: {model_name}); set the draft with "
                f"--method-config {method.name}='{{\"model\": \"/path/to/draft\"}}' to override")
    return None


def speculative_config(method: Method) -> dict | None:
    """The config to hand to vLLM, with the default draft model's path filled in."""
    if method.config is None:
        return None
    config = dict(method.config)
    if method.draft and "model" not in config:
        config["model"] = str(fetch(method.draft))
    return config
