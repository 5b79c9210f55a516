"""Engines in the user's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core
and worker in the caller's process, as in notebooks and on vLLM's Ray executor), one
after another: each starts, and each answers as plain decoding, whatever ran before it.

Without ``worker/kernel_overrides.py`` every engine after the first lookahead one failed
to start on vLLM 0.32 (its scan for CPU kernel overrides trips over numba's llvmlite);
without the sampler's hooks kept per runner, an engine after an MTAD one verified its
drafts with MTAD's rule, and a lookahead engine lost its verification feedback to any
engine started beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import (
    ENGINE_KWARGS,
    LOOKAHEAD,
    generate,
    greedy,
    make_prompts,
    mtad,
    proposer_stats,
    shutdown,
)
from engine_processes import engines_in_this_process

ONE_AFTER_ANOTHER = """
import json, sys
from vllm import LLM, SamplingParams

config = json.loads(sys.argv[1])
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
outputs = []
for spec in config["specs"]:
    llm = LLM(config["model"], speculative_config=spec, **config["engine"])
    generated = llm.generate([{"prompt_token_ids": p} for p in config["prompts"]], params,
                             use_tqdm=False)
    outputs.append([list(o.outputs[0].token_ids) for o in generated])
    llm.llm_engine.engine_core.shutdown()
    del llm
print("RESULT " + json.dumps(outputs))
"""


@pytest.mark.once  # the scan is vLLM 0.32's (the first version); the hooks' reset is ours
def test_engines_one_after_another_in_the_callers_process(llama_path):
    specs = [None, mtad(llama_path), {"method": "lookahead"}, None]
    config = {"model": llama_path, "specs": specs, "engine": ENGINE_KWARGS,
              "prompts": make_prompts()[:4]}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-c", "import numba\n" + ONE_AFTER_ANOTHER,
                          json.dumps(config)], capture_output=True, text=True, env=env,
                         timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    plain, *others = json.loads(lines[-1].removeprefix("RESULT "))
    assert all(outputs == plain for outputs in others)


def test_engines_side_by_side_keep_their_own_verification(llama_path, llama_reference):
    """vLLM's ``rejection_sample`` is one function for every engine of a process: a plain
    engine and an MTAD one started beside a lookahead engine take neither its
    verification feedback nor its acceptance rule."""
    from vllm import LLM

    with engines_in_this_process():
        lookahead = LLM(llama_path, speculative_config=LOOKAHEAD, **ENGINE_KWARGS)
        beside = [LLM(llama_path, **ENGINE_KWARGS),
                  LLM(llama_path, speculative_config=mtad(llama_path), **ENGINE_KWARGS)]
        try:
            client = type(lookahead.llm_engine.engine_core).__name__
            outputs = generate(lookahead, make_prompts(), greedy())
            stats, = proposer_stats(lookahead)
        finally:
            for llm in (lookahead, *beside):
                shutdown(llm)
    assert client == "InprocClient"
    assert outputs == llama_reference
    # its verification reached its own proposer: n-grams harvested from the target's
    # predictions at its draft positions
    assert stats.harvested_ngrams > 0
    assert stats.request_passes > 0 and stats.generated_tokens > 1.5 * stats.request_passes
