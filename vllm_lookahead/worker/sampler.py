"""The sampler hooks: capture the target's predictions at every draft position and at
each row's last position, hand verification to a drafter's own rule, verify tree
drafts; and vLLM's CPU sampling fix.

This module is the only reader of vLLM's ``sampling_metadata``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_lookahead import _patching
from vllm_lookahead.log import get_logger
from vllm_lookahead.tree import accepted_path, path_by_tokens
from vllm_lookahead.worker import cpu_recovered_tokens, cpu_top_p, tree_attention, tree_step
from vllm_lookahead.worker.hooks import AcceptanceRule, VerificationCapture, hook

logger = get_logger(__name__)

# The drafter observing the verification under way and its acceptance rule: those of the
# runner whose rejection sampler is running (``_route_verification``), None outside it.
_observer: Any = None
_acceptance_rule: AcceptanceRule | None = None


def install() -> None:
    """Engines running our methods: verification reaches the bound runner's drafter."""
    from vllm.v1.sample import rejection_sampler

    _patching.wrap(rejection_sampler, "rejection_sample", _hooked_rejection_sample)


def install_cpu_fixes() -> None:
    """Every engine on a CPU: vLLM's CPU verification repaired and made cheaper."""
    from vllm.v1.sample import rejection_sampler

    cpu_top_p.install()
    cpu_recovered_tokens.install()
    if cpu_expand_is_broken():
        _patching.replace(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens)
        logger.info("vllm-lookahead: replaced CPU expand_batch_to_tokens (sampling fix)")


def connect(runner: Any, drafter: Any) -> None:
    """The runner's drafter observes its verification and the last positions' top-k,
    and may replace vLLM's rule."""
    rejection_sampler = getattr(runner, "rejection_sampler", None)
    if rejection_sampler is not None:
        _route_verification(rejection_sampler,
                            drafter if hook(drafter, "on_verification") else None,
                            hook(drafter, "acceptance_rule"))
    if hook(drafter, "capture_last_top_k") and hook(drafter, "on_last_top_k"):
        _observe_last_positions(runner.sampler, drafter)


def _route_verification(rejection_sampler: Any, observer: Any,
                        rule: AcceptanceRule | None) -> None:
    """Wrap ``rejection_sampler.forward`` (instance attribute): vLLM's module-level
    ``rejection_sample``, which every engine of the process calls, sees this runner's
    observer and rule while this runner verifies. Engines in one process (offline,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) each keep theirs: a plain engine started beside
    a lookahead one no longer silences its feedback, nor does MTAD's joint rule verify
    another engine's drafts. A step that verifies no draft token goes to the sampler
    alone (``samples_alone``), but where the drafter's own rule verifies."""
    original = rejection_sampler.forward

    def forward(*args, **kwargs):
        global _observer, _acceptance_rule
        if rule is None and samples_alone(*args, **kwargs):
            return rejection_sampler.sampler(logits=args[2], sampling_metadata=args[3],
                                             predict_bonus_token=True)
        outer = _observer, _acceptance_rule
        _observer, _acceptance_rule = observer, rule
        try:
            return original(*args, **kwargs)
        finally:
            _observer, _acceptance_rule = outer

    rejection_sampler.forward = forward


def samples_alone(*args: Any, **kwargs: Any) -> bool:
    """Whether vLLM's ``RejectionSampler.forward(metadata, draft_probs, logits,
    sampling_metadata)`` verifies no draft token and returns no log-probabilities: then
    its bonus tokens are all it samples, and its sampler alone gives them from the same
    logits and random draws, as a non-speculative engine's would. Under load most
    sampled steps are such (T 1.0, 16 requests, 2-core CPU: 290 of 384), and vLLM's
    path around the sampler (a copy of the logits for log-probabilities nobody asked
    for, constraints on an empty target) cost 0.95 ms of an 85 ms step."""
    if len(args) != 4 or kwargs or tree_step.active_step() is not None:
        return False
    metadata, _, logits, sampling_metadata = args
    return (metadata.max_spec_len == 0 and logits.shape[0] == len(metadata.num_draft_tokens)
            and sampling_metadata.max_num_logprobs is None
            and not getattr(sampling_metadata, "logprob_token_ids", None))


def _observe_last_positions(sampler: Any, drafter: Any) -> None:
    """Wrap ``runner.sampler.forward`` (instance attribute; the rejection sampler samples
    its bonus tokens with the same sampler): every pass, before vLLM processes the
    logits in place, hand the drafter the target's top-k at each row's last position,
    from the raw logits (no temperature or penalties)."""
    original = sampler.forward

    def forward(logits, *args, **kwargs):
        top_k = min(drafter.capture_last_top_k, logits.shape[-1])
        if top_k and logits.shape[0]:
            drafter.on_last_top_k(*top_k_logprobs(logits, top_k))
        return original(logits, *args, **kwargs)

    sampler.forward = forward


def _hooked_rejection_sample(original):
    def rejection_sample(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
        draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
    ):
        capture = None
        if _observer is not None:
            capture = capture_verification(draft_token_ids, num_draft_tokens, target_logits,
                                           bonus_token_ids, hook(_observer, "capture_top_k") or 0)
            _observer.on_verification(capture)
        sampling_metadata = args[0] if args else kwargs["sampling_metadata"]
        step = tree_step.finish_step()  # dummy runs after this must not see its trees
        trees = step.rows if step is not None else {}
        output = None
        if _acceptance_rule is not None:
            output = _acceptance_rule(draft_token_ids, list(num_draft_tokens), max_spec_len,
                                      target_logits, bonus_token_ids, sampling_metadata, trees)
        if output is None and not len(draft_token_ids):
            output = bonus_tokens_only(bonus_token_ids, max_spec_len)
        if output is None:
            output = original(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                draft_probs, target_logits, bonus_token_ids, *args, **kwargs,
            )
            if step is not None:
                target_argmax = capture.target_argmax if capture else row_argmax(target_logits)
                _verify_trees(step, output, draft_token_ids, list(num_draft_tokens),
                              target_logits, target_argmax, bonus_token_ids, sampling_metadata)
        if step is not None:
            move_accepted_paths(step, output, draft_token_ids, list(num_draft_tokens))
        return output

    return rejection_sample


def bonus_tokens_only(bonus_token_ids: torch.Tensor, max_spec_len: int) -> torch.Tensor:
    """vLLM's verdict on a step without draft tokens: each row's bonus token, then
    placeholders. A speculative engine verifies every step, drafts or none, and for
    sampled rows vLLM draws exponential noise over the whole vocabulary for recovered
    tokens it then has none of: on a 2-core CPU 1.2 ms of a 27 ms SmolLM2-135M step,
    every undrafted step of a sampled request. The distribution is unchanged (no token
    depended on that noise); only the process's unseeded random stream moves less."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    output = torch.full((bonus_token_ids.numel(), max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                        dtype=torch.int32, device=bonus_token_ids.device)
    output[:, 0] = bonus_token_ids.view(-1)
    return output


def capture_verification(draft_token_ids, num_draft_tokens, target_logits, bonus_token_ids,
                         top_k: int = 0) -> VerificationCapture:
    """The target's argmax at every draft position, and its ``top_k`` with
    log-probabilities if asked."""
    capture = VerificationCapture(
        num_draft_tokens=list(num_draft_tokens),
        draft_token_ids=draft_token_ids,
        target_argmax=row_argmax(target_logits),
        bonus_token_ids=bonus_token_ids.view(-1),
    )
    top_k = min(top_k, target_logits.shape[-1])
    if top_k and target_logits.shape[0]:
        capture.target_top_ids, capture.target_top_logprobs = top_k_logprobs(target_logits,
                                                                              top_k)
    return capture


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal largest values (as torch's). On the CPU
    by numpy: torch's CPU argmax reads a 49152-token float32 row about ten times
    slower (0.06 against 0.006 ms on a 2-core AMD EPYC), once per verified draft token;
    tree rows emit these tokens, so the two must agree (``test_proposer_feedback.py``)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(dim=-1)


def top_k_logprobs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` most likely tokens of each row and their log-probabilities (float32,
    also for lower-precision logits)."""
    values, top_ids = logits.topk(top_k, dim=-1)
    return top_ids, values.float() - logits.logsumexp(-1, keepdim=True).float()


def _verify_trees(step: tree_attention.TreeStep, output: torch.Tensor,
                  draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                  target_logits: torch.Tensor, target_argmax: torch.Tensor,
                  bonus_token_ids: torch.Tensor, sampling_metadata: Any) -> None:
    """Replace vLLM's linear verdict for tree rows (in place): follow, from the root,
    the child whose token the target chose at each node (greedy: its argmax; random:
    a sample of the processed distribution, which is lossless for point-mass drafts
    with distinct sibling tokens), emit those tokens and the target's token at the
    last node."""
    offsets = np.cumsum([0, *num_draft_tokens])
    temperature = None if sampling_metadata.all_greedy else sampling_metadata.temperature
    generators = sampling_metadata.generators
    for row, tree in step.rows.items():
        begin, end = int(offsets[row]), int(offsets[row + 1])
        if end - begin != len(tree.parents) - 1:
            raise RuntimeError(f"vllm-lookahead: row {row} verified {end - begin} draft "
                               f"tokens, its tree has {len(tree.parents) - 1}")
        if temperature is None or float(temperature[row]) <= 0:
            predictions = target_argmax[begin:end]
        else:
            predictions = target_logits[begin:end].softmax(-1, dtype=torch.float32).multinomial(
                1, generator=generators.get(row)).view(-1)
        predictions = predictions.tolist() + [int(bonus_token_ids.view(-1)[row])]
        tokens = [-1, *draft_token_ids[begin:end].tolist()]
        path = accepted_path(tree.parents, tokens, predictions)
        emitted = [tokens[node] for node in path] + [predictions[path[-1] if path else 0]]
        output[row].fill_(-1)
        output[row, : len(emitted)] = torch.tensor(emitted, dtype=output.dtype)


def move_accepted_paths(step: tree_attention.TreeStep, output: torch.Tensor,
                        draft_token_ids: torch.Tensor, num_draft_tokens: list[int]) -> None:
    """Move the keys and values of each tree row's accepted path (read off its output
    tokens: sibling tokens are distinct) to the positions after the root."""
    offsets = np.cumsum([0, *num_draft_tokens])
    moves_from, moves_to = [], []
    for row, tree in step.rows.items():
        begin = int(offsets[row])
        tokens = [-1, *draft_token_ids[begin:begin + len(tree.parents) - 1].tolist()]
        emitted = [token for token in output[row].tolist() if token != -1]
        for depth, node in enumerate(path_by_tokens(tree.parents, tokens, emitted), start=1):
            if node != depth:
                moves_from.append(tree.first_token + node)
                moves_to.append(int(tree.slots[depth]))
    tree_attention.move_accepted_kv(step, moves_from, moves_to)


def greedy_rows(sampling_metadata: Any, rows: int) -> list[bool]:
    """Which rows of the pass sample greedily."""
    if sampling_metadata.all_greedy:
        return [True] * rows
    if sampling_metadata.all_random:
        return [False] * rows
    return (sampling_metadata.temperature == 0).tolist()


def row_generators(sampling_metadata: Any) -> dict[int, torch.Generator]:
    """Per-request generators (seeded requests) by row."""
    return sampling_metadata.generators


def cpu_expand_is_broken() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: Any = 0,
    replace_to: Any = 0,
) -> torch.Tensor:
    """Pure-torch ``expand_batch_to_tokens``: row value i repeated count_i times."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), x)
    return x.repeat_interleave(counts, output_size=num_tokens)
