"""Wrap a vLLM attribute once per process, keeping the original reachable.

Plugins load in every vLLM process and sometimes more than once in the same one,
so every patch must be idempotent; the marker attribute makes it so.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

_MARK = "_vllm_lookahead_patch"


def wrap(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Set ``owner.name = make_wrapper(original)`` unless already done; True if done now.

    Staticmethods stay staticmethods; a property's getter is wrapped.
    """
    raw = inspect.getattr_static(owner, name)
    is_static = isinstance(raw, staticmethod)
    is_property = isinstance(raw, property)
    original = raw.__func__ if is_static else raw.fget if is_property else getattr(owner, name)
    if getattr(original, _MARK, False):
        return False
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, staticmethod(wrapper) if is_static
            else property(wrapper) if is_property else wrapper)
    return True


def replace(owner: Any, name: str, replacement: Callable) -> bool:
    """Set ``owner.name = replacement`` unless already done; True if done now."""
    if getattr(getattr(owner, name), _MARK, False):
        return False
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)
    return True
