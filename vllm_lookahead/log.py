"""Loggers under vLLM's ``vllm`` logger, the only one vLLM configures (level from
``VLLM_LOGGING_LEVEL``, its format and stream): a top-level ``vllm_lookahead`` logger
would print warnings alone, through Python's last resort, and never the INFO lines
that say what the plugin decided at start-up (trees, the self-check, scratch blocks)."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name``, a child of vLLM's."""
    return logging.getLogger(f"vllm.{name}")
