"""none and lookahead engines in one process, taking turns on the same 48 MT-Bench first turns (16 at a time, 128 tokens, T 1.0)."""
import os, sys, json, time
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams

import collections, functools, importlib
T = collections.defaultdict(float); N = collections.Counter(); IDS = {}
def eng(obj):
    return IDS.setdefault(id(obj), len(IDS) // 1)
def wrap(modname, attr_path, keyfn=None):
    mod = importlib.import_module(modname)
    *owners, name = attr_path.split(".")
    obj = mod
    for o in owners: obj = getattr(obj, o)
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def timed(self, *a, **k):
        key = (attr_path, f"{type(self).__name__}#{eng(self)}", keyfn(self, *a, **k) if keyfn else "")
        t = time.perf_counter()
        try: return orig(self, *a, **k)
        finally: T[key] += time.perf_counter() - t; N[key] += 1
    setattr(obj, name, timed)
def drafts(self, so, *a, **k):
    d = sum(len(v) for v in (so.scheduled_spec_decode_tokens or {}).values())
    return "d0" if d == 0 else "d1-2" if d <= 2 else "d3+"
G = "vllm.v1.worker.gpu_model_runner"
wrap(G, "GPUModelRunner.execute_model", drafts)
for f in ["sample_tokens", "_model_forward", "propose_draft_token_ids", "_prepare_inputs", "_update_states", "_bookkeeping_sync", "_sample"]:
    wrap(G, "GPUModelRunner." + f)
wrap("vllm.v1.engine.core", "EngineCore.step")
wrap("vllm.v1.engine.core", "EngineCore.step_with_batch_queue")
wrap("vllm.v1.core.sched.scheduler", "Scheduler.schedule")
wrap("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
wrap("vllm.v1.engine.llm_engine", "LLMEngine.step")
MODEL = os.path.expanduser("~/.cache/vllm-lookahead/models/smollm2-135m/hf")
TEMP = float(sys.argv[1]); ignore_eos = sys.argv[2] == "1"
engines = {name: LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, max_num_seqs=16,
                     kv_cache_memory_bytes=1 << 30, speculative_config=cfg)
           for name, cfg in [("none", None), ("lookahead", {"method": "lookahead"})]}
tok = engines["none"].get_tokenizer()
qs = [l for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3, "data", "mt_bench_question.jsonl"))][:48]
prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(q)["turns"][0]}], add_generation_prompt=True, tokenize=False) for q in qs]
for llm in engines.values():
    llm.generate(prompts[:16], SamplingParams(temperature=TEMP, max_tokens=32), use_tqdm=False)
T.clear(); N.clear()
res = {k: [] for k in engines}
for rnd in range(int(sys.argv[3])):
    for name in (["none", "lookahead"] if rnd % 2 == 0 else ["lookahead", "none"]):
        llm = engines[name]
        t = time.perf_counter()
        out = llm.generate(prompts, SamplingParams(temperature=TEMP, top_p=1.0, max_tokens=128, ignore_eos=ignore_eos, seed=None), use_tqdm=False)
        el = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in out)
        res[name].append(n / el)
        print(f"round {rnd} {name}: {n} tokens {el:.1f}s {n/el:.1f} tok/s", flush=True)
import statistics
r = [a / b for a, b in zip(res["lookahead"], res["none"])]
print("RATIO lookahead/none per round", [round(x, 3) for x in r], "mean", round(statistics.mean(r), 3), "sd", round(statistics.stdev(r), 3))
st = engines["lookahead"].collective_rpc(lambda w: w.model_runner.drafter.stats)[0]
print(f"passes {st.request_passes} S {st.generated_tokens/max(st.request_passes,1):.3f} draft_tokens {st.draft_tokens} cut {st.cut_tokens} undrafted {st.undrafted_steps} kept exp/matched {st.kept_tokens_expected:.0f}/{st.kept_tokens_matched} proposer ms/step {st.seconds/st.steps*1e3:.2f}")

for k in sorted(T, key=lambda k: (k[0], k[1], k[2])):
    print(f"TIMING {k[0]:40s} {k[1]:22s} {k[2]:5s} n={N[k]:6d} {T[k]/N[k]*1e3:8.3f} ms  total {T[k]:.2f}s")
