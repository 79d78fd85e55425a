"""The skipped-depth copy on the device KV tensors: it fills every skipped plane of every layer
for the exiting token and touches nothing else."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import GQA, tiny_model
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.kernels.kv_format import FP8
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.plan_driver import PlanDriver


@pytest.mark.parametrize("dtype", [torch.float32, FP8], ids=["fp32", "fp8"])
def test_exit_copy_fills_skipped_planes_only(dtype):
    manager = KVCacheManager(num_blocks=16, block_size=4, layout="last_exited", num_loops=4)
    cache = DeviceKVCache(3, 16, 4, 2, 8, dtype, "cpu", scales=[(0.5, 2.0)] * 3)
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    before = cache.bytes.clone()
    manager.reserve("a", 7)
    manager.reserve("b", 7)
    pos, exit_depth = 6, 1
    pairs = manager.exit_copy_slots("a", pos, exit_depth)
    src, dst = torch.tensor(pairs).T
    cache.copy_slots(src, dst)

    flat = cache.bytes.view(3, 2, -1, 2, 8 * dtype.itemsize)  # bits, compared as bits
    old = before.view_as(flat)
    src_slot = manager.slot("a", exit_depth, pos)
    for plane in (2, 3):
        slot = manager.slot("a", plane, pos)
        assert torch.equal(flat[:, :, slot], old[:, :, src_slot])  # every layer, K and V
    changed = (flat != old).any(dim=(0, 1, 3, 4)).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(manager.slot("a", p, pos) for p in (2, 3))


def test_runner_exit_copies_every_layer():
    """The copies a plan carries (`kv_copies`), as the model runner applies them."""
    model = tiny_model(seed=0, **GQA)
    driver = PlanDriver(model, num_blocks=16, block_size=4)
    driver.prefill_all_depths("a", [1, 2, 3])
    kv_before = driver.kv_cache.kv.clone()
    driver.exit("a", [2], [0])
    src = driver.slot("a", 0, 2)
    flat = driver.kv_cache.kv.view(model.config.num_hidden_layers, 2, -1, 2, 8)
    for plane in (1, 2, 3):
        assert torch.equal(flat[:, :, driver.slot("a", plane, 2)], flat[:, :, src])
    flat_before = kv_before.view_as(flat)
    for pos in (0, 1):  # other positions keep their executed planes
        for plane in range(4):
            slot = driver.slot("a", plane, pos)
            assert torch.equal(flat[:, :, slot], flat_before[:, :, slot])
