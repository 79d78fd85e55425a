"""KV caches for kernels that write k and v themselves, checked against `write_kv_cache`."""

from __future__ import annotations

import torch

from vllm_rlt.kernels.kv_format import FP8, KVLayer
from vllm_rlt.kernels.kv_write import write_kv_cache

SLOTS = [13, 2, 30, 7, 21]  # one per row of a 5-row call, out of order


def nan_caches(
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, fp8: bool
) -> tuple[KVLayer, KVLayer, torch.Tensor]:
    """(expected, tested) caches of 8 blocks of 4 slots filled with NaN (FP8: at K and V scales
    0.25 and 3), and the 5 rows' slots."""
    shape = (8, 4, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), device=device, dtype=dtype) for _ in range(4)]
    scales = (0.25, 3.0) if fp8 else (1.0, 1.0)
    if fp8:
        caches = [c.to(FP8) for c in caches]
    slots = torch.tensor(SLOTS, device=device)
    return KVLayer(*caches[:2], *scales), KVLayer(*caches[2:], *scales), slots


def assert_written_alike(
    expected: KVLayer, tested: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """`tested` holds what `write_kv_cache` of k, v [R, Hkv, d] puts into `expected`, the same
    bits, and no other slot of it changed (NaN stays NaN)."""
    write_kv_cache(k.contiguous(), v.contiguous(), expected, slots)
    for want, got in ((expected.k, tested.k), (expected.v, tested.v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert tested.k.view(-1, *tested.k.shape[2:])[slots].float().isfinite().all()
