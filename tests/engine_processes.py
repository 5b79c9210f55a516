"""Where the tests' engines run: in pytest's own process or in vLLM's default processes
(``VLLM_ENABLE_V1_MULTIPROCESSING``), switched per test file by conftest.py."""

from __future__ import annotations

import contextlib
import os
import sys

_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
_USERS_MULTIPROCESSING = os.environ.get(_MULTIPROCESSING)
_CORES = os.sched_getaffinity(0)


def run_engines_in_this_process(in_process: bool) -> None:
    """Engines started from now on in this process, or in their own (vLLM's default).

    vLLM caches its environment variables once an engine core starts in the process:
    the cache is dropped for the setting to be read again. vLLM 0.26's in-process CPU
    worker binds this thread to a core, which processes started later (servers, Ray)
    would inherit: the cores are given back. An engine core's shutdown tears down its
    process's torch.distributed groups (``cleanup_dist_env_and_memory``), which here are
    those of every in-process engine of tensor parallel 1 (at 2 the ranks are processes
    of their own), and engines live side by side (module fixtures, the session's plain
    references): the groups outlive each engine instead and the next one reuses them
    (vLLM's own teardown in a user's process is test_in_process.py's)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    os.sched_setaffinity(0, _CORES)
    if in_process:
        import gc

        from vllm.v1.engine import core

        core.cleanup_dist_env_and_memory = lambda *args, **kwargs: gc.collect()
        os.environ[_MULTIPROCESSING] = "0"
    elif _USERS_MULTIPROCESSING is None:
        os.environ.pop(_MULTIPROCESSING, None)
    else:
        os.environ[_MULTIPROCESSING] = _USERS_MULTIPROCESSING


@contextlib.contextmanager
def engines_in_this_process():
    """Engines started inside run in this process, whatever the test file's setting."""
    was_in_process = os.environ.get(_MULTIPROCESSING) == "0"
    run_engines_in_this_process(True)
    try:
        yield
    finally:
        run_engines_in_this_process(was_in_process)
