"""The tree step's start-up self-check on a real model (trees on), for
``scripts/gpu_validate.sh tree-check``: exit status 0 if it passed on every worker; where
it fails, trees ``on`` refuse to start, with the verdict (the comparison that differed
most, ``worker/tree_check.py``) in the error.
The engine has CUDA graphs and torch.compile, as vLLM runs by default (the check once
passed in an eager engine and failed in this one, run (bp)); ``eager`` for the other.

    python scripts/gpu_tree_check.py MODEL_PATH DTYPE [eager]
"""

import sys

from vllm import LLM


def main() -> int:
    llm = LLM(sys.argv[1], dtype=sys.argv[2], enforce_eager=sys.argv[3:] == ["eager"],
              max_model_len=2048,
              kv_cache_memory_bytes=1 << 30,
              speculative_config={"method": "lookahead", "trees": "on"})
    verdicts = llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats.tree_check)
    print("tree_check", sys.argv[2], verdicts, "(1 passed, 0 failed, -1 not run)")
    return 0 if all(verdict == 1 for verdict in verdicts) else 1


if __name__ == "__main__":  # vLLM's engine processes may import this module
    sys.exit(main())
