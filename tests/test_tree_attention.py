"""The backend-neutral tree step (tree_attention.py) on CPU, without an engine: branch
planning, the split of vLLM's CommonAttentionMetadata, scratch-block filling and the
KV move. A reference paged causal attention (what every backend's kernel computes)
run over the split metadata must equal dense attention under the tree's ancestor mask."""

from __future__ import annotations

from types import SimpleNamespace


import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_lookahead.worker import tree_attention
from vllm_lookahead.worker.scratch import scratch_blocks
from vllm_lookahead.tree import ancestor_mask, depths_of

BLOCK = 4
#            root  a  b  c  d  e  f        root-a-b-c, a-d, root-e-f
PARENTS = np.array([-1, 0, 1, 2, 1, 0, 5])


def test_runs_and_branches_of_a_tree():
    assert tree_attention.runs_of(PARENTS) == [(0, 4), (4, 5), (5, 7)]
    assert tree_attention.ancestors_of(PARENTS, 4) == [0, 1, 4]
    free = [20, 21, 22, 23, 24]
    # request tokens start at step token 3; 6 tokens before the root: root at position 6
    branches = tree_attention.plan_branches(0, PARENTS, 3, 6, BLOCK, free)
    d, ef = branches
    assert (d.first_token, d.num_tokens, d.seq_len) == (3 + 4, 1, 6 + 2 + 1)
    assert d.path_tokens.tolist() == [3, 4, 7]  # root, a, d
    assert d.root_block == 1 and d.scratch == [20, 21]  # positions 6..8 span blocks 1, 2
    assert d.path_slots.tolist() == [20 * BLOCK + 2, 20 * BLOCK + 3, 21 * BLOCK + 0]
    assert (ef.first_token, ef.num_tokens, ef.seq_len) == (8, 2, 9)
    assert ef.scratch == [22, 23] and free == [24]


def test_a_tree_without_enough_scratch_blocks_is_not_planned():
    free = [20, 21, 22]
    assert tree_attention.plan_branches(0, PARENTS, 0, 6, BLOCK, free) is None
    assert free == [20, 21, 22]


def scratch_config(method, k=24, max_num_seqs=2, **options):
    if method == "mtad":
        options = {"model": "auxiliary-model", **options}  # required; not loaded here
    return SimpleNamespace(
        additional_config={"vllm_lookahead": {"method": method, **options}},
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def test_scratch_blocks_are_the_pools_last_and_bounded():
    assert tree_attention.scratch_block_count(10_000, 16, 24) == 32 * 3
    assert tree_attention.scratch_block_count(80, 128, 24) == 10  # an eighth of the pool
    trees = scratch_blocks(scratch_config("lookahead", tree_window=3), 10_000, 16)
    assert trees.trees == list(range(10_000 - 96, 10_000)) and trees.beams == []
    # the default (trees auto) holds them too: the start-up decision is the workers'
    assert scratch_blocks(scratch_config("lookahead"), 10_000, 16).trees == trees.trees
    assert scratch_blocks(scratch_config("lookahead", trees="off"), 10_000, 16).all == []
    assert scratch_blocks(scratch_config("lookahead", tree_candidates=0, tree_window=0),
                          10_000, 16).all == []
    # mtad: B - 1 beams of each of max_num_seqs requests, each the root block and 2 more
    beams = scratch_blocks(scratch_config("mtad", beam_width=4, candidates="best"), 10_000, 16)
    assert beams.beams == list(range(10_000 - 2 * 3 * 3, 10_000)) and beams.trees == []
    # candidates="all": vLLM's K = 24 is gamma x B, the beams and a tree path gamma = 6
    # deep (the root block and 1 more): 32 branches x 2 blocks, 2 x 3 beams x 2 blocks
    both = scratch_blocks(scratch_config("mtad", beam_width=4, candidates="all"), 10_000, 16)
    assert both.trees == list(range(10_000 - 64, 10_000))
    assert both.beams == list(range(10_000 - 64 - 12, 10_000 - 64))
    assert len(scratch_blocks(scratch_config("mtad", max_num_seqs=256), 800, 16).beams) == 100
    assert scratch_blocks(scratch_config("mtad", auxiliary_runner="transformers"),
                          800, 16).all == []


def _common_metadata(query_lens, seq_lens, block_table):
    starts = torch.tensor(np.cumsum([0, *query_lens]), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    tokens = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq,
        num_reqs=len(query_lens), num_actual_tokens=tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64), causal=True,
        is_prefilling=torch.tensor([False] * len(query_lens)),
    )


def _two_requests():
    """Row 0: a plain decode of 2 tokens after 5; row 1: the tree, root at position 6."""
    tables = [[1, 2, 0, 0], [3, 4, 5, 0]]  # row 1: positions 0-3 block 3, 4-7 block 4, ...
    common = _common_metadata([2, 7], [7, 6 + 7], tables)
    free = list(range(10, 16))
    branches = tree_attention.plan_branches(1, PARENTS, 2, 6, BLOCK, free)
    tree = tree_attention.TreeRow(parents=PARENTS, first_token=2,
                                  slots=np.arange(4 * BLOCK + 2, 4 * BLOCK + 9))
    step = tree_attention.make_step({1: tree}, branches, np.array(tables), {1: 6}, BLOCK,
                                     torch.device("cpu"))
    return common, step


def test_metadata_split_gives_each_branch_its_own_sequence():
    common, step = _two_requests()
    split = tree_attention.split_metadata(common, step)
    assert split.num_reqs == 4
    assert split.query_start_loc_cpu.tolist() == [0, 2, 6, 7, 9]
    assert split.seq_lens.tolist() == [7, 6 + 4, 6 + 3, 6 + 3]
    assert split.max_query_len == 4
    assert split.block_table_tensor.tolist() == [
        [1, 2, 0, 0], [3, 4, 5, 0], [3, 10, 11, 0], [3, 12, 13, 0]]
    assert split.is_prefilling.tolist() == [False] * 4  # per-request fields follow the row
    assert split.slot_mapping is common.slot_mapping  # per token: untouched
    assert step.copy_from.tolist() == [4, 4] and step.copy_to.tolist() == [10, 12]


class _PagedCache:
    """A stand-in backend: cache ``[blocks, block size, dim]`` (block dimension 0),
    written by slot like every backend's ``do_kv_cache_update``."""

    def __init__(self, blocks: int, dim: int):
        self.kv = torch.zeros(blocks, BLOCK, 2, dim)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        kv_cache.view(-1, 2, key.shape[-1])[slots] = torch.stack([key, value], dim=1)


def _paged_causal_attention(q, kv, common):
    """What a causal paged kernel computes: each sequence's queries are its last
    tokens and see every position up to their own."""
    out = torch.empty_like(q)
    starts = common.query_start_loc_cpu.tolist()
    for seq, (begin, end) in enumerate(zip(starts, starts[1:])):
        length = int(common.seq_lens[seq])
        blocks = common.block_table_tensor[seq, : -(-length // BLOCK)].long()
        keys, values = kv[blocks].reshape(-1, 2, q.shape[-1])[:length].unbind(1)
        for i, token in enumerate(range(begin, end)):
            visible = length - (end - begin) + i + 1
            weights = (q[token] @ keys[:visible].T).softmax(-1)
            out[token] = weights @ values[:visible]
    return out


def test_branch_attention_equals_attention_under_the_tree_mask():
    torch.manual_seed(0)
    dim = 8
    common, step = _two_requests()
    cache = _PagedCache(blocks=16, dim=dim)
    history = torch.randn(16, BLOCK, 2, dim)
    cache.kv.copy_(history)
    q, k, v = (torch.randn(9, dim) for _ in range(3))
    # vLLM writes every token at its linear slot, then the layer's attention runs
    linear_slots = torch.tensor([2 * BLOCK + 1, 2 * BLOCK + 2, *range(4 * BLOCK + 2, 4 * BLOCK + 9)])
    cache.do_kv_cache_update(None, k, v, cache.kv, linear_slots)
    split = tree_attention.split_metadata(common, step)
    step.metadata_rewritten = True
    tree_attention.copy_root_blocks(tree_attention.stacked([cache.kv]), 0, step)
    tree_attention.prepare_layer(cache, cache, k, v, cache.kv, step)
    out = _paged_causal_attention(q, cache.kv, split)

    # dense reference for the tree request: prefix (positions 0-5) plus ancestors
    prefix = history[[3, 4]].reshape(-1, 2, dim)[:6]
    mask = ancestor_mask(PARENTS)
    for node in range(len(PARENTS)):
        keys = torch.cat([prefix[:, 0], k[2:][mask[node]]])
        values = torch.cat([prefix[:, 1], v[2:][mask[node]]])
        expected = (q[2 + node] @ keys.T).softmax(-1) @ values
        torch.testing.assert_close(out[2 + node], expected)


def test_accepted_nodes_kv_moves_to_the_positions_after_the_root():
    dim = 8
    common, step = _two_requests()
    cache = _PagedCache(blocks=16, dim=dim)
    k, v = torch.randn(9, dim), torch.randn(9, dim)
    step.metadata_rewritten = True
    tree_attention.prepare_layer(cache, cache, k, v, cache.kv, step)
    # accepted path root-e-f: nodes 5 and 6 go to depths 1 and 2
    tree = step.rows[1]
    tree_attention.move_accepted_kv(step, [2 + 5, 2 + 6], tree.slots[[1, 2]].tolist())
    flat = cache.kv.view(-1, 2, dim)
    assert torch.equal(flat[tree.slots[1], 0], k[2 + 5]) and torch.equal(flat[tree.slots[2], 1], v[2 + 6])
    assert depths_of(PARENTS)[[5, 6]].tolist() == [1, 2]


def test_layer_caches_of_one_buffer_copy_blocks_in_one_operation():
    buffer = torch.arange(3 * 5 * 2 * 4.0)
    layers = [buffer[i * 40 : (i + 1) * 40].view(5, 2, 4) for i in range(3)]
    (stacked,) = tree_attention.stacked(layers)
    assert stacked.shape == (3, 5, 2, 4) and stacked.data_ptr() == buffer.data_ptr()
    step = SimpleNamespace(copy_from=torch.tensor([1]), copy_to=torch.tensor([4]))
    tree_attention.copy_root_blocks([stacked], 0, step)
    assert all(torch.equal(layer[4], layer[1]) for layer in layers)
    apart = [torch.zeros(5, 2, 4), torch.ones(5, 2, 4)]  # separate allocations
    assert len(tree_attention.stacked(apart)) == 2


def test_block_dimension_from_the_backends_cache_shape():
    class Split:  # vLLM 0.26 FLASH_ATTN: (2, blocks, block size, heads, head size)
        @staticmethod
        def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

    assert tree_attention.block_dim(Split, torch.zeros(2, 9, 16, 1, 8)) == 1
    assert tree_attention.block_dim(type("Logical", (), {}), torch.zeros(9, 1, 16, 16)) == 0


def test_a_step_without_its_split_metadata_refuses_to_attend():
    common, step = _two_requests()
    cache = _PagedCache(blocks=16, dim=8)
    with pytest.raises(RuntimeError, match="branch metadata"):
        tree_attention.prepare_layer(cache, cache, torch.zeros(9, 8), torch.zeros(9, 8),
                                     cache.kv, step)


def test_the_scheduler_holds_the_scratch_blocks_back_from_its_pool():
    from vllm.v1.core.block_pool import BlockPool

    from vllm_lookahead.worker.scheduler import hold_back_blocks

    num_blocks, block_size, k = 400, 16, 12

    def scheduler_init(self, trees):
        self.kv_cache_manager = SimpleNamespace(
            block_pool=BlockPool(num_blocks, enable_caching=True, hash_block_size=block_size))
        self.kv_cache_config = SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))])
        self.vllm_config = scratch_config("lookahead", k, trees=trees)
        self.num_lookahead_tokens = 0

    held = scratch_blocks(scratch_config("lookahead", k, trees="on"), num_blocks,
                          block_size).trees
    for trees, expected_free in (("off", num_blocks - 1), ("on", num_blocks - 1 - len(held))):
        scheduler = SimpleNamespace()
        hold_back_blocks(scheduler_init)(scheduler, trees)
        pool = scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == expected_free  # block 0 is vLLM's null block
        handed_out = {block.block_id for block in pool.get_new_blocks(expected_free)}
        assert handed_out.isdisjoint(held) == (trees == "on")
    # the workers' report, where the engine core has one: only the blocks they use
    from vllm_lookahead.worker.scheduler import ask_workers_for_scratch

    def workers(trees_on):
        runner = SimpleNamespace(
            vllm_config=scratch_config("lookahead", k), drafter=SimpleNamespace(trees_on=trees_on),
            kv_cache_config=SimpleNamespace(
                num_blocks=num_blocks, kv_cache_groups=[SimpleNamespace(
                    kv_cache_spec=SimpleNamespace(block_size=block_size))]))
        return [SimpleNamespace(model_runner=runner)] * 2  # two ranks

    for trees_on, expected_free in ((False, num_blocks - 1), (True, num_blocks - 1 - len(held))):
        ranks = workers(trees_on)
        engine = SimpleNamespace(model_executor=SimpleNamespace(
            collective_rpc=lambda method: [method(worker) for worker in ranks]))
        config = ranks[0].model_runner.kv_cache_config
        assert ask_workers_for_scratch(lambda self, vllm_config: config)(
            engine, ranks[0].model_runner.vllm_config) is config

        def reported_init(self):
            scheduler_init(self, "on")  # options alone would hold the trees' blocks
            self.kv_cache_config = config

        scheduler = SimpleNamespace()
        hold_back_blocks(reported_init)(scheduler)
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == expected_free
    # mtad: beam blocks held back, lookahead slots for the auxiliary model's draft
    def mtad_init(self):
        scheduler_init(self, "off")
        self.vllm_config = scratch_config("mtad", k, candidates="auto")

    scheduler = SimpleNamespace()
    hold_back_blocks(mtad_init)(scheduler)
    held = scratch_blocks(scratch_config("mtad", k, candidates="auto"), num_blocks, block_size)
    assert held.beams and held.trees
    assert scheduler.num_lookahead_tokens == k // 4  # gamma: K is gamma x B (B = 4)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == \
        num_blocks - 1 - len(held.all)
