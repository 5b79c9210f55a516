"""A way to drive vLLM's Ray executor without a GPU, for tests/test_ray.py only.

vLLM's Ray executors ask Ray for one ``{current_platform.ray_device_key: 1}`` bundle per
worker and refuse a platform without a key; the CPU platform has none. With this
directory on ``PYTHONPATH`` every Python process that imports ``vllm.platforms.cpu``
(the server, the engine core, each Ray worker) gives the CPU platform the key ``"GPU"``,
which the test's Ray cluster offers as logical GPUs (``ray start --num-gpus``): Ray then
places one worker per logical GPU. Nothing else changes; the workers compute on CPU.
Python imports ``sitecustomize`` at start-up, so Ray's own processes load this too: it
only watches imports, and costs nothing where vLLM is never imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "vllm.platforms.cpu"


def give_cpu_platform_a_ray_key(module) -> None:
    module.CpuPlatform.ray_device_key = "GPU"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``TARGET`` through the other finders and patches it once executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            give_cpu_platform_a_ray_key(module)

        spec.loader.exec_module = exec_module
        return spec


if TARGET in sys.modules:
    give_cpu_platform_a_ray_key(sys.modules[TARGET])
else:
    sys.meta_path.insert(0, _PatchAfterImport())
