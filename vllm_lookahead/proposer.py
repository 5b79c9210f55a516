"""The proposers this plugin registers with vLLM's spec-decode framework, one entry per
speculative method: the ``custom_class`` vLLM loads for it (and logs), its options, its
default K, the ``model`` spellings that select it and what it checks at start-up.

Up to vLLM 0.33 ``engine_config.py`` maps each name below onto vLLM's ``custom_class``
proposer (Model Runner V1); from 0.34, which has neither, a method with a
``speculator_config`` is registered in Model Runner V2's speculator registry
(``model_runner_v2``). The classes live with their method
(``lookahead/proposer.py``, ``mtad/proposer.py``) and are imported by vLLM in the
workers only, so this module names them by path and imports neither.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vllm_lookahead.lookahead.options import DEFAULT_SPEC_TOKENS as LOOKAHEAD_K
from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.mtad.options import DEFAULT_SPEC_TOKENS as MTAD_K
from vllm_lookahead.mtad.options import MTADOptions


@dataclass(frozen=True)
class Method:
    name: str
    proposer: str  # the class vLLM's custom_class path loads, as "module.Class"
    options: type  # its options dataclass (a MethodOptions)
    default_k: int  # num_speculative_tokens when not given
    #: ``speculative_config["model"]`` spellings that select the method without "method"
    model_aliases: tuple[str, ...] = ()
    #: ``speculative_config["model"]`` is the method's own (auxiliary) model
    takes_model: bool = False
    #: "module:function(options, target_model_config)", imported only when the method is
    #: selected (it may load model code)
    startup_check: str | None = None
    #: Model Runner V2 (vLLM 0.34 on): its ``SpeculatorConfig``, as "module.Class", or
    #: why it has none
    speculator_config: str | None = None
    without_v2: str = ""

    def check(self, options: Any, target_model_config: Any) -> None:
        if self.startup_check:
            module, function = self.startup_check.split(":")
            getattr(importlib.import_module(module), function)(options, target_model_config)


METHODS = {m.name: m for m in (
    Method("lookahead", "vllm_lookahead.lookahead.proposer.LookaheadProposer",
           LookaheadOptions, LOOKAHEAD_K, model_aliases=("lookahead", "[lookahead]"),
           speculator_config="vllm_lookahead.model_runner_v2.config.LookaheadSpeculatorConfig"),
    Method("mtad", "vllm_lookahead.mtad.proposer.MTADProposer", MTADOptions, MTAD_K,
           takes_model=True, startup_check="vllm_lookahead.mtad.startup:check_auxiliary_model",
           without_v2="Model Runner V2 lets a speculator neither replace verification (MTAD's "
                      "joint acceptance rule) nor run a second model on the target's KV cache "
                      "outside vLLM's own draft-model speculators"),
)}


def method_by_model_alias(model: Any) -> Method | None:
    return next((m for m in METHODS.values() if model in m.model_aliases), None)
