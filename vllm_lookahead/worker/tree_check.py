"""The tree step's start-up self-check, on the device, attention backend and dtype in use.

Trees are exact only if every piece of the tree step holds here: the metadata split
through the backend's own builders, the root-block copies, the path writes before
each layer's kernel, the kernel's causal mask over branch sequences, and the move of
an accepted branch's keys and values. Once the KV cache exists and before the first
request (``start_up.check_at_start``), the worker runs a synthetic tree through those
pieces on the target model itself, and compares every node's last hidden state with
the same token computed in an ordinary linear sequence. Trees are used only if they
agree within what the dtype's rounding allows; all tensor-parallel ranks take the
largest difference, so they agree on the verdict.

The blocks it writes are free then (no request has been scheduled); they are first
filled with noise, so a missing copy, write or move cannot pass.

| vLLM attribute | use | why | verified on |
|---|---|---|---|
| ``runner.model(input_ids=, positions=)``, ``runner.attn_groups[0][i].metadata_builders[0].build``, ``.layer_names`` | called | the serving model, kernels and (wrapped) metadata builders | 0.32.0, 0.26.0 (CPU_ATTN) |
| ``vllm.forward_context.set_forward_context(metadata, vllm_config, num_tokens=, slot_mapping=)`` | called | the per-layer metadata and KV slots of a pass (no CUDA graph: runtime mode NONE) | 0.32.0, 0.26.0 (CPU) |
| ``runner.kv_caches``, ``runner.kv_cache_config.num_blocks``, ``runner.model_config`` | read, written | the blocks it computes in; the dtype | 0.32.0, 0.26.0 (CPU) |
| ``runner.input_ids.gpu.dtype`` | read | token ids in the dtype the compiled model was traced with (int32; without guards, int64 ids were misread) | 0.32.0, 0.26.0 (CPU, compiled and eager) |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_lookahead.log import get_logger
from vllm_lookahead.tree import depths_of
from vllm_lookahead.worker import runner_state
from vllm_lookahead.worker import tree_attention, tree_step
from vllm_lookahead.worker.auxiliary_model import common_attention_metadata
from vllm_lookahead.worker.scratch import kv_block_size, runner_scratch

logger = get_logger(__name__)

#: The synthetic tree: a first chain of three nodes, a one-node branch off it, a
#: three-node chain and a single node off the root (three branches, depths 1 to 3).
PARENTS = np.array([-1, 0, 1, 2, 1, 0, 5, 6, 0])
#: The path accepted off the first chain: its keys and values are moved to the
#: positions after the root, and one more token is decoded on top of them.
ACCEPTED = [5, 6, 7]
#: The largest difference between a node computed in the tree and in a linear sequence,
#: relative to the largest hidden value, that still counts as agreement. The two
#: differ only in the order the kernels sum in; a broken step differs by order 1.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
#: Graph mode of the check's passes (and of tree steps): attention through Python.
GRAPH_MODE = "eager"


@dataclass(frozen=True)
class TreeCheck:
    passed: bool
    backend: str
    dtype: str
    max_difference: float  # relative (``largest_difference``); inf if it could not run
    tolerance: float
    reason: str = ""  # why the check could not run
    where: str = ""  # which comparison differed most (this rank's)

    def describe(self) -> str:
        verdict = "passed" if self.passed else "failed"
        found = self.reason or (f"largest difference {self.max_difference:.2g} against "
                                f"linear decoding (tolerance {self.tolerance:.2g}), "
                                f"{self.where}")
        return (f"tree step self-check on {self.backend} ({self.dtype}, graph mode "
                f"{GRAPH_MODE}): {verdict}, {found}")


class CannotRun(Exception):
    """The check (or another start-up pass) cannot run on this runner; says why."""


def run(runner: Any) -> TreeCheck:
    """Check the tree step on ``runner`` and log the verdict (first rank only)."""
    dtype = runner.model_config.dtype
    tolerance = TOLERANCE.get(dtype, max(TOLERANCE.values()))
    reason = where = ""
    try:
        difference, where = largest_difference(runner)
    except Exception as exc:  # noqa: BLE001 - any failure refuses trees, with its reason
        difference, reason = math.inf, f"{type(exc).__name__}: {exc}"
    finally:
        tree_step.finish_step()
    difference = runner_state.max_over_tp_ranks(difference)
    if not reason and math.isinf(difference):
        reason = "another tensor-parallel rank could not run it"
    check = TreeCheck(passed=difference <= tolerance,
                      backend=runner.attn_groups[0][0].backend.get_name(),
                      dtype=str(dtype).removeprefix("torch."), max_difference=difference,
                      tolerance=tolerance, reason=reason, where=where)
    if runner_state.is_first_tp_rank():
        if check.passed:
            logger.info("vllm-lookahead: %s; trees on", check.describe())
        else:
            logger.warning("vllm-lookahead: %s; trees refused, drafts are verified "
                           "linearly", check.describe())
    return check


@torch.inference_mode()
def largest_difference(runner: Any) -> tuple[float, str]:
    """Run the synthetic tree and the same tokens as linear sequences: the largest
    difference of a node's last hidden state (relative to the largest hidden value), or
    of the request's blocks after the move (relative to their largest value), and which
    comparison it was (a first chain's path or a branch's: tells a broken split from a
    broken copy or write)."""
    block_size = kv_block_size(runner)
    size = len(PARENTS)
    prefix_len = min(block_size + block_size // 2 + 1, runner.max_model_len - size - 1)
    rng = np.random.default_rng(0)
    vocab = runner.model_config.get_vocab_size()
    prefix, nodes = rng.integers(vocab, size=prefix_len), rng.integers(vocab, size=size)
    extra = rng.integers(vocab, size=1)

    free = free_blocks(runner)
    request_blocks = -(-(prefix_len + size) // block_size)
    request, spare = free[:request_blocks], free[request_blocks:]
    branches = tree_attention.plan_branches(0, PARENTS, 0, prefix_len, block_size, spare)
    if len(request) < request_blocks or branches is None:
        raise CannotRun(f"the KV cache has too few blocks ({len(free)} free)")
    table = np.array([request], dtype=np.int32)

    # every block it computes in starts as noise: what an earlier pass left there (its
    # own, or vLLM's warm-up) cannot stand in for a missing copy, write or move
    scratch = [block for branch in branches for block in branch.scratch]
    _fill_with_noise(runner, request + scratch)
    # the request's prefix, as a prefill; then its tree, laid out as vLLM schedules a
    # draft (the slots of linear positions), each node at the position of its depth
    forward_sequence(runner, prefix, np.arange(prefix_len), table, seq_len=prefix_len,
             slots=slots_of(table, np.arange(prefix_len), block_size))
    linear = prefix_len + np.arange(size)
    row = tree_attention.TreeRow(parents=PARENTS, first_token=0,
                                 slots=slots_of(table, linear, block_size))
    step = tree_step.start_step(runner, {0: row}, branches, table, {0: prefix_len})
    tree_step.begin_step(step)
    in_tree = forward_sequence(runner, nodes, prefix_len + depths_of(PARENTS), table,
                       seq_len=prefix_len + size, slots=row.slots)
    tree_step.finish_step()
    if not step.kept_kv:
        raise CannotRun("no attention layer's forward wrote the tree's branch paths "
                        "(its forward is not wrapped)")
    # an accepted path off the first chain moved after the root, one token decoded on it
    tree_attention.move_accepted_kv(step, ACCEPTED, row.slots[1 : 1 + len(ACCEPTED)].tolist())
    after = np.array([prefix_len + 1 + len(ACCEPTED)])
    decoded = forward_sequence(runner, extra, after, table, seq_len=int(after[0]) + 1,
                       slots=slots_of(table, after, block_size))

    # every node again, in an ordinary sequence per leaf (in the branches' scratch
    # blocks, so the request's blocks keep what the move left); the accepted leaf's
    # first, to compare the request's blocks with those of a linear sequence
    reference = np.array([scratch[: table.shape[1]]], dtype=np.int32)
    if reference.shape[1] < table.shape[1]:
        raise CannotRun("too few scratch blocks for the reference sequences")
    # the nodes past the accepted path, left by the tree pass at linear slots
    stale = prefix_len + np.arange(len(ACCEPTED) + 2, size)
    _erase(step, slots_of(table, stale, block_size))
    compared = table[:, : int(after[0]) // block_size + 1]
    differences = {}
    leaves = sorted(set(range(size)) - set(PARENTS.tolist()),
                    key=lambda leaf: leaf != ACCEPTED[-1])
    for leaf in leaves:
        path = tree_attention.ancestors_of(PARENTS, leaf)
        got = in_tree[path]
        tokens = np.concatenate([prefix, nodes[path]])
        if leaf == ACCEPTED[-1]:
            tokens, got = np.concatenate([tokens, extra]), torch.cat([got, decoded])
        positions = np.arange(len(tokens))
        want = forward_sequence(runner, tokens, positions, reference, seq_len=len(tokens),
                        slots=slots_of(reference, positions, block_size))[prefix_len:]
        name = "path " + "-".join(map(str, path))
        differences[name] = _relative(got, want)
        if leaf == ACCEPTED[-1]:
            _erase(step, slots_of(reference, stale, block_size))
            differences["the request's blocks after the move"] = _relative(
                _blocks(runner, compared), _blocks(runner, reference[:, : compared.shape[1]]))
    worst = max(differences, key=differences.get)
    return differences[worst], f"most at {worst} (" + ", ".join(
        f"{name} {value:.2g}" for name, value in differences.items()) + ")"


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / scale if scale else math.inf


def slots_of(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[0, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size


def _erase(step: tree_attention.TreeStep, slots: np.ndarray) -> None:
    """Zero keys and values at ``slots`` in every layer, through the backend's writer."""
    for impl, layer, kv_cache, keys, _ in step.kept_kv:
        zeros = keys.new_zeros((len(slots), *keys.shape[1:]))
        impl.do_kv_cache_update(layer, zeros, zeros, kv_cache,
                                torch.from_numpy(slots).to(keys.device))


def _blocks(runner: Any, table: np.ndarray) -> torch.Tensor:
    """Every layer's content of the blocks ``table[0]`` (whatever the backend's layout)."""
    caches, dim = tree_step.layer_caches(runner)
    return torch.stack([stacked.select(dim + 1, int(block)).float()
                        for stacked in caches for block in table[0]])


def free_blocks(runner: Any) -> list[int]:
    """Blocks no request holds before the first one is scheduled: all but vLLM's null
    block (0) and the blocks held back as scratch."""
    held = set(runner_scratch(runner).all)
    return [block for block in range(1, runner.kv_cache_config.num_blocks)
            if block not in held]


def _fill_with_noise(runner: Any, blocks: list[int]) -> None:
    """The same noise in every block: what no pass writes stays equal between blocks."""
    caches, dim = tree_step.layer_caches(runner)
    for block in blocks:
        generator = torch.Generator(device=caches[0].device).manual_seed(0)
        for stacked in caches:
            stacked.select(dim + 1, block).normal_(generator=generator)


def forward_sequence(runner: Any, tokens: np.ndarray, positions: np.ndarray,
                     table: np.ndarray, seq_len: int, slots: np.ndarray) -> torch.Tensor:
    """Last hidden states of one sequence's ``tokens`` (its queries, at ``positions``,
    written to ``slots``), ``seq_len`` tokens in context, through the serving model,
    metadata builders and kernels."""
    from vllm.forward_context import set_forward_context

    device = runner.device
    common = common_attention_metadata(np.array([0, len(tokens)]), np.array([seq_len]),
                                       table, slots, len(tokens), device)
    metadata = {}
    for group in runner.attn_groups[0]:
        metadata.update(dict.fromkeys(group.layer_names,
                                      group.metadata_builders[0].build(0, common)))
    slot_tensor = torch.from_numpy(slots).to(device)
    with set_forward_context(metadata, runner.vllm_config, num_tokens=len(tokens),
                             slot_mapping=dict.fromkeys(metadata, slot_tensor)):
        hidden = runner.model(input_ids=torch.from_numpy(tokens).to(device, _token_dtype(runner)),
                              positions=torch.from_numpy(positions.astype(np.int64)).to(device))
    if not isinstance(hidden, torch.Tensor):
        raise CannotRun("the model returned no hidden states (pipeline parallelism?)")
    return hidden.float()


def _token_dtype(runner: Any) -> torch.dtype:
    """The dtype of vLLM's own token-id buffer (int32): the compiled model was traced
    with it and keeps no guards, so it would misread ids of any other dtype."""
    return getattr(getattr(getattr(runner, "input_ids", None), "gpu", None), "dtype",
                   torch.int32)
