"""Where a sampled step's time goes under load: 48 MT-Bench first turns, 16 at a time."""
import os, sys, json, time
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
from benchmarks import cpu_env
cpu_env.configure_cpu_env()
from vllm import LLM, SamplingParams
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "2026-12-03-cpu-2c-smollm2-135m-fp32-sampled-step-breakdown"))
import timing  # run (ee)'s timers
for m, a in [("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),
             ("vllm.v1.sample.sampler", "Sampler.forward"),
             ("vllm.v1.engine.core", "EngineCore.step"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
             ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
             ("vllm.v1.engine.llm_engine", "LLMEngine.step"),
             ("vllm_lookahead.lookahead.proposer", "LookaheadProposer.propose"),
             ("vllm_lookahead.lookahead.learning", "PassLearner.read_pass"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner.plan")]:
    try: timing.wrap(m, a)
    except Exception as e: print("no", a, e)

for m, a in [("vllm_lookahead.worker.sampler", "top_k_logprobs"),
             ("vllm_lookahead.worker.sampler", "capture_verification"),
             ("vllm_lookahead.worker.sampler", "bonus_tokens_only"),
             ("vllm_lookahead.lookahead.proposer", "LookaheadProposer.on_last_top_k"),
             ("vllm_lookahead.lookahead.proposer", "LookaheadProposer.on_step_start"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._check_in_hindsight"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._learn"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._verified_rows"),
             ("vllm_lookahead.lookahead.learning", "PassLearner._calibrate"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner.step_plan"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner._main_drafts"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner._remember"),
             ("vllm_lookahead.lookahead.planning", "DraftPlanner._draft_bounds"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut.apply"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut._estimates"),
             ("vllm_lookahead.lookahead.cut", "CostAwareCut.may_keep_any"),
             ("vllm_lookahead.lookahead.state", "RequestStates.decoding"),
             ("vllm_lookahead.lookahead.budget", "WorkerEstimates.decay"),
             ("vllm_lookahead.lookahead.sources.drafts", "DraftSources.draft"),
             ("vllm.v1.sample.rejection_sampler", "RejectionSampler.parse_output"),
             ("vllm.v1.sample.rejection_sampler", "RejectionSampler.apply_logits_processors"),
             ("vllm.v1.sample.sampler", "Sampler.sample"),
             ("vllm.v1.sample.sampler", "Sampler.apply_logits_processors"),
             ("vllm.v1.sample.sampler", "Sampler.compute_logprobs"),
             ("vllm.v1.sample.ops.topk_topp_sampler", "TopKTopPSampler.forward"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
             ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._calc_spec_decode_metadata"),
             ]:
    try: timing.wrap(m, a)
    except Exception as e: print("no", a, e)
def step_key(self, so, *a, **k):
    drafts = sum(len(v) for v in (so.scheduled_spec_decode_tokens or {}).values())
    reqs = len(so.num_scheduled_tokens)
    prefill = so.total_num_scheduled_tokens > reqs + drafts
    b = "0" if drafts == 0 else "1-2" if drafts <= 2 else "3-6" if drafts <= 6 else "7+"
    return f"[{'P' if prefill else 'D'} reqs={min(reqs // 4 * 4, 16):2d} drafts={b}]"
timing.wrap_keyed("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", step_key)
timing.wrap_keyed("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward", lambda self, md, *a, **k: f"[drafts={min(int(md.max_spec_len),3)}]")
for fn in ["rejection_sample", "sample_recovered_tokens", "compute_probs", "apply_sampling_constraints"]:
    try: timing.wrap("vllm.v1.sample.rejection_sampler", fn)
    except Exception as e: print("no", fn, e)
MODEL = os.path.expanduser("~/.cache/vllm-lookahead/models/smollm2-135m/hf")
temperature = float(sys.argv[1]); top_p = float(sys.argv[2])
config = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
llm = LLM(MODEL, dtype="float32", enforce_eager=True, max_model_len=4096, seed=0, max_num_seqs=16,
          kv_cache_memory_bytes=1 << 30,
          speculative_config=None if config.get("method")=="none" else ({"method": "lookahead", **config} if "method" not in config else config))
tok = llm.get_tokenizer()
qs = [l for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3, "data", "mt_bench_question.jsonl"))][:48]
prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(q)["turns"][0]}],
                                   add_generation_prompt=True, tokenize=False) for q in qs]
params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:16], SamplingParams(temperature=temperature, max_tokens=16), use_tqdm=False)
timing.T.clear(); timing.N.clear()
t = time.perf_counter()
out = llm.generate(prompts, params, use_tqdm=False)
el = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in out)
timing.report(); timing.T.clear()
print(f"RESULT {config.get('method', 'lookahead')} T={temperature} tokens {n} in {el:.1f}s = {n/el:.1f} tok/s")
if config.get("method") not in ("none", "suffix", "ngram"):
    st = llm.collective_rpc(lambda w: w.model_runner.drafter.stats)[0]
    print(f"passes {st.request_passes} S {st.generated_tokens/max(st.request_passes,1):.3f} drafts {st.drafts} draft_tokens {st.draft_tokens} cut {st.cut_tokens} undrafted {st.undrafted_steps}")
    rows = llm.collective_rpc(lambda w: w.model_runner.drafter.cost_model.by_token_count())[0]
    for r in rows[:40]:
        print(f"  n={r['tokens']:3d} passes={r['passes']:4d} mean={r['mean']*1e3:6.2f} quiet={r['quiet']*1e3:6.2f} curve={r['curve']*1e3:6.2f}")
