"""Lookahead on vLLM's Model Runner V2 (vLLM 0.34 on), against vLLM's own classes.

No engine of vLLM 0.34 starts on these CPUs: its V2 runner prepares inputs, samples and
updates request state with Triton kernels (no CPU backend on any registry), and vLLM's
GPU wheel, the only 0.34 build, finds no platform here (``DeviceConfig`` fails on an empty
device). So the runner's step is played by the test: the request state is vLLM's
``RequestState`` on CPU tensors (its host buffers told that this machine has no pinned
memory and a ``cpu`` device: the one stand-in), the batch is vLLM's ``InputBatch``, and
the target's verification is scripted (a draft's longest prefix matching the text that
follows, plus one token), written where V2's ``post_update`` kernel writes it.

The speculator's drafts must equal what the V1 adapter's core drafts from the same
history with the same options: one proposer core, two adapters.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from vllm_lookahead import engine_config, model_runner_v2, plugin
from vllm_lookahead.lookahead.options import LookaheadOptions

pytestmark = pytest.mark.skipif(not model_runner_v2.has_speculator_registry(),
                                reason="this vLLM has no Model Runner V2 speculator registry")

K = 6
MAX_MODEL_LEN = 256
PROMPT = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]
#: what the target generates after the prompt: the pattern, then new text, then again
TEXT = [9, 10, 11, 12, 7, 8, 9, 10, 11, 40, 41, 42, 43, 7, 8, 9, 10, 11, 12, 7, 8, 9,
        40, 41, 42, 43, 44, 45, 7, 8, 9, 10, 11, 12, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def registered():
    plugin.register()


@pytest.fixture(scope="module")
def model_config(registered, tmp_path_factory):
    from tiny_models import build_model
    from vllm.engine.arg_utils import EngineArgs

    path = build_model(Path(tmp_path_factory.mktemp("llama")), "llama", seed=0)
    return EngineArgs(model=str(path), dtype="float32",
                      max_model_len=MAX_MODEL_LEN).create_model_config()


def speculative_config(model_config, spec):
    """vLLM's ``SpeculativeConfig`` as ``EngineArgs`` builds it (our wrapper included)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=model_config.model, speculative_config=spec)
    return args.create_speculative_config(model_config, ParallelConfig()), args


def test_lookahead_is_registered_and_mtad_is_not(registered):
    from vllm.v1.worker.gpu.spec_decode.speculator_config import (
        registered_speculative_methods,
    )

    assert "lookahead" in registered_speculative_methods()
    assert "mtad" not in registered_speculative_methods()
    with pytest.raises(ValueError, match="MTAD's joint acceptance rule"):
        engine_config.rewrite_speculative_config({"method": "mtad", "model": "x"}, None)


@pytest.mark.parametrize("spec", [{"method": "lookahead"},
                                  engine_config.parse_speculative_config_arg("lookahead"),
                                  {"method": "lookahead", "ngram_size": 3,
                                   "num_speculative_tokens": 5}])
def test_the_engine_arguments_give_vllm_the_registered_speculator(model_config, spec):
    config, args = speculative_config(model_config, dict(spec))
    assert config.custom_method == "lookahead"
    assert config.speculator_config.speculator_class.endswith("LookaheadSpeculator")
    assert config.num_speculative_tokens == spec.get("num_speculative_tokens",
                                                     model_runner_v2.DEFAULT_K)
    assert args.additional_config["vllm_lookahead"]["ngram_size"] == spec.get(
        "ngram_size", LookaheadOptions().ngram_size)


def test_bad_options_are_refused_naming_the_option(model_config):
    with pytest.raises(ValueError, match="ngram_size"):
        speculative_config(model_config, {"method": "lookahead", "ngram_size": 0})


def request_state(num_speculative_tokens: int, vocab_size: int):
    """vLLM's ``RequestState`` with its host buffers told that this machine has no pinned
    memory and a ``cpu`` device (the test's one stand-in: vLLM's GPU wheel finds no
    platform here)."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.states import RequestState

    platform = SimpleNamespace(device_type="cpu", is_confidential_compute=lambda: False)
    with mock.patch.object(buffer_utils, "is_uva_available", return_value=False), \
         mock.patch.object(buffer_utils, "is_pin_memory_available", return_value=False), \
         mock.patch("vllm.platforms.current_platform", platform):
        return RequestState(4, MAX_MODEL_LEN, MAX_MODEL_LEN, num_speculative_tokens,
                            vocab_size, torch.device("cpu"))


def build_speculator(model_config, spec):
    """vLLM's ``init_speculator`` builds ours from the config, as V2's runner does."""
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    config, args = speculative_config(model_config, spec)
    vllm_config = SimpleNamespace(
        speculative_config=config, model_config=model_config,
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config=args.additional_config, instance_id="v2-test")
    req_states = request_state(config.num_speculative_tokens, model_config.get_vocab_size())
    return init_speculator(vllm_config, torch.device("cpu"), req_states), vllm_config


def batch(req_ids: list[str], slots: list[int]):
    from vllm.v1.worker.gpu.input_batch import InputBatch

    fields = {f.name: None for f in dataclasses.fields(InputBatch)}
    return InputBatch(**{**fields, "req_ids": req_ids, "num_reqs": len(req_ids),
                         "idx_mapping": torch.tensor(slots, dtype=torch.int64),
                         "idx_mapping_np": np.asarray(slots, dtype=np.int32)})


class ScriptedRunner:
    """V2's runner, as far as a speculator sees it: admits a request into a slot
    (``add_requests``), then each step appends the target's tokens to its request state
    (``post_update``) and calls ``propose``."""

    def __init__(self, speculator):
        self.speculator, self.states = speculator, speculator.req_states

    def admit(self, req_id: str, slot: int, prompt: list[int], params) -> None:
        self.speculator.note_request(req_id, params)
        self.states.req_id_to_index[req_id] = slot
        self.states.prompt_len.np[slot] = len(prompt)
        self.states.all_token_ids.gpu[slot, : len(prompt)] = torch.tensor(prompt)
        self.states.total_len.gpu[slot] = len(prompt)
        self.speculator.add_request(slot)

    def step(self, rows: list[tuple[str, int, list[int]]]) -> torch.Tensor:
        """Each row's request emits its tokens; the speculator's drafts for the rows."""
        for _, slot, emitted in rows:
            end = int(self.states.total_len.gpu[slot])
            self.states.all_token_ids.gpu[slot, end: end + len(emitted)] = torch.tensor(emitted)
            self.states.total_len.gpu[slot] = end + len(emitted)
        num_sampled = torch.tensor([len(e) for _, _, e in rows], dtype=torch.int32)
        empty = torch.zeros(0)
        return self.speculator.propose(
            batch([r for r, _, _ in rows], [s for _, s, _ in rows]), {}, {}, empty, None,
            num_sampled, torch.zeros_like(num_sampled), empty, empty, empty, empty)


def verified(draft: list[int], text: list[int]) -> list[int]:
    """What verification emits: the draft's prefix that the text follows, one more."""
    accepted = 0
    while accepted < len(draft) and accepted < len(text) - 1 and draft[accepted] == text[accepted]:
        accepted += 1
    return text[: accepted + 1]


def v1_core(vllm_config, options):
    """The core as the V1 adapter runs it, bound to a V1-shaped runner."""
    from vllm_lookahead.lookahead.proposer import LookaheadProposer

    core = LookaheadProposer(vllm_config, options)
    runner = SimpleNamespace(requests={}, device=torch.device("cpu"),
                             input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=None))
    core.bind_model_runner(runner)
    return core, runner


def test_the_speculator_drafts_what_the_v1_adapters_core_drafts(model_config):
    from vllm import SamplingParams

    speculator, vllm_config = build_speculator(
        model_config, {"method": "lookahead", "num_speculative_tokens": K})
    core, runner = v1_core(vllm_config, speculator.options)
    params = SamplingParams(temperature=0.0)
    scripted = ScriptedRunner(speculator)
    scripted.admit("a", 2, PROMPT, params)
    runner.requests["a"] = SimpleNamespace(sampling_params=params)
    runner.input_batch.req_ids = ["a"]
    runner.input_batch.num_prompt_tokens = np.array([len(PROMPT)])

    history, position, accepted, steps = list(PROMPT), 0, 0, 0
    emitted = [TEXT[0]]
    while position + len(emitted) < len(TEXT):
        history += emitted
        position += len(emitted)
        drafts = scripted.step([("a", 2, emitted)])
        assert drafts.shape == (1, K) and drafts.dtype == torch.int64
        v1 = core.propose([emitted], np.array([len(history)]),
                          np.array([history + [0]], dtype=np.int32))
        draft = [t for t in drafts[0].tolist() if t >= 0]
        assert draft == v1[0]  # one core, two adapters
        assert drafts[0, len(draft):].eq(-1).all()  # V2's padding
        emitted = verified(draft, TEXT[position:])
        accepted += len(emitted) - 1
        steps += 1
    assert accepted >= steps  # not vacuous: the repeats were drafted and accepted


def test_lifecycle_frees_state_feeds_the_corpus_and_resets(model_config):
    from vllm import SamplingParams

    speculator, _ = build_speculator(model_config, {"method": "lookahead"})
    scripted = ScriptedRunner(speculator)
    scripted.admit("a", 0, PROMPT, SamplingParams(temperature=0.0))
    scripted.step([("a", 0, TEXT[:1])])
    assert len(speculator.core.states) == 1
    scripted.admit("a", 1, PROMPT + TEXT[:1], SamplingParams(temperature=0.0))  # resumed
    assert len(speculator.core.states) == 0  # preempted: freed, not in the corpus
    scripted.step([("a", 1, TEXT[1:3])])
    speculator.on_requests_finished({"a"})
    assert len(speculator.core.states) == 0 and "a" not in speculator.view.requests
    assert speculator.core.stats.corpus_size > 0
    speculator.reset_state()  # vLLM's warm-up requests are forgotten
    assert speculator.core.stats.corpus_size == 0


def test_a_request_with_logit_bias_is_served_without_drafts(model_config):
    from vllm import SamplingParams

    speculator, _ = build_speculator(model_config, {"method": "lookahead"})
    scripted = ScriptedRunner(speculator)
    scripted.admit("biased", 0, PROMPT, SamplingParams(temperature=0.0, logit_bias={9: 1.0}))
    scripted.admit("plain", 3, PROMPT, SamplingParams(temperature=0.0))
    drafts = scripted.step([("biased", 0, TEXT[:1]), ("plain", 3, TEXT[:1])])
    assert drafts[0].eq(-1).all() and drafts[1, 0] == TEXT[1]


def test_v2_runs_linear_drafts_filled_to_k_and_says_so(model_config):
    with mock.patch("vllm_lookahead.model_runner_v2.speculator.logger") as logger:
        speculator, _ = build_speculator(model_config, {"method": "lookahead", "trees": "on"})
    warned = " ".join(str(call) for call in logger.warning.call_args_list)
    assert "trees" in warned and "cost_aware_drafts" not in warned  # only what was asked
    options = speculator.options
    assert (options.trees, options.uniform_drafts, options.cost_aware_drafts) == ("off", "on",
                                                                                  False)
    assert not speculator.core.trees_on


def test_the_runner_binding_installs_only_for_lookahead_engines(registered):
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    plain = SimpleNamespace(speculative_config=SimpleNamespace(custom_method=None))
    ours = SimpleNamespace(speculative_config=SimpleNamespace(custom_method="lookahead"))
    assert not model_runner_v2.runs_lookahead(plain)
    assert model_runner_v2.runs_lookahead(ours)
    from vllm_lookahead.model_runner_v2.speculator import LookaheadSpeculator

    assert issubclass(LookaheadSpeculator, BaseSpeculator)


def test_logit_bias_and_min_p_are_admitted_for_lookahead_only(model_config):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    lookahead, _ = speculative_config(model_config, {"method": "lookahead"})
    ngram, _ = speculative_config(model_config, {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})
    for params in (SamplingParams(temperature=1.0, logit_bias={9: 1.0}),
                   SamplingParams(temperature=1.0, min_p=0.1)):
        params._validate_spec_decode(lookahead)  # served without drafts
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative"):
            params._validate_spec_decode(ngram)  # vLLM's own rule, untouched
