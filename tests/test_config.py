"""Every documented spelling maps to vLLM's custom_class proposer; bad input fails early."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

import vllm_lookahead  # noqa: F401  (registers, as the entry point does in vLLM processes)
from vllm_lookahead import _patching, engine_config, plugin
from vllm_lookahead.lookahead.options import (
    DEFAULT_SPEC_TOKENS,
    LookaheadOptions,
    lookahead_options_table,
)
from vllm_lookahead.options import ADDITIONAL_CONFIG_KEY
from vllm_lookahead.proposer import METHODS

PROPOSER = "vllm_lookahead.lookahead.proposer.LookaheadProposer"


def make_arg_parser():
    """vLLM's server argument parser, wherever this vLLM keeps it."""
    for module in ("vllm.entrypoints.common.cli_args",  # 0.33
                   "vllm.entrypoints.launchers.cli_args",  # 0.32
                   "vllm.entrypoints.openai.cli_args"):  # 0.26
        try:
            make = importlib.import_module(module).make_arg_parser
        except ImportError:
            continue
        return make(FlexibleArgumentParser())
    raise ImportError("no make_arg_parser in this vLLM")


def engine_config_from_cli(argv):
    args = make_arg_parser().parse_args(argv)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def assert_lookahead(config, num_tokens=DEFAULT_SPEC_TOKENS, **options):
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.model == PROPOSER
    assert config.speculative_config.num_speculative_tokens == num_tokens
    stored = config.additional_config[ADDITIONAL_CONFIG_KEY]
    assert stored["method"] == "lookahead"
    assert {**stored, **options} == stored


def test_entry_point_is_registered():
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "vllm_lookahead.plugin:register" in names


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    wrapped = EngineArgs.create_speculative_config.__wrapped__
    assert not hasattr(wrapped, "_vllm_lookahead_patch")



def test_a_wrapped_property_stays_a_property_wrapped_once():
    class Config:
        @property
        def slots(self):
            return 1

    def add_one(original):
        def slots(self):
            return original(self) + 1

        return slots

    assert _patching.wrap(Config, "slots", add_one)
    assert not _patching.wrap(Config, "slots", add_one)
    assert Config().slots == 2


def test_every_registered_proposer_is_the_class_vllm_loads(llama_path):
    """Each entry of ``vllm_lookahead.proposer`` names an importable class, and that
    class path is what vLLM's ``custom_class`` is handed."""
    for method in METHODS.values():
        module, _, name = method.proposer.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type)
        spec = {"method": method.name, **({"model": llama_path} if method.takes_model else {})}
        rewritten, _ = engine_config.rewrite_speculative_config(spec, None)
        assert rewritten["model"] == method.proposer

@pytest.mark.parametrize(
    "kwargs",
    [
        dict(speculative_config={"method": "lookahead", "num_speculative_tokens": 6}),
        dict(speculative_config={"model": "[lookahead]"}),
        dict(spec_method="lookahead"),
        dict(speculative_model="[lookahead]"),  # legacy spelling, after import vllm_lookahead
        dict(speculative_model="[lookahead]", num_speculative_tokens=6),
    ],
    ids=["dict", "model-alias", "spec_method", "speculative_model", "legacy-pair"],
)
def test_python_spellings(llama_path, kwargs):
    num_tokens = kwargs.get("num_speculative_tokens") or kwargs.get(
        "speculative_config", {}).get("num_speculative_tokens", DEFAULT_SPEC_TOKENS)
    assert_lookahead(EngineArgs(model=llama_path, **kwargs).create_engine_config(), num_tokens)


def test_python_options_reach_additional_config(llama_path):
    spec = {"method": "lookahead", "num_speculative_tokens": 3, "ngram_size": 5,
            "window_size": 2, "guess_set_size": 0, "pool_from_prompt": False}
    config = EngineArgs(model=llama_path, speculative_config=spec).create_engine_config()
    assert_lookahead(config, num_tokens=3, ngram_size=5, window_size=2,
                     guess_set_size=0, pool_from_prompt=False)


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 6}'],
        ["--speculative-config", "lookahead"],
        ["--spec-method", "lookahead"],
        ["--speculative-config.method", "lookahead", "--speculative-config.ngram_size", "5"],
    ],
    ids=["json", "bare-word", "spec-method", "dotted"],
)
def test_cli_spellings(llama_path, argv):
    config = engine_config_from_cli(["--model", llama_path, *argv])
    assert_lookahead(config, 6 if "num_speculative_tokens" in argv[1] else DEFAULT_SPEC_TOKENS)
    if "--speculative-config.ngram_size" in argv:
        assert config.additional_config[ADDITIONAL_CONFIG_KEY]["ngram_size"] == 5


def test_method_names_in_any_case_and_cli_option_keys_with_hyphens(llama_path):
    """``"Lookahead"`` is lookahead (not handed to vLLM unchanged), and the command line
    takes option keys as vLLM spells its own flags (``draft-min-prob``), as Python does."""
    config = EngineArgs(model=llama_path,
                        speculative_config={"method": "Lookahead"}).create_engine_config()
    assert_lookahead(config)
    config = engine_config_from_cli([
        "--model", llama_path, "--speculative-config",
        '{"method": "LOOKAHEAD", "draft-min-prob": 0.25, "num-speculative-tokens": 6}'])
    assert_lookahead(config, 6, draft_min_prob=0.25)


def test_every_size_option_is_bounded():
    """A size past its bound is refused at start-up naming the option, the value and the
    bound, instead of failing in the worker (MemoryError, int32 overflow)."""
    import dataclasses

    from vllm_lookahead.mtad.options import MTADOptions

    required_by = {LookaheadOptions: {"suffix_match_max": 256}, MTADOptions: {"model": "m"}}
    for options_cls, required in required_by.items():
        for f in dataclasses.fields(options_cls):
            if f.type not in ("int", "int | str"):
                continue
            high = f.metadata["high"]
            assert high is not None, f"{f.name} has no upper bound"
            options_cls.from_dict({**required, f.name: high})
            with pytest.raises(ValueError, match=rf"{f.name} must be an integer in "
                                                 rf"\[{f.metadata['low']}, {high}\].*"
                                                 rf"\(got {high + 1}\)"):
                options_cls.from_dict({**required, f.name: high + 1})


def test_vllm_methods_pass_through(llama_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = EngineArgs(model=llama_path, speculative_config=spec).create_engine_config()
    assert config.speculative_config.method == "ngram"
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config


BAD_CONFIGS = [
    ({"ngram_sizes": 4}, "unknown option(s) 'ngram_sizes'; accepted options: ngram_size"),
    ({"ngram_size": 1}, "ngram_size must be an integer in [2, 16]"),
    ({"window_size": 0}, "window_size must be an integer in [1, 128]"),
    ({"guess_set_size": -1}, "guess_set_size must be an integer in [0, 64]"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 128]"),
    ({"num_speculative_tokens": 129}, "num_speculative_tokens must be an integer in [1, 128]"),
    ({"pool_from_prompt": "yes"}, "pool_from_prompt must be true or false"),
    ({"pool_max_per_key": 0}, "pool_max_per_key must be an integer in [1, 256]"),
    ({"corpus_tokens": 1 << 30}, "corpus_tokens must be an integer in [0, 16777216] "
                                 "(got 1073741824)"),
    ({"draft_min_prob": 1.5}, "draft_min_prob must be a number in [0, 1]"),
    ({"draft_min_prob": "high"}, "draft_min_prob must be a number in [0, 1]"),
    ({"suffix_match_min": 5, "suffix_match_max": 3},
     "suffix_match_min must be <= suffix_match_max"),
    ({"prompt_lookup_max": 3}, "prompt_lookup_max cannot be used with method 'lookahead'"),
    ({"model": "some/draft-model"}, "method 'lookahead' has no draft model"),
    ({"trees": "yes"}, "trees must be 'auto' or 'on' or 'off' (got 'yes')"),
    ({"recycle_top_k": "many"}, 'recycle_top_k must be an integer in [0, 64] or "auto"'),
    ({"ngram_size": 2, "tree_window": 2}, "tree_window needs ngram_size >= 3"),
]


@pytest.mark.parametrize("options,message", BAD_CONFIGS, ids=[str(o) for o, _ in BAD_CONFIGS])
def test_bad_options_name_the_option_and_accepted_values(llama_path, options, message):
    spec = {"method": "lookahead", **options}
    with pytest.raises(ValueError) as error:
        EngineArgs(model=llama_path, speculative_config=spec).create_engine_config()
    assert message in str(error.value)


@pytest.mark.parametrize("options,message", BAD_CONFIGS[:4])
def test_bad_cli_options_are_argparse_errors(llama_path, options, message, capsys):
    import json

    spec = json.dumps({"method": "lookahead", **options})
    with pytest.raises(SystemExit) as exit_info:
        make_arg_parser().parse_args(["--model", llama_path, "--speculative-config", spec])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_incompatible_vllm_is_a_clear_error(llama_path, monkeypatch, capsys):
    monkeypatch.setattr(engine_config, "missing_features", lambda: ["create_custom_proposer"])
    with pytest.raises(ValueError, match=r"needs vLLM 0.26 - 0.33 or Model Runner V2's "
                                         r"speculator registry \(0.34 on\); the installed "
                                         r"vLLM .* lacks: create_custom_proposer"):
        EngineArgs(model=llama_path, spec_method="lookahead").create_engine_config()
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--model", llama_path, "--speculative-config", "lookahead"])
    assert "lacks: create_custom_proposer" in capsys.readouterr().err


def test_server_rejects_bad_option_at_startup_without_traceback(llama_path):
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", llama_path,
         "--speculative-config", '{"method": "lookahead", "ngram_size": 1}'],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "ngram_size must be an integer in [2, 16]" in result.stderr
    assert "Traceback" not in result.stderr


def test_registering_and_validating_options_leave_numba_unloaded():
    """vLLM 0.32's CPU platform fails to start a worker in a process that imported numba
    (vllm_lookahead/worker/kernel_overrides.py): the plugin and the option checks run in every process before
    the runner exists, so they must not import the numba-compiled drafting code."""
    check = ("import sys, vllm_lookahead.plugin as p; p.register(); "
             "from vllm_lookahead.lookahead.options import LookaheadOptions; "
             "from vllm_lookahead.mtad.options import MTADOptions; "
             "LookaheadOptions.from_dict({}); MTADOptions.from_dict({\"model\": \"m\"}); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'numba'))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_docs_document_every_option():
    """docs/options.md holds the lookahead option table the code generates (and names every
    option), docs/mtad.md the mtad one: a changed default or help text fails here until
    the page is regenerated."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    options_page = (docs / "options.md").read_text()
    assert lookahead_options_table() in options_page
    for name in LookaheadOptions.names():
        assert f"`{name}`" in options_page
    from vllm_lookahead.mtad.options import mtad_options_table

    assert mtad_options_table() in (docs / "mtad.md").read_text()
