"""Time a sampled step's parts keyed by the step's scheduled tokens (1 = undrafted)."""
import os, sys, json, time, collections, functools, importlib
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams
T = collections.defaultdict(float); N = collections.Counter(); CUR = [0]
def wrap(modname, attr_path, setter=False):
    mod = importlib.import_module(modname)
    *owners, name = attr_path.split(".")
    obj = mod
    for o in owners: obj = getattr(obj, o)
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def timed(*a, **k):
        if setter:
            so = a[1]; CUR[0] = int(so.total_num_scheduled_tokens); CUR[0] = CUR[0] if CUR[0] <= 8 else 99
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally:
            key = f"{attr_path}[n={CUR[0]}]"; T[key] += time.perf_counter() - t; N[key] += 1
    setattr(obj, name, timed)
wrap("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", setter=True)
for m, a in [("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
             ("vllm.v1.sample.sampler", "Sampler.forward"),
             ("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward"),
             ("vllm.v1.engine.core", "EngineCore.step"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
             ("vllm.v1.engine.llm_engine", "LLMEngine.step")]:
    try: wrap(m, a)
    except Exception as e: print("no", a, e)
for fn in ["rejection_sample", "apply_sampling_constraints", "generate_uniform_probs", "sample_recovered_tokens", "compute_probs"]:
    try: wrap("vllm.v1.sample.rejection_sampler", fn)
    except Exception as e: print("no", fn, e)
MODEL = "/root/.cache/vllm-lookahead/models/smollm2-135m/hf"
temperature = float(sys.argv[1]); top_p = float(sys.argv[2])
config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
          kv_cache_memory_bytes=1 << 30,
          speculative_config=None if config.get("method")=="none" else ({"method": "lookahead", **config} if "method" not in config else config))
tok = llm.get_tokenizer()
qs = [l for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "mt_bench_question.jsonl"))][:8]
prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(q)["turns"][0]}],
                                   add_generation_prompt=True, tokenize=False) for q in qs]
params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=256)
T.clear(); N.clear()
t = time.perf_counter(); n = 0
for p in prompts:
    out = llm.generate([p], params, use_tqdm=False)
    n += len(out[0].outputs[0].token_ids)
el = time.perf_counter() - t
print(f"T={temperature} tokens {n} in {el:.1f}s = {n/el:.1f} tok/s")
for k in sorted(T):
    print(f"TIMING {k:60s} n={N[k]:6d} {T[k]/max(N[k],1)*1e3:7.3f} ms")
