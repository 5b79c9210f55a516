"""Installing the plugin never breaks vLLM: a worker of an engine that did not ask for
one of our methods gets no patch of vLLM's runner, and on a vLLM without Model Runner V1
(0.34 on) no V1 patch is attempted at all. Each case runs in a fresh interpreter, as a
vLLM worker process would: patches are installed once per process.

Runs with every vLLM of scripts/test.sh, 0.34.0 included (its Python only: no engine of
it starts on these CPUs; ``test_model_runner_v2.py`` says why).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from vllm_lookahead import vllm_support

#: Builds a worker (``WorkerBase.__init__``, wrapped by the plugin) the way vLLM's worker
#: process does once plugins are loaded, for an engine whose ``additional_config`` is
#: given; reports which of vLLM's attributes carry the plugin's patch mark.
WORKER = textwrap.dedent("""
    import json, sys
    from unittest import mock
    from vllm_lookahead import _patching, plugin, vllm_support

    plugin.register()
    from vllm.v1.worker.worker_base import WorkerBase

    config = mock.MagicMock(additional_config=json.loads(sys.argv[1]))
    WorkerBase.__init__(object.__new__(WorkerBase), config, 0, 0, "tcp://127.0.0.1:0", True)

    def marked(module, owner, name):
        if module not in sys.modules:
            return None
        target = getattr(sys.modules[module], owner) if owner else sys.modules[module]
        return getattr(getattr(target, name), _patching._MARK, False)

    print(json.dumps({
        "v1_runner_imported": "vllm.v1.worker.gpu_model_runner" in sys.modules,
        "runner_init": marked("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "__init__"),
        "rejection_sample": marked("vllm.v1.sample.rejection_sampler", None,
                                   "rejection_sample"),
        "recovered_tokens": marked("vllm.v1.sample.rejection_sampler", None,
                                   "sample_recovered_tokens"),
    }))
""")

OURS = {"vllm_lookahead": {"method": "lookahead"}}


def build_worker(additional_config: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(additional_config)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_plain_engines_worker_starts_and_gets_no_runner_patch():
    patched = build_worker({})
    assert not patched["runner_init"] and not patched["rejection_sample"]
    if vllm_support.has_model_runner_v1():
        # the CPU sampling fixes every engine gets (README, "What the plugin changes")
        assert patched["recovered_tokens"]
    else:  # vLLM 0.34: importing V1's runner failed every engine's worker
        assert patched == {"v1_runner_imported": False, "runner_init": None,
                           "rejection_sample": None, "recovered_tokens": None}


def test_an_engine_running_lookahead_gets_the_runner_patches_where_v1_exists():
    patched = build_worker(OURS)
    if vllm_support.has_model_runner_v1():
        assert patched["runner_init"] and patched["rejection_sample"]
    else:  # lookahead is a V2 speculator there: nothing of V1 is attempted
        assert not patched["v1_runner_imported"]
