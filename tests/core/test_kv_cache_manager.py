"""Host-side KV accounting: planes per layout, reservation growth, release, capacity errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_rlt.core.kv_cache_manager import KVCacheManager, KVCapacityError, KVLayout


def test_last_exited_reserves_one_block_table_per_plane():
    m = KVCacheManager(num_blocks=40, block_size=4, layout="last_exited", num_loops=4)
    m.reserve("a", 9)  # 3 blocks per plane
    tables = [m.block_table("a", p) for p in range(4)]
    assert [len(t) for t in tables] == [3, 3, 3, 3]
    assert len({b for t in tables for b in t}) == 12  # planes never share a block
    assert m.num_free_blocks == 28
    m.reserve("a", 12)  # still 3 blocks per plane
    assert m.num_free_blocks == 28
    m.reserve("a", 13)  # grows by one block in every plane
    assert [len(m.block_table("a", p)) for p in range(4)] == [4, 4, 4, 4]
    assert tables[0] == m.block_table("a", 0)[:3]  # growth keeps existing blocks
    m.free("a")
    assert m.num_free_blocks == 40 and not m.has_request("a")


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


def test_capacity_errors_say_what_is_needed_and_available():
    m = KVCacheManager(num_blocks=10, block_size=4, layout="last_exited", num_loops=4)
    m.reserve("a", 8)  # 8 blocks
    with pytest.raises(KVCapacityError, match=r"needs 4 more KV blocks .* only 2 of 10 are free"):
        m.reserve("b", 4)
    assert not m.has_request("b") and m.num_free_blocks == 2  # a failed reservation takes nothing
    with pytest.raises(KVCapacityError, match=r"needs 12 KV blocks .* only 10 blocks in all"):
        m.reserve("c", 9)
    assert m.can_reserve("b", 2) is False
    m.free("a")
    assert m.can_reserve("b", 8)


def test_freed_blocks_are_reused():
    m = KVCacheManager(num_blocks=4, block_size=2, layout="last_exited", num_loops=2)
    m.reserve("a", 4)
    used = {b for p in range(2) for b in m.block_table("a", p)}
    m.free("a")
    m.reserve("b", 4)
    assert {b for p in range(2) for b in m.block_table("b", p)} == used


def test_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import vllm_rlt.core.kv_cache_manager, vllm_rlt.core.block_pool\n"
        "import vllm_rlt.core.sched.scheduler, vllm_rlt.core.sched.prefill_planner\n"
        "import vllm_rlt.core.sched.exit_policy, vllm_rlt.core.sched.execution_batch\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
