"""Lookahead with and without rests, one fresh engine each, on the same greedy load (MT-Bench first turns)."""
import os, sys, json, time
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4)
sys.path.insert(0, ROOT)
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams
from vllm_lookahead.lookahead import rests
MODEL = os.path.expanduser("~/.cache/vllm-lookahead/models/smollm2-135m/hf")
seqs = int(sys.argv[1]); assert sys.argv[2] == "mt_bench"; temp = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
rows = [json.loads(l) for l in open(os.path.join(ROOT, "benchmarks", "data", "mt_bench_question.jsonl"))]
order = [("rests", rests.MAX_REST_STEPS), ("no-rests", 0)]
for name, max_rest in order:
    llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, max_num_seqs=seqs,
              kv_cache_memory_bytes=1 << 30, speculative_config={"method": "lookahead"})
    tok = llm.get_tokenizer()
    texts = [r["turns"][0] for r in rows][:64]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False) for t in texts]
    rests.MAX_REST_STEPS = max_rest
    t = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(temperature=temp, max_tokens=128, seed=None), use_tqdm=False)
    el = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in out)
    st = llm.collective_rpc(lambda w: w.model_runner.drafter.stats)[0]
    print(f"{name}: {n} tokens {el:.1f}s {n/el:.1f} tok/s S {st.generated_tokens/max(st.request_passes,1):.3f} steps {st.steps} resting {st.resting_drafts} draft_tokens {st.draft_tokens} kept exp/matched {st.kept_tokens_expected:.0f}/{st.kept_tokens_matched} proposer {st.seconds/st.steps*1e3:.2f} ms/step", flush=True)
    del llm
    import gc; gc.collect()
