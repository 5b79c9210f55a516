"""Per-step log of the cut, offline 64 HumanEval at once (diagnostic)."""
import os, sys, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import numpy as np
from vllm import LLM, SamplingParams
from benchmarks import datasets as prompt_sets
from benchmarks.models import fetch

dataset = sys.argv[1] if len(sys.argv) > 1 else "humaneval"
path = str(fetch("smollm2-135m"))
llm = LLM(path, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
          speculative_config={"method": "lookahead"}, max_num_seqs=64)
import vllm_lookahead.lookahead.cut as cutmod
log = []
orig_apply = cutmod.CostAwareCut.apply
orig_worths = cutmod.accepted_token_worths
cur = {}
def worths(steps_to_go, step_cost, draining):
    w = orig_worths(steps_to_go, step_cost, draining)
    cur.update(R=len(steps_to_go), draining=draining, w_min=float(w.min()), n_low=int((w < 0.8).sum()),
               step=float(step_cost(np.array([len(steps_to_go)]))[0]), half=float(step_cost(np.array([len(steps_to_go)//2]))[0]))
    return w
cutmod.accepted_token_worths = worths
def apply(self, main, states, num_tokens, plan, tokens_left, draining):
    cur.clear()
    proposed = sum(len(d.tokens) for d in main)
    orig_apply(self, main, states, num_tokens, plan, tokens_left, draining)
    kept = sum(len(d.tokens) for d in main)
    import time
    R = len(states)
    cm = self._cost_model
    if cm._count < 32:
        cur.update(cnt=int(cm._count), last=[(int(a), round(float(b)*1e3)) for a, b in zip(cm._tokens[max(0,cm._count-3):cm._count], cm._seconds[max(0,cm._count-3):cm._count])], prior=[round(x*1e3,2) for x in cm._prior])
    if plan.step_cost is not None:
        c = plan.step_cost(np.array([R, R + 20, R + 50, R + 100]))
        cur.update(m20=float(c[1]-c[0])/20*1e3, m50=float(c[2]-c[0])/50*1e3, m100=float(c[3]-c[0])/100*1e3)
    log.append(dict(cur, t=time.perf_counter(), proposed=proposed, kept=kept, fill=plan.fill, free=plan.free_tokens,
                    curve=plan.step_cost is not None))
cutmod.CostAwareCut.apply = apply

prompter = prompt_sets.ChatPrompter(path)
samples = prompt_sets.load(dataset, 64)
prompts = [{"prompt_token_ids": prompter.prompt(s, [])} for s in samples]
params = SamplingParams(temperature=0, max_tokens=64)
llm.generate(prompts[:4], params, use_tqdm=False)
log.clear()
llm.generate(prompts, params, use_tqdm=False)
for i, entry in enumerate(log):
    print(i, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in entry.items()}))
