"""Log every timed decode step (requests, scheduled tokens, seconds) of lookahead under a
queue of sampled requests (max_num_seqs 16, more prompts than that), one process."""
import os, sys, json, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, ".")  # from the repository root
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams
from vllm_lookahead.lookahead import proposer as P
if os.environ.get("V"): sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import hackv
LOG = []
orig = P.LookaheadProposer.on_step_start
def on_step_start(self, num_scheduled_tokens, decode_only, num_requests=0):
    now = self.clock()
    if self._step_start is not None and decode_only:
        s, n, r = self._step_start
        LOG.append((r, n, now - s))
    return orig(self, num_scheduled_tokens, decode_only, num_requests)
P.LookaheadProposer.on_step_start = on_step_start
MODEL = "/root/.cache/vllm-lookahead/models/smollm2-135m/hf"
T = float(sys.argv[1]); TOPP = float(sys.argv[2]); N = int(sys.argv[3]); out = sys.argv[4]
cfg = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, max_num_seqs=16,
          kv_cache_memory_bytes=1 << 30, speculative_config={"method": "lookahead", **cfg})
tok = llm.get_tokenizer()
qs = [json.loads(l)["turns"][0] for l in open("benchmarks/data/mt_bench_question.jsonl")]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in qs][:N]
import random
rng = random.Random(0)
params = [SamplingParams(temperature=T, top_p=TOPP, max_tokens=rng.choice([48, 64, 96, 128]), ignore_eos=True, seed=None, extra_args=({"lookahead_num_speculative_tokens": 0} if os.environ.get("K0") else None)) for _ in prompts]
llm.generate(prompts[:4], params[:4], use_tqdm=False)
LOG.clear()
t = time.perf_counter()
o = llm.generate(prompts, params, use_tqdm=False)
el = time.perf_counter() - t
n = sum(len(x.outputs[0].token_ids) for x in o)
d = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter
st = d.stats
print(f"{n} tokens {el:.1f}s {n/el:.1f} tok/s baseline_steps {st.baseline_steps} undrafted {st.undrafted_steps} S {st.generated_tokens/max(st.request_passes,1):.3f} drafted tokens {st.draft_tokens} cut {st.cut_tokens} steps {st.steps} propose {st.seconds/st.steps*1e3:.2f} ms")
json.dump({"log": LOG, "curve": d.cost_model.by_token_count(), "baselines": {k: list(v) for k, v in d.cost_model._baselines.items()}}, open(out, "w"))
