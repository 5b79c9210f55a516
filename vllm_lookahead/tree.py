"""Token trees: several candidate continuations verified in one forward pass.

vLLM schedules a draft as a flat token list after the request's last token. A tree
draft is that list in topological order (every node after its parent) with a parent
per node; node 0 is the root, the last context token, which vLLM feeds as the first
scheduled token. ``worker/tree_step.py`` gives each node the position of its depth and lets it
attend only to its ancestors, then walks the tree with the target's predictions.
A prefix of a topological order is again a tree, so vLLM may shorten the list.
"""

from __future__ import annotations

import numpy as np


class TreeBuilder:
    """A trie of chains hanging from the root: chains sharing a prefix share nodes,
    so each node's children have distinct tokens and a walk by tokens is unique."""

    def __init__(self, root_token: int, max_nodes: int):
        self.tokens = [root_token]
        self.parents = [-1]
        self._children: list[dict[int, int]] = [{}]
        self.max_nodes = max_nodes  # drafted nodes, the root not counted

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    def add_chain(self, tokens: list[int], parent: int = 0) -> list[int]:
        """Hang ``tokens`` below ``parent``, reusing existing nodes; returns the node of
        each token, shorter if the node budget runs out."""
        nodes = []
        for token in tokens:
            child = self._children[parent].get(token)
            if child is None:
                if self.num_drafted == self.max_nodes:
                    break
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(parent)
                self._children.append({})
                self._children[parent][token] = child
            nodes.append(child)
            parent = child
        return nodes

    @property
    def draft(self) -> list[int]:
        """The tokens vLLM schedules (the root excluded)."""
        return self.tokens[1:]


def depths_of(parents: np.ndarray) -> np.ndarray:
    depths = np.zeros(len(parents), dtype=np.int64)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return depths


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """``mask[i, j]``: node j is node i or one of its ancestors."""
    size = len(parents)
    mask = np.eye(size, dtype=bool)
    for node in range(1, size):
        mask[node] |= mask[parents[node]]
    return mask


def is_chain(parents: np.ndarray) -> bool:
    """Every node's parent is the node before it: the tree is a linear draft."""
    return bool(np.array_equal(parents[1:], np.arange(len(parents) - 1)))


def first_chain(parents: np.ndarray) -> np.ndarray:
    """Parents of the tree's first chain: the root and the nodes each the child of the
    node before it (what a linear verification of the flat draft can judge)."""
    length = 1
    while length < len(parents) and parents[length] == length - 1:
        length += 1
    return np.arange(-1, length - 1)


def accepted_path(parents: np.ndarray, tokens: list[int], predictions: list[int]
                  ) -> list[int]:
    """Nodes accepted from the root down: at each node, the child whose token the target
    predicted there (``predictions[node]``), until none is. ``tokens[0]`` is the root."""
    children = _children(parents, tokens)
    path, node = [], 0
    while (child := children.get((node, predictions[node]))) is not None:
        path.append(child)
        node = child
    return path


def path_by_tokens(parents: np.ndarray, tokens: list[int], emitted: list[int]) -> list[int]:
    """Nodes of the path that emitted ``emitted``: its accepted tokens, then the bonus
    token, which is no node."""
    children = _children(parents, tokens)
    path, node = [], 0
    for token in emitted[:-1]:
        child = children.get((node, token))
        if child is None:
            break
        path.append(child)
        node = child
    return path


def _children(parents: np.ndarray, tokens: list[int]) -> dict[tuple[int, int], int]:
    return {(int(parents[node]), tokens[node]): node for node in range(1, len(parents))}
