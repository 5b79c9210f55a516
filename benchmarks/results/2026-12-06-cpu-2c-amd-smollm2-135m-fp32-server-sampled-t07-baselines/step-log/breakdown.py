"""Where a sampled step's time goes under load (issue 73): timers around vLLM's and the
proposer's step functions, in one process, SmolLM2-135M float32, 64 MT-Bench first turns
of 128 tokens submitted BATCH at a time (16 unless set).

    # from the repository root
    VLLM_ENABLE_V1_MULTIPROCESSING=0 BATCH=16 .venv/bin/python RUN_FOLDER/step-log/breakdown.py T TOP_P [CONFIG]

CONFIG: {"method": "none"}, {} (lookahead's defaults) or a whole speculative_config."""
import os, sys, json
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
sys.path.insert(0, ".")  # from the repository root
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams
sys.path.insert(0, "benchmarks/results/2026-12-03-cpu-2c-smollm2-135m-fp32-sampled-step-breakdown"); import timing  # its timers
for m, a in [("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),

             ("vllm.v1.engine.core", "EngineCore.step"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
             ("vllm.v1.engine.llm_engine", "LLMEngine.step")]:
    try: timing.wrap(m, a)
    except Exception as e: print("no", a, e)
for m, a in [("vllm_lookahead.lookahead.learning", "PassLearner.read_pass"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._check_in_hindsight"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._learn"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._verified_rows"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner.plan"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner.step_plan"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner._main_drafts"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner._remember"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut.apply"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut._estimates"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut.may_keep_any"),
             ("vllm_lookahead.lookahead.budget", "cut_to_budget"),
             ("vllm_lookahead.lookahead.state", "RequestStates.decoding"),
             ("vllm_lookahead.lookahead.budget", "WorkerEstimates.decay"),
             ("vllm_lookahead.lookahead.proposer", "LookaheadProposer.propose"),
             ("vllm_lookahead.lookahead.proposer", "LookaheadProposer.on_step_start"),
             ("vllm_lookahead.lookahead.sources.drafts", "DraftSources.draft")]:
    try: timing.wrap(m, a)
    except Exception as e: print("no", a, e)
timing.wrap_keyed("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward", lambda self, md, *a, **k: f"[drafts={min(int(md.max_spec_len),3)}]")
timing.wrap_keyed("vllm.v1.sample.sampler", "Sampler.forward", lambda self, *a, **k: "[bonus]" if k.get("predict_bonus_token") else "[plain]")
for fn in ["rejection_sample", "apply_sampling_constraints", "generate_uniform_probs", "sample_recovered_tokens", "compute_probs"]:
    try: timing.wrap("vllm.v1.sample.rejection_sampler", fn)
    except Exception as e: print("no", fn, e)

MODEL = "/root/.cache/vllm-lookahead/models/smollm2-135m/hf"
temperature = float(sys.argv[1]); top_p = float(sys.argv[2])
config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0,
          kv_cache_memory_bytes=1 << 30,
          speculative_config=None if config.get("method")=="none" else ({"method": "lookahead", **config} if "method" not in config else config))
tok = llm.get_tokenizer()
qs = [l for l in open("benchmarks/data/mt_bench_question.jsonl")][:64]
prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(q)["turns"][0]}],
                                   add_generation_prompt=True, tokenize=False) for q in qs]
params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=128, ignore_eos=True)
BATCH = int(os.environ.get('BATCH', '16'))
import time
t = time.perf_counter(); n = 0
llm.generate(prompts[:2], params, use_tqdm=False)
timing.T.clear(); timing.N.clear()
t = time.perf_counter()
for i in range(0, 64, BATCH):
    out = llm.generate(prompts[i:i + BATCH], params, use_tqdm=False)
    n += sum(len(o.outputs[0].token_ids) for o in out)
el = time.perf_counter() - t
if config.get("method") in ("none", "suffix"):
    timing.report(); timing.T.clear()
    print(f"{config.get('method')} T={temperature} tokens {n} in {el:.1f}s = {n/el:.1f} tok/s"); sys.exit()
rows = llm.collective_rpc(lambda w: w.model_runner.drafter.cost_model.by_token_count())[0]
st = llm.collective_rpc(lambda w: w.model_runner.drafter.stats)[0]
print(f"T={temperature} tokens {n} in {el:.1f}s = {n/el:.1f} tok/s; passes {st.request_passes} S {st.generated_tokens/max(st.request_passes,1):.2f} drafts {st.drafts} draft_tokens {st.draft_tokens} cut {st.cut_tokens}")
for r in rows[:12]:
    print(f"  n={r['tokens']:3d} passes={r['passes']:4d} mean={r['mean']*1e3:6.2f} quiet={r['quiet']*1e3:6.2f} curve={r['curve']*1e3:6.2f}")
