"""What one verification pass tells the proposer about each request: which of its draft
tokens were accepted, and the target's predictions at every draft position (one
Jacobi iteration), harvested into the request's n-gram pool."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_lookahead.lookahead.state import RequestState
from vllm_lookahead.tree import path_by_tokens
from vllm_lookahead.worker.hooks import VerificationCapture


@dataclass
class Verified:
    """One row of a verification pass: the draft, the target's argmax after each input
    position (``[pending] + draft``, the last one the bonus token) and, if captured,
    the target's top-k ids and log-probabilities at those positions but the last."""

    draft: list[int]
    predictions: list[int]
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None

    def lattice_after(self, accepted: int) -> tuple[list[list[int]], list[list[float]]] | None:
        """Columns for the tokens after the bonus token: the positions past the rejected
        draft token, where the target predicted with the rejected tokens as context
        (Jacobi guesses); None after a full acceptance or without a capture."""
        if self.top_ids is None or accepted + 1 >= len(self.draft):
            return None
        return self.top_ids[accepted + 1 :], self.top_logprobs[accepted + 1 :]


def verified_rows(capture: VerificationCapture | None, num_rows: int) -> dict[int, Verified]:
    """The capture's rows that verified a draft, by input-batch row."""
    if capture is None or len(capture.num_draft_tokens) != num_rows:  # e.g. a dummy run
        return {}
    drafts = capture.draft_token_ids.tolist()
    argmax = capture.target_argmax.tolist()
    bonus = capture.bonus_token_ids.tolist()
    top_ids = top_logprobs = None
    if capture.target_top_ids is not None:
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
