"""Host-side KV accounting: planes per layout, on-demand growth plane by plane, release, the
prefix cache (hash chain, sharing, LRU eviction among unreferenced blocks), capacity errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_rlt.config import KVLayout
from vllm_rlt.core.block_pool import BlockPool
from vllm_rlt.core.kv_cache_manager import KVCacheManager, KVCapacityError


def test_planes_grow_on_demand_one_at_a_time():
    m = KVCacheManager(num_blocks=40, block_size=4, layout="last_exited", num_loops=4)
    assert m.num_new_blocks("a", 0, 9) == 3
    m.allocate("a", 0, 9)  # plane 0 only
    assert [len(m.block_table("a", p)) for p in range(4)] == [3, 0, 0, 0]
    assert m.take_changed() == ["a"] and m.take_changed() == []
    m.allocate("a", 0, 12)  # still 3 blocks
    assert m.take_changed() == [] and m.num_free_blocks == 37
    first = m.block_table("a", 0)
    m.allocate("a", 0, 13)
    m.allocate("a", 2, 5)
    assert [len(m.block_table("a", p)) for p in range(4)] == [4, 0, 2, 0]
    assert m.block_table("a", 0)[:3] == first  # growth keeps existing blocks
    assert m.pool.plane_usage() == [4, 0, 2, 0]
    m.free("a")
    assert m.num_free_blocks == 40 and not m.has_request("a")
    assert m.pool.plane_usage() == [0, 0, 0, 0]


def test_shared_has_one_plane_and_no_exit_copies():
    m = KVCacheManager(num_blocks=8, block_size=4, layout=KVLayout.SHARED, num_loops=4)
    m.reserve("a", 8)
    assert m.num_planes == 1 and m.plane(3) == 0
    assert m.num_free_blocks == 6
    assert m.exit_copy_slots("a", 5, 1) == []


def test_slots_and_exit_copy_targets():
    m = KVCacheManager(num_blocks=16, block_size=4, layout="last_exited", num_loops=4)
    m.reserve("a", 6)
    pos = 5
    slots = [m.slot("a", p, pos) for p in range(4)]
    for plane, slot in enumerate(slots):
        assert slot // 4 == m.block_table("a", plane)[1] and slot % 4 == 1
    assert m.exit_copy_slots("a", pos, 1) == [(slots[1], slots[2]), (slots[1], slots[3])]
    assert m.exit_copy_slots("a", pos, 3) == []


def test_reserve_says_what_is_needed_and_available():
    m = KVCacheManager(num_blocks=10, block_size=4, layout="last_exited", num_loops=4)
    m.reserve("a", 8)  # 8 blocks
    with pytest.raises(KVCapacityError, match=r"needs 4 more KV blocks .* only 2 of 10 are free"):
        m.reserve("b", 4)
    assert not m.has_request("b") and m.num_free_blocks == 2  # a failed reservation takes nothing


def fill(m: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    """Allocate every plane for `tokens` and index the full blocks (as after a prefill)."""
    m.reserve(req_id, len(tokens))
    m.cache_prompt(req_id, tokens, len(tokens))


def test_prefix_hits_follow_the_hash_chain_in_whole_blocks():
    m = KVCacheManager(32, 4, "last_exited", 2, enable_prefix_caching=True)
    a = list(range(10))  # blocks [0..3], [4..7]; 8, 9 are a partial block: never cached
    fill(m, "a", a)
    assert m.pool.num_cached == 4  # two full blocks x two planes
    hit = m.find_prefix(a + [99], 10)
    assert hit.num_tokens == 8
    assert hit.blocks == tuple(m.block_table("a", p)[:2] for p in range(2))
    assert m.find_prefix(a, 7).num_tokens == 4  # the limit cuts whole blocks
    assert m.find_prefix([0, 1, 2, 3, 9, 9, 9, 9], 8).num_tokens == 4  # chain breaks at block 2
    assert m.find_prefix([9] + a[1:], 10).num_tokens == 0  # a later block needs its prefix
    off = KVCacheManager(32, 4, "last_exited", 2)
    fill(off, "a", a)
    assert off.find_prefix(a, 10).num_tokens == 0 and off.pool.num_cached == 0


def test_shared_blocks_are_held_until_every_holder_frees_them():
    m = KVCacheManager(16, 4, "last_exited", 2, enable_prefix_caching=True)
    a = list(range(8))
    fill(m, "a", a)
    hit = m.find_prefix(a, 7)
    m.attach("b", hit)
    m.allocate("b", 0, 8)
    m.allocate("b", 1, 8)
    assert m.block_table("b", 0)[0] == m.block_table("a", 0)[0]
    assert m.num_free_blocks == 16 - 4 - 2  # a: 4 blocks; b: its own second block per plane
    m.free("a")
    assert m.num_free_blocks == 16 - 4  # b still holds the shared first blocks
    m.free("b")
    assert m.num_free_blocks == 16 and m.pool.plane_usage() == [0, 0]
    assert m.find_prefix(a, 8).num_tokens == 8  # free but still cached


def test_eviction_takes_the_least_recently_released_blocks_first():
    m = KVCacheManager(6, 2, "last_exited", 2, enable_prefix_caching=True)
    fill(m, "a", [1, 2, 3, 4])  # 4 blocks
    m.free("a")
    fill(m, "b", [5, 6])  # takes the 2 never-used blocks first
    m.free("b")
    assert m.find_prefix([1, 2, 3, 4], 4).num_tokens == 4
    m.reserve("c", 2)  # two blocks: evicts from a's (released first), its last block first
    assert m.find_prefix([1, 2, 3, 4], 4).num_tokens == 2
    assert m.find_prefix([5, 6], 2).num_tokens == 2


def test_block_pool_refcounts():
    pool = BlockPool(4, num_planes=2)
    a = pool.allocate(2, plane=1)
    pool.cache(a[0], "k")
    pool.release(a)
    assert pool.num_free == 4 and pool.lookup("k") == a[0]
    pool.share(a[0], 1)
    assert pool.num_free == 3 and pool.plane_usage() == [0, 1]
    pool.share(a[0], 1)
    pool.release([a[0]])
    assert pool.num_free == 3
    pool.release([a[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="asked for 5 blocks with 4 free"):
        pool.allocate(5)


def test_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import vllm_rlt.core.kv_cache_manager, vllm_rlt.core.block_pool\n"
        "import vllm_rlt.core.sched.scheduler, vllm_rlt.core.sched.prefill_planner\n"
        "import vllm_rlt.core.sched.exit_policy, vllm_rlt.core.sched.execution_batch\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
