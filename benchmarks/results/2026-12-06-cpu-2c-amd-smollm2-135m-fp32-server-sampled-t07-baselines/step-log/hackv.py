"""steplog.py with a verification overhead V (ms, env V) added to every drafted count."""
import os, numpy as np
from vllm_lookahead.lookahead import cut as C, budget as B
from vllm_lookahead.lookahead.step_cost import CostCurve
V = float(os.environ["V"]) / 1e3
def shifted(curve, R, total):
    n = np.arange(R, R + total + 1, dtype=np.float64)
    s = curve(n); s[1:] += V
    return CostCurve(n, s, curve.slope)
orig_cut, orig_any = C.cut_to_budget, B.any_token_affordable
def cut_to_budget(drafts, estimates, step_cost, max_kept=None):
    return orig_cut(drafts, estimates, shifted(step_cost, len(drafts), sum(map(len, drafts))), max_kept)
def any_token_affordable(bounds, step_cost):
    return orig_any(bounds, shifted(step_cost, len(bounds), int(np.sum(bounds))))
C.cut_to_budget = cut_to_budget
C.any_token_affordable = any_token_affordable
