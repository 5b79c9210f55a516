"""Profile one offline burst of 64 HumanEval prompts (engine in-process)."""
import os, sys, time, cProfile, pstats
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from benchmarks import datasets as prompt_sets
from benchmarks.models import fetch

method = sys.argv[1]
path = str(fetch("smollm2-135m"))
spec = None if method == "none" else {"method": "lookahead"}
llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
          speculative_config=spec, kv_cache_memory_bytes=1 << 30)
prompter = prompt_sets.ChatPrompter(path)
samples = prompt_sets.load("humaneval", 64)
prompts = [{"prompt_token_ids": prompter.prompt(s, [])} for s in samples]
params = SamplingParams(temperature=0, max_tokens=64)
llm.generate(prompts[:4], params, use_tqdm=False)
prof = cProfile.Profile()
t = time.perf_counter()
prof.enable()
out = llm.generate(prompts, params, use_tqdm=False)
prof.disable()
print("WALL", time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in out))
prof.dump_stats(f"prof-{method}.pstats")
st = pstats.Stats(prof); st.sort_stats("tottime").print_stats(35)
