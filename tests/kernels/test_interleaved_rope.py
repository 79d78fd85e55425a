"""Huginn's q/k step in one launch (`vllm_rlt.kernels.interleaved_rope`) gives the torch path's
bits (`TorchLayerKernels.bias_rope`: the bias adds, then `rotate_interleaved`), on CPU under the
Triton interpreter and, marked `gpu`, on CUDA; v is left as it was."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kv_targets import assert_written_alike, nan_caches
from vllm_rlt.kernels.interleaved_rope import bias_rope_
from vllm_rlt.models.layer_kernels import TorchLayerKernels

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows,heads,head_dim", [(1, 3, 12), (5, 55, 96)])
def test_bias_rope_gives_the_torch_paths_bits(device, dtype, rows, heads, head_dim):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("fp64 runs on the CPU")
    gen = torch.Generator().manual_seed(rows)
    qkv = (torch.randn(rows, 3 * heads * head_dim, generator=gen) * 4).to(device, dtype)
    bias = torch.randn(2, 1, heads, head_dim, generator=gen).to(device, dtype)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 1000
    table = torch.stack([angles.cos(), angles.sin()], -1).to(device)
    *want, written = TorchLayerKernels().bias_rope(qkv.clone(), bias, table, heads, head_dim, None)
    assert not written
    v_before = qkv[:, 2 * heads * head_dim :].clone()
    got = bias_rope_(qkv, bias, table, heads, head_dim)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (rows, heads, head_dim) and torch.equal(g, w)
    assert torch.equal(qkv[:, 2 * heads * head_dim :], v_before)
    assert got[0].data_ptr() == qkv.data_ptr()  # in place: views of qkv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True], ids=["model-dtype-kv", "fp8-kv"])
@pytest.mark.parametrize("heads,head_dim", [(3, 12), (55, 96)])
def test_bias_rope_also_does_the_kv_write(device, dtype, fp8, heads, head_dim):
    """With caches and slots, the kernel stores the rotated k and v where `write_kv_cache` puts
    them (FP8 caches: the same bits at their own K and V scales), touches no other cache slot,
    and leaves q, k and v as without them."""
    gen = torch.Generator().manual_seed(heads)
    qkv = (torch.randn(5, 3 * heads * head_dim, generator=gen) * 4).to(device, dtype)
    bias = torch.randn(2, 1, heads, head_dim, generator=gen).to(device, dtype)
    angles = torch.rand(5, 1, head_dim // 2, generator=gen) * 1000
    table = torch.stack([angles.cos(), angles.sin()], -1).to(device)
    expected_kv, kv, slots = nan_caches(heads, head_dim, dtype, device, fp8)
    expected = qkv.clone()
    _, k, v = bias_rope_(expected, bias, table, heads, head_dim)
    bias_rope_(qkv, bias, table, heads, head_dim, kv=(kv, slots))
    assert torch.equal(qkv, expected)
    assert_written_alike(expected_kv, kv, k, v, slots)


def test_bad_shapes_are_refused():
    qkv, bias, table = torch.zeros(2, 3 * 2 * 8), torch.zeros(2, 1, 2, 8), torch.zeros(2, 1, 4, 2)
    with pytest.raises(ValueError, match="expected 3 \\* 2 \\* 8"):
        bias_rope_(qkv[:, :40], bias, table, 2, 8)
    with pytest.raises(ValueError, match="qk_bias"):
        bias_rope_(qkv, bias[:1], table, 2, 8)
    with pytest.raises(ValueError, match="RoPE table"):
        bias_rope_(qkv, bias, table.double(), 2, 8)
