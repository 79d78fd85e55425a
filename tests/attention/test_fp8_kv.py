"""FP8 KV caches (`kernels/kv_format.py`): values stored scaled, clamped and rounded to e4m3,
read back times their scales, by the Triton kernels (the KV write, attention, the q/k/v GEMM's
epilogue in `test_skinny_gemm.py`) as by the torch reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # standalone runs; tests/conftest.py does the same
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.attention.test_triton_backend import (  # noqa: E402
    BF16_TOL,
    DECODE,
    FP32_TOL,
    MIXED,
    _make_case,
    _rel_err,
)
from vllm_rlt.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from vllm_rlt.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from vllm_rlt.kernels.kv_format import FP8, FP8_MAX, KVLayer, dequantize, quantize  # noqa: E402
from vllm_rlt.kernels.kv_write import write_kv_cache  # noqa: E402
from vllm_rlt.kernels.paged_attention import (  # noqa: E402
    FP8_DECODE_CONFIG,
    FP8_FINE_DECODE_CONFIG,
    decode_config_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = (0.05, 0.1)  # K, V: the random K/V below span about +-80 and +-40 of e4m3's +-448
# e4m3 keeps 3 mantissa bits: a stored normal value is within 2^-4 of x (relative)
E4M3_REL = 2.0**-4


def test_quantize_scales_clamps_and_rounds_to_nearest():
    x = torch.tensor([0.0, 1.0, -1.1, 3.3, 1000.0, -1e6, 0.013])
    stored = quantize(x, 2.0, FP8)
    assert stored.dtype == FP8
    back = dequantize(stored, 2.0, torch.float32)
    # 1.1 / 2 = 0.55 -> 0.5625 (spacing 2^-4 in [0.5, 1)); 3.3 / 2 = 1.65 -> 1.625
    assert back[:4].tolist() == [0.0, 1.0, -1.125, 3.25]
    assert back[4:6].tolist() == [2 * FP8_MAX, -2 * FP8_MAX]  # clamped, never NaN
    assert back[6] == 2 * 3 * 2.0**-9  # 0.0065: e4m3's subnormals are multiples of 2^-9
    assert torch.equal(quantize(x, 2.0, torch.bfloat16), x.to(torch.bfloat16))  # no scale


def _fp8_case(segments, dtype, seed, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4):
    """`_make_case` with FP8 caches: the history stored at SCALES, NaN slots staying NaN."""
    q, k, v, k_cache, v_cache, meta = _make_case(
        segments, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE, seed
    )
    cache = KVLayer(quantize(k_cache, SCALES[0], FP8), quantize(v_cache, SCALES[1], FP8), *SCALES)
    return q, k, v, cache, meta


def _clone(cache: KVLayer) -> KVLayer:
    return cache._replace(k=cache.k.clone(), v=cache.v.clone())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("segments", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_over_fp8_equals_the_torch_reference(segments, num_splits):
    q, k, v, cache, meta = _fp8_case(segments, torch.float32, seed=len(segments) + num_splits)
    ref = _clone(cache)
    want = TorchAttentionBackend().forward(q, k, v, ref, meta)
    got = TritonAttentionBackend(num_splits=num_splits).forward(q, k, v, cache, meta)
    assert _same_bits(cache.k, ref.k) and _same_bits(cache.v, ref.v)  # the KV writes agree
    assert _rel_err(got, want) <= FP32_TOL


def test_bf16_attention_over_fp8():
    q, k, v, cache, meta = _fp8_case(MIXED, torch.bfloat16, seed=3)
    want = TorchAttentionBackend().forward(q, k, v, _clone(cache), meta)
    got = TritonAttentionBackend(num_splits=2).forward(q, k, v, cache, meta)
    assert _rel_err(got, want) <= BF16_TOL


def test_fp8_attention_is_the_full_precision_one_within_e4m3_rounding():
    """Against attention over the unquantized K/V: off by about e4m3's rounding (so the scales
    are applied, and the values really are FP8), not more."""
    q, k, v, cache, meta = _fp8_case(MIXED, torch.float32, seed=4)
    planes = zip(cache[:2], SCALES, strict=True)
    full = KVLayer(*(dequantize(c, s, torch.float32) for c, s in planes))
    want = TorchAttentionBackend().forward(q, k, v, full, meta)
    got = TritonAttentionBackend().forward(q, k, v, cache, meta)
    err = _rel_err(got, want)
    assert 1e-4 < err < 4 * E4M3_REL, err


def test_the_kv_write_stores_the_scaled_values_at_their_slots_only():
    _, k, v, cache, meta = _fp8_case(DECODE, torch.float32, seed=5)
    scales = (0.25, SCALES[1])  # K's a power of two: the edges below reach the rounding as given
    cache = cache._replace(k_scale=scales[0])
    # e4m3's edges: ties to even (31.5 carries into the next exponent, 30.5 stays), subnormals
    # and their ties, -0, clamping, the largest normal, the smallest normal
    edges = [31.5, 30.5, 0.0065, -(2.0**-10), 3 * 2.0**-10, -0.0, 1000.0, -449.0, 448.0, 2.0**-6]
    k = k.contiguous()
    k.view(-1)[: len(edges)] = torch.tensor(edges, device=k.device) * scales[0]
    before = _clone(cache)
    write_kv_cache(k, v.contiguous(), cache, meta.slot_mapping)
    slots = meta.slot_mapping
    for got, old, x, scale in zip(cache[:2], before[:2], (k, v), scales, strict=True):
        flat, old = got.view(-1, *got.shape[2:]), old.view(-1, *old.shape[2:])
        assert _same_bits(flat[slots], quantize(x, scale, FP8))
        others = torch.ones(flat.shape[0], dtype=torch.bool, device=slots.device)
        others[slots] = False
        assert _same_bits(flat[others], old[others])


@pytest.mark.parametrize("num_sms,rows", [(2, 2), (4, 1)])
def test_fp8_decode_configs_by_grid_fill(monkeypatch, num_sms, rows):
    """Decode-only launches over FP8 take FP8_FINE_DECODE_CONFIG where bf16 takes the fine one
    (2 programs per SM before splitting), else FP8_DECODE_CONFIG, and match the reference either
    way."""
    monkeypatch.setattr("vllm_rlt.kernels.paged_attention.sm_count", lambda device: num_sms)
    programs = rows * 4  # 4 KV heads
    want = FP8_FINE_DECODE_CONFIG if programs / num_sms == 4 else FP8_DECODE_CONFIG
    assert decode_config_for(programs, True, num_sms, kv_fp8=True) == want
    segments = [(300 + 37 * i, 1) for i in range(rows)]
    q, k, v, cache, meta = _fp8_case(segments, torch.bfloat16, seed=7, num_kv_heads=4)
    expected = TorchAttentionBackend().forward(q, k, v, _clone(cache), meta)
    got = TritonAttentionBackend().forward(q, k, v, cache, meta)
    assert _rel_err(got, expected) <= BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_gpu_fp8_decode_at_the_ouro_1_4b_head_shape(rows):
    """Decode rows of Ouro-1.4B's 16 x 128 heads (MHA) over FP8 at 600-2,500 positions, in the
    launch configs the grid picks (on an H100 or H200: `FP8_DECODE_CONFIG` at 1 and 8 rows,
    `FP8_FINE_DECODE_CONFIG` at 32), both one-row tiles without the dot."""
    segments = [(600 + 61 * i, 1) for i in range(rows)]
    q, k, v, cache, meta = _fp8_case(segments, torch.bfloat16, 16 + rows, 16, 16, 128, 16)
    expected = TorchAttentionBackend().forward(q, k, v, _clone(cache), meta)
    got = TritonAttentionBackend().forward(q, k, v, cache, meta)
    assert _rel_err(got, expected) <= BF16_TOL
