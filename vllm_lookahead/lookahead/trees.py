"""Tree drafts: the main draft, then the pool's most frequent continuations of the last
token and the target's recycled top-k grown best-first (``tree_candidates``), then
Lookahead Decoding's Jacobi window (``tree_window``), verified in one pass as a token
tree (``worker/tree_step.py``)."""

from __future__ import annotations

import heapq
import itertools
import math
import zlib

import numpy as np

from vllm_lookahead.lookahead.options import LookaheadOptions
from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.tree import TreeBuilder

#: What a tree costs under load, in linear draft tokens: each node off the first chain,
#: and each request with a tree (root block copies, path writes, the kernel reading the
#: prefix once more per branch). benchmarks/README.md, runs (v) and (w), SmolLM2-135M on
#: 2 CPU cores: a draft token ~1.1 ms; a tree of 24 nodes 4-9 ms more than a linear
#: draft of 24.
TREE_NODE_COST = 2
TREE_ROW_COST = 6


def tree_of(state: RequestState | None, scheduled: list[int]) -> np.ndarray | None:
    """Parents of ``[root] + scheduled`` if the request's draft is a tree and vLLM
    scheduled (a prefix of) it; None verifies it as a linear draft."""
    if state is None or state.tree is None:
        return None
    tokens, parents = state.tree
    if tokens[1 : len(scheduled) + 1] != scheduled:
        return None
    return parents[: len(scheduled) + 1]


def grow_trees(rows: list[int], states: list[RequestState], drafts: list[list[int]],
               token_ids_cpu: np.ndarray, num_tokens: np.ndarray, free_tokens: float | None,
               options: LookaheadOptions, max_model_len: int,
               recycled: RecycledTopK | None) -> int:
    """Turn each main draft (in ``drafts``, by row, replaced) into a token tree of at
    most the request's K nodes; returns the nodes added (the caller has reset every
    state's tree: one step's tree never outlives it). Whether the step has trees at
    all is the caller's (``tree_switch.py``); what they may cost is the cost model's
    (``free_tokens``: a step's fixed cost in tokens, None before it has an estimate).
    A lone request's tree adds at most ``free_tokens`` nodes: it never makes the pass
    cost more than twice a one-token pass, so that trying trees where tokens are dear
    costs little. With several requests, trees take only the tokens the cost model says
    are nearly free, each costing ``TREE_ROW_COST`` plus ``TREE_NODE_COST`` per node
    (none before the model has samples), so under load trees shrink to nothing before
    main drafts are cut."""
    alone = len(rows) == 1
    if free_tokens is None:
        spare = math.inf if alone else 0.0
    else:
        spare = free_tokens if alone else free_tokens - sum(len(drafts[row]) + 1 for row in rows)
    row_cost, node_cost = (0, 1) if alone else (TREE_ROW_COST, TREE_NODE_COST)
    nodes_added = 0
    for b, (row, state) in enumerate(zip(rows, states)):
        main = drafts[row]
        nodes = max(0, int(min((spare - row_cost) / node_cost, state.max_draft)))
        cap = min(state.max_draft, max_model_len - int(num_tokens[b]) - 1, len(main) + nodes)
        if not state.tree_ok or cap <= len(main):
            continue
        builder = TreeBuilder(state.pending_token, cap)
        builder.add_chain(main)
        if state.tree_candidates:
            candidates = state.pool.candidates(
                state.pending_token, max(options.guess_set_size, state.tree_candidates))
            candidates.sort(key=lambda item: -item[1])  # stable: newest first on ties
            for continuation, _ in candidates[: state.tree_candidates]:
                builder.add_chain(list(continuation))
            if recycled is not None:
                grow_recycled(builder, recycled, state.tree_candidates * (options.ngram_size - 1),
                              options.ngram_size - 1)
        if state.tree_window:
            _add_window(state, builder, token_ids_cpu[row], int(num_tokens[b]),
                        options.ngram_size)
        added = builder.num_drafted - len(main)
        if not added:
            state.drop_tree()  # the window columns added no node
        else:
            spare -= row_cost + added * node_cost
            nodes_added += added
            state.tree = (builder.tokens, np.array(builder.parents))
            drafts[row] = builder.draft
    return nodes_added


def grow_recycled(builder: TreeBuilder, recycled: RecycledTopK, budget: int,
                  chain_length: int) -> None:
    """Grow the target's recycled top-k below the root, best-first by the product of
    the target's probabilities along the path (Token Recycling's tree, shaped by
    probability instead of a fixed template). Each pick is a chain: the picked token
    and its most likely successors, ``chain_length`` tokens in all, so that the tree
    gains one branch per pick, as with the pool's candidates (every branch is an
    attention sequence of its own, and a step holds scratch blocks for a bounded
    number). At most ``budget`` new nodes; nodes the tree already has (the main
    draft's) are walked through for free."""
    ids, logprobs = recycled.storage
    vocab_size = len(ids)
    order = itertools.count()  # ties: first pushed first
    frontier: list[tuple[float, int, int, int]] = []

    def push_children(node: int, path_logprob: float, skip_first: bool) -> None:
        token = builder.tokens[node]
        if not 0 <= token < vocab_size:
            return
        for rank, (child, logprob) in enumerate(zip(ids[token].tolist(),
                                                    logprobs[token].tolist())):
            if child < 0:
                break
            if rank or not skip_first:
                heapq.heappush(frontier, (-(path_logprob + logprob), next(order), node, child))

    push_children(0, 0.0, skip_first=False)
    node_limit = builder.max_nodes
    builder.max_nodes = min(node_limit, builder.num_drafted + budget)
    for _ in range(4 * budget + recycled.top_k):  # reused nodes cost no budget: bound the walk
        if not frontier or builder.num_drafted >= builder.max_nodes:
            break
        negative_logprob, _, parent, token = heapq.heappop(frontier)
        chain, path_logprobs = [token], [-negative_logprob]
        while len(chain) < chain_length and 0 <= chain[-1] < vocab_size \
                and ids[chain[-1], 0] >= 0:
            path_logprobs.append(path_logprobs[-1] + float(logprobs[chain[-1], 0]))
            chain.append(int(ids[chain[-1], 0]))
        nodes = builder.add_chain(chain, parent=parent)
        for depth, (node, path_logprob) in enumerate(zip(nodes, path_logprobs)):
            # the chain holds each node's first child but the last node's
            push_children(node, path_logprob, skip_first=depth < len(nodes) - 1)
    builder.max_nodes = node_limit


def _add_window(state: RequestState, builder: TreeBuilder, context: np.ndarray,
                num_tokens: int, ngram_size: int) -> None:
    """Add Lookahead Decoding's window as tree nodes: level 0 is a trunk from the
    root (columns 1..W-1, column 0 is the root itself) and below the trunk node of
    each column hang that column's levels 1..N-2, one position further each. The
    window starts as tokens picked from the prompt (seeded by the prompt, so every
    tensor-parallel rank picks the same)."""
    width, levels = state.tree_window, ngram_size - 1
    if state.window is None:
        prompt = context[: state.prompt_len]
        rng = np.random.default_rng(zlib.crc32(prompt.astype(np.int64).tobytes()))
        picks = rng.integers(0, num_tokens, size=(levels, width))
        state.window = [[int(context[i]) for i in level] for level in picks]
    window = state.window
    column_roots = [0, *builder.add_chain(window[0][1:])]
    for column, key_node in enumerate(column_roots):
        nodes = builder.add_chain([window[level][column] for level in range(1, levels)],
                                  parent=key_node)
        if len(nodes) < levels - 1:
            break
        state.window_columns.append((column, key_node, nodes[-1]))


def slide_window(state: RequestState, predictions: list[int]) -> int:
    """One Jacobi iteration of the window: the target's token after each column's
    last level is that column's new last level, and completes an n-gram (the column's
    level-0 token, its levels 1..N-2, the new token) for the pool; the levels move
    up one (the window advances one position per step, as in the paper). Returns the
    n-grams harvested."""
    tokens = state.tree[0]
    window = state.window
    newest = list(window[-1])
    harvested = 0
    for column, key_node, last_node in state.window_columns:
        if last_node >= len(predictions):  # vLLM scheduled fewer nodes
            continue
        newest[column] = predictions[last_node]
        continuation = tuple(level[column] for level in window[1:]) + (newest[column],)
        state.pool.add(tokens[key_node], continuation)
        harvested += 1
    state.window = [*window[1:], newest]
    return harvested
