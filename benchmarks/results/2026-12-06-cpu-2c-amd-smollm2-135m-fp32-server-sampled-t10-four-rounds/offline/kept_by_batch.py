"""Which steps keep draft tokens under load at T 1.0: requests in the step, kept tokens, and what the cost curve charged."""
import os, sys, json, time, collections
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
import numpy as np
from vllm import LLM, SamplingParams
from vllm_lookahead.lookahead import cut as C
REC = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])  # requests -> steps, kept tokens, sum t(N+1)-t(N), sum t(N)
orig = C.CostAwareCut.apply
def apply(self, main, states, num_tokens, plan):
    r = orig(self, main, states, num_tokens, plan)
    n = len(states); k = sum(len(d.tokens) for d in main)
    rec = REC[n]; rec[0] += 1; rec[1] += k
    if plan.step_cost is not None:
        t = plan.step_cost(np.array([n, n + 1]))
        rec[2] += t[1] - t[0]; rec[3] += t[0]
    return r
C.CostAwareCut.apply = apply
MODEL = os.path.expanduser("~/.cache/vllm-lookahead/models/smollm2-135m/hf")
llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, max_num_seqs=16,
          kv_cache_memory_bytes=1 << 30, speculative_config={"method": "lookahead"})
tok = llm.get_tokenizer()
qs = [l for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3, "data", "mt_bench_question.jsonl"))][:80]
prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(q)["turns"][0]}], add_generation_prompt=True, tokenize=False) for q in qs]
out = llm.generate(prompts, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=96), use_tqdm=False)
for n in sorted(REC):
    s, k, dt, t = REC[n]
    print(f"requests {n:2d}: steps {s:4d} kept {k:4d} ({k/s:.2f}/step)  curve t(N) {t/s*1e3:6.2f} ms, t(N+1)-t(N) {dt/s*1e3:5.2f} ms")
rows = llm.collective_rpc(lambda w: w.model_runner.drafter.cost_model.by_token_count())[0]
for r in rows[:40]:
    print(f"  n={r['tokens']:3d} passes={r['passes']:4d} mean={r['mean']*1e3:6.2f} quiet={r['quiet']*1e3:6.2f} curve={r['curve']*1e3:6.2f}")
