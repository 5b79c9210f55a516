"""What one verification pass tells the proposer about each request: which of its draft
tokens were accepted, and the target's predictions at every draft position (one
Jacobi iteration), harvested into the request's n-gram pool, and at every input
position, recycled into the worker's top-k table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_lookahead.lookahead.sources.recycled import RecycledTopK
from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.tree import path_by_tokens
from vllm_lookahead.worker.hooks import VerificationCapture


class _OnHost:
    """A capture tensor, copied to the host when first read and then kept."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, host: HostCapture, owner: type | None = None) -> np.ndarray:
        array = getattr(host.capture, self.name).cpu().numpy()
        host.__dict__[self.name] = array  # found before this descriptor from now on
        return array


class HostCapture:
    """A verification capture whose tensors are each copied to the host once, whole,
    when first read: the harvest and recycling read the same draft tokens, and on a GPU
    every copy waits for the device."""

    draft_token_ids = _OnHost()
    target_argmax = _OnHost()
    bonus_token_ids = _OnHost()
    target_top_ids = _OnHost()
    target_top_logprobs = _OnHost()  # float32 (``sampler.top_k_logprobs``)

    def __init__(self, capture: VerificationCapture):
        self.capture = capture
        self.num_draft_tokens = capture.num_draft_tokens
        self.has_top_k = capture.target_top_ids is not None


@dataclass
class Verified:
    """One row of a verification pass: the draft, the target's argmax after each input
    position (``[pending] + draft``, the last one the bonus token) and, if captured,
    the target's top-k ids and log-probabilities at those positions but the last."""

    draft: list[int]
    predictions: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None

    def lattice_after(self, accepted: int, top_k: int
                      ) -> tuple[list[list[int]], list[list[float]]] | None:
        """Columns of ``top_k`` tokens for the tokens after the bonus token: the
        positions past the rejected draft token, where the target predicted with the
        rejected tokens as context (Jacobi guesses); None after a full acceptance or
        without a capture."""
        if self.top_ids is None or accepted + 1 >= len(self.draft):
            return None
        return ([column[:top_k] for column in self.top_ids[accepted + 1 :]],
                [column[:top_k] for column in self.top_logprobs[accepted + 1 :]])


def verified_rows(capture: HostCapture | None, num_rows: int,
                  with_top_k: bool = False) -> dict[int, Verified]:
    """The capture's rows that verified a draft, by input-batch row (``with_top_k``:
    with the captured top-k)."""
    if capture is None or len(capture.num_draft_tokens) != num_rows:  # e.g. a dummy run
        return {}
    drafts = capture.draft_token_ids.tolist()
    argmax = capture.target_argmax.tolist()
    bonus = capture.bonus_token_ids.tolist()
    top_ids = top_logprobs = None
    if with_top_k and capture.has_top_k:
        top_ids = capture.target_top_ids.tolist()
        top_logprobs = capture.target_top_logprobs.tolist()
    rows, offset = {}, 0
    for row, count in enumerate(capture.num_draft_tokens):
        if count:
            end = offset + count
            rows[row] = Verified(
                drafts[offset:end], argmax[offset:end] + [bonus[row]],
                None if top_ids is None else top_ids[offset:end],
                None if top_logprobs is None else top_logprobs[offset:end])
        offset += count
    return rows


def is_our_draft(state: RequestState, verified: list[int]) -> bool:
    """False for a stale capture (the draft verified is not the one proposed)."""
    proposed = state.tree[0][1:] if state.tree else state.draft
    return proposed[: len(verified)] == verified


def accepted_on_and_off_main(state: RequestState, emitted: list[int]) -> tuple[int, int]:
    """Accepted tokens of the main draft, and accepted tree nodes off it (a linear
    draft's accepted tokens are all on it)."""
    if state.tree is None:
        return len(emitted) - 1, 0
    tokens, parents = state.tree
    path = path_by_tokens(parents, tokens, emitted)
    on_main = 0
    while on_main < len(path) and path[on_main] == on_main + 1 <= len(state.draft):
        on_main += 1
    return on_main, len(path) - on_main


def harvest(state: RequestState, verified: Verified, accepted: int, ngram_size: int,
            window_size: int) -> int:
    """Add n-grams read off the target's predictions (one Jacobi iteration); returns
    how many.

    Input position i holds ``[pending] + draft``; ``predictions[i]`` is the target's
    token after it. Windows lying on the accepted output are skipped: the context
    feeds those.
    """
    main = len(state.draft)  # a tree's other nodes are not a chain after them
    predictions = verified.predictions[: main + 1]
    inputs = [state.pending_token, *verified.draft[:main]]
    span = ngram_size - 1
    harvested = 0
    for i in range(len(inputs) - span + 1):
        if harvested == window_size:
            break
        if i + span - 1 <= accepted:
            continue
        state.pool.add(inputs[i], tuple(predictions[i : i + span]))
        harvested += 1
    return harvested


def recycle(table: RecycledTopK, capture: HostCapture | None,
            last_top_k: tuple[torch.Tensor, torch.Tensor] | None,
            sampled_token_ids: list[list[int]], num_tokens: np.ndarray,
            token_ids_cpu: np.ndarray) -> int:
    """Feed ``table`` the target's top-k after every input token of the pass (Token
    Recycling); returns how many tokens got new rows.

    A row's inputs are its root (the token before the ones it emitted) and its draft
    tokens, tree nodes included: input j's prediction is the capture's draft position
    j, the last input's is ``last_top_k`` (the position vLLM sampled from). Partial
    prefill chunks and passes the captures do not match (e.g. a warm-up run) are
    skipped. Tensors are indexed on the host (``HostCapture``): on a GPU a gather by a
    list of rows would add a host-to-device copy and a kernel to each.
    """
    num_rows = len(sampled_token_ids)
    if last_top_k is None or last_top_k[0].shape[0] != num_rows:
        return 0
    drafted = [0] * num_rows
    if capture is not None:
        if len(capture.num_draft_tokens) != num_rows or not capture.has_top_k:
            return 0
        drafted = capture.num_draft_tokens
        draft_tokens = capture.draft_token_ids
    offsets = np.cumsum([0, *drafted])
    inputs, positions, last_inputs, last_rows = [], [], [], []
    for row, emitted in enumerate(sampled_token_ids):
        if not emitted:
            continue
        root = int(token_ids_cpu[row, int(num_tokens[row]) - len(emitted) - 1])
        begin, end = int(offsets[row]), int(offsets[row + 1])
        row_inputs = [root, *draft_tokens[begin:end].tolist()] if end > begin else [root]
        inputs.extend(row_inputs[:-1])
        positions.extend(range(begin, end))
        last_inputs.append(row_inputs[-1])
        last_rows.append(row)
    if positions:
        table.update(np.array(inputs, dtype=np.int64), capture.target_top_ids[positions],
                     capture.target_top_logprobs[positions])
    last_ids, last_logprobs = (tensor.cpu().numpy() for tensor in last_top_k)
    table.update(np.array(last_inputs, dtype=np.int64), last_ids[last_rows],
                 last_logprobs[last_rows])
    return len(inputs) + len(last_inputs)
