import json, sys
from vllm import LLM, SamplingParams
llm = LLM("/tmp/models/SmolLM2-135M-Instruct", dtype="bfloat16", max_model_len=4096,
          kv_cache_memory_bytes=1 << 32, speculative_config={"method": "lookahead", "trees": "off"})
prompts = [f"def function_{i}(x):\n    \"\"\"Return the sum of the first {i} squares of x.\"\"\"\n" for i in range(6)]
for p in prompts:
    llm.generate([p], SamplingParams(max_tokens=200, temperature=0))
def probe(worker):
    d = worker.model_runner.drafter
    u = d._uniform
    keys = worker.model_runner.cudagraph_dispatcher.cudagraph_keys
    return {"graph_requests": u.graph_requests, "mean": u._mean_seconds[:3].tolist(), "timed": u._timed[:3].tolist(),
            "filled": d._stats.filled_steps, "keys": {str(k): [str(x) for x in list(v)[:3]] + [len(v)] for k, v in keys.items()}}
print(json.dumps(llm.collective_rpc(probe), default=str)[:3000])
