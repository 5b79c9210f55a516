"""MTAD's joint acceptance rule (``mtad/acceptance.py``) against its formula, linear and
over trees (no model)."""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_lookahead.mtad.acceptance import joint_accept

# -- the acceptance rule against the formula -------------------------------------------


def reference_accepted(target_probs, draft, draft_logq, threshold):
    """Longest d with sum_{t<=d} log p(x_t) - log q(x_t) > log threshold (0 if none)."""
    accepted, total = 0, 0.0
    for depth, token in enumerate(draft):
        p = target_probs[depth][token]
        total += (math.log(p) if p > 0 else -math.inf) - draft_logq[depth]
        if total > math.log(threshold):
            accepted = depth + 1
    return accepted


def run_rule(rows, threshold=0.5, greedy_rows=None, bonus=None):
    """rows: (target probability rows [n, V], draft [n], draft log q [n]) per request."""
    probs = torch.tensor([p for r in rows for p in r[0]], dtype=torch.float64)
    logits = probs.clamp_min(1e-30).log().float()
    drafts = torch.tensor([t for r in rows for t in r[1]])
    logq = torch.tensor([v for r in rows for v in r[2]])
    counts = [len(r[1]) for r in rows]
    bonus = torch.tensor(bonus or [99] * len(rows))
    return joint_accept(drafts, counts, max(counts), logits, bonus, logq,
                        greedy_rows or [False] * len(rows), threshold).tolist()


P = [0.1, 0.2, 0.3, 0.4]


def test_a_failing_prefix_does_not_stop_a_longer_passing_one():
    # ratios: log(0.1/0.4) = -1.39 (fails log 0.5), then +log(0.4/0.1): total 0 (passes)
    rows = [([P, P, [0, 0, 0, 1.0]], [0, 3, 1], [math.log(0.4), math.log(0.1), 0.0])]
    # depth 3: p = 0 for token 1: fails; the token after depth 2 is sampled from p: 3
    assert reference_accepted(rows[0][0], rows[0][1], rows[0][2], 0.5) == 2
    assert run_rule(rows) == [[0, 3, 3, -1]]


def test_all_fail_gives_one_token_sampled_from_the_target():
    rows = [([[0, 0, 1.0, 0], P], [0, 1], [math.log(0.9), math.log(0.9)])]
    assert run_rule(rows) == [[2, -1, -1]]


def test_all_pass_keeps_the_bonus_token():
    rows = [([P, P, P], [3, 3, 2], [math.log(0.4), math.log(0.4), math.log(0.3)])]
    assert run_rule(rows, bonus=[7]) == [[3, 3, 2, 7]]


def test_greedy_rows_accept_the_longest_argmax_prefix_only():
    # the joint ratio would pass (q tiny), but the second token is not the argmax
    rows = [([P, P, P], [3, 0, 3], [-9.0, -9.0, -9.0]),
            ([P, P], [3, 1], [math.log(0.4), math.log(0.2)])]
    assert run_rule(rows, greedy_rows=[True, False]) == [[3, 3, -1, -1], [3, 1, 99, -1]]


def test_random_cases_match_the_formula():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        probs = rng.dirichlet(np.full(6, 0.5), size=n).tolist()
        draft = rng.integers(0, 6, size=n).tolist()
        logq = np.log(rng.uniform(0.05, 1.0, size=n)).tolist()
        threshold = float(rng.uniform(0.1, 1.0))
        expected = reference_accepted(probs, draft, logq, threshold)
        output = run_rule([(probs, draft, logq)], threshold=threshold)[0]
        assert output[:expected] == draft[:expected]
        assert output[expected] != -1 and all(t == -1 for t in output[expected + 1:])
        if expected < n:  # the extra token is one the target can sample there
            assert probs[expected][output[expected]] > 0


def run_tree_rule(after, tokens, parents, logq, threshold=0.5, greedy_row=False, bonus=99):
    """One tree row: ``after[i]`` is the target's distribution after node i (root 0)."""
    logits = torch.tensor(after, dtype=torch.float64).clamp_min(1e-30).log().float()
    return joint_accept(torch.tensor(tokens), [len(tokens)], len(tokens), logits,
                        torch.tensor([bonus]), torch.tensor(logq), [greedy_row], threshold,
                        parents=[np.array(parents)]).tolist()[0]


def reference_tree_path(after, tokens, parents, logq, threshold):
    """Nodes of the longest passing prefix over all root-to-leaf paths (first on ties)."""
    best = []
    for leaf in range(1, len(parents)):
        if leaf in parents:
            continue
        path = [leaf]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        path.reverse()
        depth = reference_accepted([after[parents[c]] for c in path],
                                   [tokens[c - 1] for c in path],
                                   [logq[c - 1] for c in path], threshold)
        if depth > len(best):
            best = path[:depth]
    return best


def test_a_tree_takes_the_path_with_the_longest_passing_prefix():
    # root -> 1 (token 0) -> 2 (token 1); root -> 3 (token 2) -> 4 (token 3)
    parents, tokens = [-1, 0, 1, 0, 3], [0, 1, 2, 3]
    after = [[0.5, 0.1, 0.3, 0.1], [0.05, 0.05, 0.45, 0.45], P, [0.1, 0.1, 0.2, 0.6]]
    logq = [math.log(0.5), math.log(0.5), math.log(0.3), math.log(0.5)]
    # path 1-2 passes at depth 1 only (0.05 / 0.5); path 3-4 at depth 2: it wins, and as
    # node 4 is the last node, vLLM's bonus token follows
    assert reference_tree_path(after, tokens, parents, logq, 0.5) == [3, 4]
    assert run_tree_rule(after, tokens, parents, logq) == [2, 3, 99, -1, -1]
    # greedy: the argmax path only (token 0, then token 2 is no child of node 1)
    assert run_tree_rule(after, tokens, parents, logq, greedy_row=True) == [0, 2, -1, -1, -1]


def test_random_trees_match_the_formula():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        parents = [-1] + [int(rng.integers(0, c)) for c in range(1, n + 1)]
        after = rng.dirichlet(np.full(6, 0.5), size=n).tolist()
        tokens = rng.integers(0, 6, size=n).tolist()
        logq = np.log(rng.uniform(0.05, 1.0, size=n)).tolist()
        threshold = float(rng.uniform(0.1, 1.0))
        path = reference_tree_path(after, tokens, parents, logq, threshold)
        output = run_tree_rule(after, tokens, parents, logq, threshold)
        assert output[:len(path)] == [tokens[c - 1] for c in path]
        assert output[len(path)] != -1 and all(t == -1 for t in output[len(path) + 1:])
        end = path[-1] if path else 0
        if end < n:  # the extra token is one the target can sample after the last node
            assert after[end][output[len(path)]] > 0
        else:
            assert output[len(path)] == 99
