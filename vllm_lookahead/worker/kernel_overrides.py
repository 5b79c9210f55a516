"""vLLM's CPU kernel overrides in a process that has loaded numba.

When a worker starts, vLLM's CPU platform registers C++ stand-ins for its Triton
kernels and points every reference to them at the stand-ins, scanning the objects of
every loaded module (``dispatcher._rebind_kernels``) and reading ``vars(value)`` of
each. llvmlite (numba's, which the proposer loads) keeps ``llvmlite.binding.ffi.lib``,
which answers every attribute, ``__dict__`` included, with a C function wrapper: the
scan raises, and the worker does not start. A worker runs in a fresh process by
default, but with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` it runs in the user's (and, on
vLLM's Ray executor, the actor's) own process, where an earlier lookahead engine or
any import of numba left llvmlite loaded: every later engine failed to start.

| vLLM attribute | patch | why | verified on |
|---|---|---|---|
| ``vllm.triton_utils.dispatcher.register_kernels`` (where it exists) | wrapped | the modules holding an object whose ``vars()`` is no mapping are out of ``sys.modules`` while vLLM scans it (they hold no Triton kernel: the scan could never read them) | 0.32.0 (CPU, in-process engines); 0.26.0 has no such scan; 0.33.0 read |
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from vllm_lookahead import _patching


def install() -> None:
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return
    if hasattr(dispatcher, "register_kernels"):
        _patching.wrap(dispatcher, "register_kernels", _scanning_readable_modules_only)


def _scanning_readable_modules_only(original):
    def register_kernels(*args, **kwargs):
        hidden = unscannable_modules()
        for name in hidden:
            del sys.modules[name]
        try:
            return original(*args, **kwargs)
        finally:
            sys.modules.update(hidden)

    return register_kernels


def unscannable_modules() -> dict[str, ModuleType]:
    """Loaded modules with an object whose ``vars()`` is not a mapping, by name (read as
    vLLM's scan reads them: the instance dict, never a module's ``__getattr__``)."""
    found = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for value in list(namespace.values()):
            if hasattr(value, "__dict__") and not _is_mapping(vars(value)):
                found[name] = module
                break
    return found


def _is_mapping(value: Any) -> bool:
    return callable(getattr(value, "get", None))
