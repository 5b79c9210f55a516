"""vllm-lookahead: draft-free speculative decoding methods for vLLM.

Importing the package registers them in this process (vLLM also loads it through
the ``vllm.general_plugins`` entry point in every process it starts), which makes
the legacy ``LLM(..., speculative_model="[lookahead]")`` spelling work.
"""

from vllm_lookahead.plugin import register

__version__ = "0.1.0"

register()
