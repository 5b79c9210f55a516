"""Where a greedy output first left its reference, and whether that was rounding: the
reference's two best logits there, against the dtype's resolution and against plain
decoding's own noise (``benchmarks.exactness``)."""

from __future__ import annotations

import math

#: Spacing of the dtype's numbers in [1, 2); at a logit x it is this times 2**floor(log2 |x|).
RESOLUTION = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23}
#: A divergence whose reference gap is at most this many ulps is read as rounding: the
#: two logits are neighbours at the dtype's resolution, and one kernel's other order of
#: summation moves a logit by that much.
NEAR_TIE_ULPS = 4


def compare(outputs: list[list[int]], reference: list, dtype: str, noise: float = 0.0) -> dict:
    """Identical outputs and each first divergence with the reference's two best logits
    there; ``reference``: (tokens, top two of each position) of each prompt; ``noise``:
    the reference's own ``wobble``."""
    divergences = []
    identical = 0
    for prompt, (tokens, (expected, top)) in enumerate(zip(outputs, reference)):
        index = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if index is None and len(tokens) == len(expected):
            identical += 1
            continue
        if index is None:  # one is a prefix of the other
            divergences.append({"prompt": prompt, "index": min(len(tokens), len(expected)),
                                "length": len(tokens), "expected_length": len(expected)})
            continue
        divergences.append({"prompt": prompt, "index": index, "expected": expected[index],
                            "got": tokens[index], **tie(top[index], dtype, noise)})
    return {"identical": identical, "total": len(reference), "divergences": divergences}


def tie(top_two: list[tuple[int, float]], dtype: str, noise: float = 0.0) -> dict:
    """The gap between the two best logits of a position, in logits and in ulps of
    ``dtype`` at the best one; within the noise if at most twice ``noise`` (both logits
    may move by that much, in opposite directions)."""
    (first_token, first), (second_token, second) = top_two
    gap = first - second
    ulp = RESOLUTION[dtype] * 2.0 ** math.floor(math.log2(max(abs(first), 1e-30)))
    return {"second": second_token, "top_logit": first, "gap": gap, "ulp": ulp,
            "gap_ulps": gap / ulp, "near_tie": gap <= NEAR_TIE_ULPS * ulp,
            "within_noise": gap <= 2 * noise}


def wobble(batch_1: list, batch_all: list) -> dict:
    """How far plain decoding's own best logit moves between batch 1 and the whole batch
    at the same position after the same context (up to and including the first token
    where the two differ): the engine's rounding noise, whatever its kernels do (float32
    attention in Triton multiplies in TF32 by default, for example)."""
    changes = []
    for (tokens_1, tops_1), (tokens_all, tops_all) in zip(batch_1, batch_all):
        for i, (a, b) in enumerate(zip(tokens_1, tokens_all)):
            changes.append(abs(tops_1[i][0][1] - tops_all[i][0][1]))
            if a != b:
                break
    changes.sort()
    return {"positions": len(changes), "max": changes[-1] if changes else 0.0,
            "median": changes[len(changes) // 2] if changes else 0.0}


def near_tie_share(reference: list, dtype: str) -> dict:
    """How many of the reference's positions are near-ties: how often rounding alone
    could flip a greedy choice."""
    ties = [tie(top, dtype) for _, tops in reference for top in tops]
    return {"positions": len(ties), "near_ties": sum(t["near_tie"] for t in ties),
            "smallest_gap": min((t["gap"] for t in ties), default=math.inf)}
