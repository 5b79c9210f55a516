"""The configuration layer: our method names and options mapped onto vLLM's
``custom_class`` proposer, on every path a user can take (Python, CLI, legacy keywords,
per-request options).

vLLM has no registry for speculative methods, but it has a generic hook, the
``custom_class`` proposer. Our options travel in ``VllmConfig.additional_config``.
The worker-side touch points are in ``worker/``.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``EngineArgs.create_speculative_config`` | wrapped | rewrites our methods to ``custom_class`` + options; refuses targets with a recurrent state (``ModelConfig.is_hybrid``, ``.has_inner_state``, ``.is_attention_free``: read); runs the method's start-up check (MTAD: the auxiliary model's vocabulary against the target's) | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``EngineArgs.add_cli_args`` | wrapped | ``--speculative-config lookahead`` (bare word), ``--spec-method lookahead``, validation as argparse errors | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``EngineArgs.__init__``, ``AsyncEngineArgs.__init__`` | wrapped | legacy ``speculative_model=`` / ``num_speculative_tokens=`` keywords | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.v1.engine.input_processor.InputProcessor._validate_params`` | wrapped | checks per-request overrides (``extra_args``) at admission: a bad value is the client's error (HTTP 400), never the engine's | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
| ``vllm.SamplingParams._validate_spec_decode`` | wrapped (our methods only) | admits ``logit_bias`` and ``min_p``, which vLLM refuses under speculation: such requests are served without drafts (``worker/request_support.py``); every other check of vLLM's runs as before. Refuses ``logprob_token_ids``, which vLLM's verifier loses or fails the batch on | 0.32.0, 0.26.0 (CPU); 0.33.0 read |
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_lookahead import _patching, model_runner_v2
from vllm_lookahead.log import get_logger
from vllm_lookahead.lookahead.options import REQUEST_KEY_PREFIX, LookaheadOptions, request_overrides
from vllm_lookahead.proposer import METHODS, Method, method_by_model_alias
from vllm_lookahead.options import (
    ADDITIONAL_CONFIG_KEY,
    MAX_SPEC_TOKENS,
    check_num_speculative_tokens,
    method_config,
)
from vllm_lookahead.vllm_support import SUPPORTED_VLLM, missing_features, vllm_version
from vllm_lookahead.worker.request_support import (
    undrafted_parameter,
    without_undrafted_parameters,
)

logger = get_logger(__name__)

#: ``SpeculativeConfig`` fields that mean something for our methods.
SPEC_FIELDS_ACCEPTED = ("method", "model", "num_speculative_tokens")


def install() -> None:
    """Patch vLLM's configuration layer (idempotent)."""
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    _patch_create_speculative_config(EngineArgs)
    _patch_cli(EngineArgs)
    for cls in (EngineArgs, AsyncEngineArgs):
        _patch_legacy_kwargs(cls)
    _patch_request_validation()
    _patch_speculative_admission()


def selected_method(spec: dict[str, Any]) -> Method | None:
    """Our method that ``spec`` asks for (its name in any case), or None if it asks for
    a vLLM method."""
    name, model = spec.get("method"), spec.get("model")
    method = METHODS.get(name.lower() if isinstance(name, str) else name)
    if method is not None:
        if not method.takes_model and model is not None and model not in method.model_aliases:
            raise ValueError(
                f"speculative_config: method {name!r} has no draft model; "
                f"leave 'model' unset (got model={model!r})"
            )
        return method
    return method_by_model_alias(model) if name is None else None


def rewrite_speculative_config(
    spec: dict[str, Any], additional_config: dict[str, Any] | None,
    target_model_config: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Map a request for one of our methods onto vLLM's ``custom_class`` proposer.

    Returns the ``speculative_config`` and ``additional_config`` to hand to vLLM;
    a spec that does not select one of our methods comes back unchanged. Raises
    ``ValueError`` naming the offending option and the accepted values. With the
    target's ``ModelConfig`` (not known yet when the command line is parsed), MTAD's
    auxiliary model must also share its vocabulary.
    """
    method = selected_method(spec)
    additional_config = dict(additional_config or {})
    if method is None:
        return spec, additional_config
    # option keys as on vLLM's command line (``draft-min-prob``) mean the same
    spec = {key.replace("-", "_"): value for key, value in spec.items()}
    vllm_method = vllm_method_for(method)
    spec_fields = _speculative_config_fields()
    options_cls = method.options
    rejected = sorted(k for k in spec if k in spec_fields and k not in SPEC_FIELDS_ACCEPTED)
    if rejected:
        raise ValueError(
            f"speculative_config: {', '.join(rejected)} cannot be used with method "
            f"{method.name!r}; accepted: num_speculative_tokens and the options "
            f"{', '.join(options_cls.names())}"
        )
    values = {k: v for k, v in spec.items() if k not in spec_fields}
    if method.takes_model and spec.get("model") is not None:
        values["model"] = spec["model"]  # the method's own model, not vLLM's draft model
    options = options_cls.from_dict(values)
    check_target_model(method.name, target_model_config)
    method.check(options, target_model_config)  # e.g. a missing model fails here
    on_v1 = vllm_method == "custom_class"
    default_k = method.default_k if on_v1 else model_runner_v2.DEFAULT_K
    num_tokens = check_num_speculative_tokens(
        spec.get("num_speculative_tokens", default_k), method.name
    )
    scheduled = options.scheduled_tokens(num_tokens) if on_v1 else num_tokens
    if scheduled > MAX_SPEC_TOKENS:  # mtad with all beams: num_speculative_tokens x beam_width
        raise ValueError(
            f"{method.name}: these options schedule {scheduled} draft tokens a request "
            f"(num_speculative_tokens {num_tokens} × beam_width {options.beam_width}), more "
            f"than vLLM's {MAX_SPEC_TOKENS}; lower either, or set candidates to 'best'")
    additional_config[ADDITIONAL_CONFIG_KEY] = {"method": method.name, **options.to_dict()}
    if on_v1:
        rewritten = {"method": vllm_method, "model": method.proposer,
                     "num_speculative_tokens": scheduled}
    else:  # registered with Model Runner V2 under its own name; linear drafts of K
        rewritten = {"method": vllm_method, "num_speculative_tokens": scheduled}
    return rewritten, additional_config


def vllm_method_for(method: Method) -> str:
    """The method vLLM runs ours as: V1's ``custom_class`` (vLLM 0.26 - 0.33), else the
    name registered in Model Runner V2's speculator registry (0.34 on); raises naming what
    this vLLM lacks."""
    missing = missing_features()
    if not missing:
        return "custom_class"
    registry = model_runner_v2.has_speculator_registry()
    if registry and method.speculator_config:
        return method.name
    needs = SUPPORTED_VLLM
    if method.speculator_config:
        needs += " or Model Runner V2's speculator registry (0.34 on)"
    why = f"; Model Runner V2 cannot run it: {method.without_v2}" if registry else ""
    raise ValueError(f"speculative method {method.name!r} needs vLLM {needs}; the installed "
                     f"vLLM {vllm_version()} lacks: {', '.join(missing)}{why}")


def check_target_model(method: str, target_model_config: Any) -> None:
    """Refuse a target whose layers keep a recurrent state (state-space or linear
    attention, alone or beside attention): vLLM's verification does not give plain
    decoding's tokens on it (on the CPU a hybrid Granite model's output differed with
    lookahead, and vLLM's own ``ngram`` failed), so no draft may be verified there."""
    if target_model_config is None:
        return
    if any(getattr(target_model_config, flag, False)
           for flag in ("is_hybrid", "has_inner_state", "is_attention_free")):
        raise ValueError(
            f"speculative method {method!r} cannot serve "
            f"{getattr(target_model_config, 'model', 'this model')}: its state-space or "
            "linear-attention layers keep a recurrent state that vLLM's speculative "
            "verification does not keep exact; serve it without speculative decoding")


def _speculative_config_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    return set(SpeculativeConfig.__dataclass_fields__)


def _fold_spec_aliases(engine_args: Any) -> None:
    """Fold ``spec_method``/``spec_model``/``spec_tokens`` into ``speculative_config``.

    Mirrors what ``create_speculative_config`` does, earlier, so that the method name
    is visible to the rewrite; the aliases are cleared so vLLM does not fold twice.
    """
    for flag, attr, key in (
        ("--spec-method", "spec_method", "method"),
        ("--spec-model", "spec_model", "model"),
        ("--spec-tokens", "spec_tokens", "num_speculative_tokens"),
    ):
        value = getattr(engine_args, attr, None)
        if value is None:
            continue
        spec = dict(engine_args.speculative_config or {})
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
        engine_args.speculative_config = spec
        setattr(engine_args, attr, None)


def _patch_create_speculative_config(engine_args_cls: type) -> None:
    def make_wrapper(original):
        def create_speculative_config(self, *args, **kwargs):
            _fold_spec_aliases(self)
            if isinstance(self.speculative_config, dict):
                target = args[0] if args else kwargs.get("target_model_config")
                self.speculative_config, self.additional_config = rewrite_speculative_config(
                    self.speculative_config, self.additional_config, target
                )
            return original(self, *args, **kwargs)

        return create_speculative_config

    _patching.wrap(engine_args_cls, "create_speculative_config", make_wrapper)


def parse_speculative_config_arg(text: str) -> dict[str, Any] | None:
    """``--speculative-config`` value: JSON as before, or a bare method name."""
    if text in ("", "None"):
        return None
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc}") from exc
    else:
        spec = {"method": text.strip()}
    try:
        rewrite_speculative_config(spec, None)  # validate now: a clean argparse error
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


def _patch_cli(engine_args_cls: type) -> None:
    def make_wrapper(original):
        def add_cli_args(parser, *args, **kwargs):
            parser = original(parser, *args, **kwargs)
            actions = getattr(parser, "_option_string_actions", {})
            if "--speculative-config" in actions:
                actions["--speculative-config"].type = parse_speculative_config_arg
            spec_method = actions.get("--spec-method")
            if spec_method is not None and spec_method.choices is not None:
                spec_method.choices = [*spec_method.choices, *METHODS]
            return parser

        return add_cli_args

    _patching.wrap(engine_args_cls, "add_cli_args", make_wrapper)


def _patch_legacy_kwargs(engine_args_cls: type) -> None:
    """Accept ``speculative_model=`` and ``num_speculative_tokens=`` (pre-0.7 spellings)."""

    def make_wrapper(original):
        def __init__(self, *args, speculative_model=None, num_speculative_tokens=None, **kwargs):
            if speculative_model is not None or num_speculative_tokens is not None:
                spec = dict(kwargs.get("speculative_config") or {})
                for key, value in (("model", speculative_model),
                                   ("num_speculative_tokens", num_speculative_tokens)):
                    if value is not None:
                        spec.setdefault(key, value)
                kwargs["speculative_config"] = spec
            original(self, *args, **kwargs)

        return __init__

    _patching.wrap(engine_args_cls, "__init__", make_wrapper)


def _patch_request_validation() -> None:
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        InputProcessor = None
    if not hasattr(InputProcessor, "_validate_params"):
        logger.warning("vllm-lookahead: this vLLM has no InputProcessor._validate_params; "
                       "bad per-request lookahead options are ignored, not rejected")
        return

    def make_wrapper(original):
        def _validate_params(self, params, *args, **kwargs):
            result = original(self, params, *args, **kwargs)
            extra = getattr(params, "extra_args", None) or {}
            if any(key.startswith(REQUEST_KEY_PREFIX) for key in extra):
                check_request_options(extra, self.vllm_config)
            return result

        return _validate_params

    _patching.wrap(InputProcessor, "_validate_params", make_wrapper)


def check_request_options(extra_args: dict[str, Any], vllm_config: Any) -> None:
    """Raise vLLM's client error (HTTP 400) for bad ``lookahead_*`` request options."""
    options = method_config(vllm_config)
    if options.get("method") != "lookahead":
        keys = sorted(k for k in extra_args if k.startswith(REQUEST_KEY_PREFIX))
        raise _client_error(f"{', '.join(keys)}: this server does not run speculative "
                            "method 'lookahead'")
    server_options = LookaheadOptions.from_dict(
        {k: v for k, v in options.items() if k != "method"})
    try:
        request_overrides(extra_args, vllm_config.speculative_config.num_speculative_tokens,
                          server_options)
    except ValueError as exc:
        raise _client_error(str(exc)) from None


def runs_our_method(speculative_config: Any) -> bool:
    """``speculative_config`` (vLLM's) runs one of our proposers."""
    return ((getattr(speculative_config, "method", None) == "custom_class"
             and getattr(speculative_config, "model", None) in PROPOSERS)
            or getattr(speculative_config, "custom_method", None) in METHODS)


PROPOSERS = frozenset(method.proposer for method in METHODS.values())


def _patch_speculative_admission() -> None:
    from vllm import SamplingParams

    if not hasattr(SamplingParams, "_validate_spec_decode"):
        logger.warning("vllm-lookahead: this vLLM has no SamplingParams._validate_spec_decode; "
                       "requests with logit_bias or min_p stay refused under speculation")
        return

    def make_wrapper(original):
        def _validate_spec_decode(self, speculative_config, *args, **kwargs):
            if not runs_our_method(speculative_config):
                return original(self, speculative_config, *args, **kwargs)
            if getattr(self, "logprob_token_ids", None):
                raise _client_error(
                    "logprob_token_ids cannot be served with speculative decoding: vLLM's "
                    "verification returns no log-probabilities for them (or fails the "
                    "batch); send this request to a server without speculative decoding")
            if undrafted_parameter(self) is None:
                return original(self, speculative_config, *args, **kwargs)
            # served without drafts: vLLM's other checks still apply
            return original(without_undrafted_parameters(self), speculative_config,
                            *args, **kwargs)

        return _validate_spec_decode

    _patching.wrap(SamplingParams, "_validate_spec_decode", make_wrapper)


def _client_error(message: str) -> Exception:
    """vLLM's client error (HTTP 400), or ValueError where it has none."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(message)
    return VLLMValidationError(message)
