"""The Triton attention backend against the torch reference (CPU: interpreter; GPU: --run-gpu).

Caches start as NaN; each segment's history (positions before its first row) is filled with random
K/V through its block table, so a kernel that reads a stale slot, a wrong block or a position past a
row's own turns the output NaN. Block tables use disjoint physical blocks in shuffled order.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # standalone runs; tests/conftest.py does the same
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from vllm_rlt.attention.metadata import AttentionMetadata, build_attention_metadata  # noqa: E402
from vllm_rlt.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from vllm_rlt.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from vllm_rlt.kernels import attention_splits as splits  # noqa: E402
from vllm_rlt.kernels import paged_attention as pa  # noqa: E402
from vllm_rlt.kernels.kv_format import KVLayer  # noqa: E402
from vllm_rlt.kernels.paged_attention import (  # noqa: E402
    DECODE_CONFIG,
    FINE_DECODE_CONFIG,
    LaunchConfig,
    decode_config_for,
    paged_attention,
)

# Segments as (first position, rows): prefill chunks of 37, 16, 3 and 1 rows at several depths,
# then decode rows at scattered positions. Each segment gets its own table (its own plane).
MIXED = [(0, 37), (20, 16), (5, 3), (40, 1), (0, 1), (7, 1), (63, 1), (90, 1)]
DECODE = [(0, 1), (15, 1), (64, 1), (129, 1), (200, 1)]

# bf16 tolerance (max|a-b| / max|b|): both sides read the same bf16 K/V and accumulate in fp32;
# the kernel also rounds the probabilities to bf16 before the PV product (unit roundoff 2^-9,
# ~2e-3, errors averaging like the output itself), and both round the output to bf16 (2^-9).
# A few units of 2e-3 at the worst element (2.4e-3 to 5.8e-3 measured on the CPU shapes); 2e-2
# leaves margin without hiding indexing bugs, which give O(1) errors.
BF16_TOL = 2e-2
FP32_TOL = 1e-5
FP64_TOL = 1e-10


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _make_case(
    segments: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    tile_rows: int = 16,
) -> tuple[torch.Tensor, ...]:
    """Random q/k/v, NaN caches with each segment's history filled, and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seg = [(start + rows + block_size - 1) // block_size for start, rows in segments]
    num_blocks = sum(blocks_per_seg) + 3  # a few blocks no table references
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in blocks_per_seg:
        tables.append(perm[used : used + n])
        used += n
    meta = build_attention_metadata(
        [s for s, _ in segments], [r for _, r in segments], tables, block_size, device, tile_rows
    )
    num_rows = meta.num_rows
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for (start, _), table in zip(segments, tables, strict=True):
        pos = torch.arange(start)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size
        slots += pos % block_size
        for cache in (k_cache, v_cache):
            hist = torch.randn(start, num_kv_heads, head_dim, generator=gen)
            cache.view(-1, num_kv_heads, head_dim)[slots] = hist.to(dtype)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(dtype=dtype, device=device)

    q = rand(num_rows, num_heads, head_dim)
    k = rand(num_rows, num_kv_heads, head_dim)
    v = rand(num_rows, num_kv_heads, head_dim)
    return q, k, v, k_cache.to(device), v_cache.to(device), meta


def _check(
    case: tuple, tol: float, num_splits: int | None = None, **kernel_kwargs: object
) -> tuple[int, float]:
    """Run both backends on copies of the caches; compare outputs and caches."""
    q, k, v, k_cache, v_cache, meta = case
    assert isinstance(meta, AttentionMetadata)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = TorchAttentionBackend().forward(q, k, v, KVLayer(ref_k, ref_v), meta)
    if kernel_kwargs:
        TritonAttentionBackend().forward(q, k, v, KVLayer(k_cache, v_cache), meta)  # writes the KV
        out = torch.full_like(q, float("nan"))
        got = paged_attention(
            q, KVLayer(k_cache, v_cache), meta, num_splits=num_splits, out=out, **kernel_kwargs
        )
    else:
        cache = KVLayer(k_cache, v_cache)
        got = TritonAttentionBackend(num_splits=num_splits).forward(q, k, v, cache, meta)
    # KV write: identical caches (stale NaN slots included), and the written slots hold k, v.
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(got).all()
    err = _rel_err(got, expected)
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    return num_splits or 1, err


def _check_kv_write(case: tuple) -> None:
    q, k, v, k_cache, v_cache, meta = case
    before_k, before_v = k_cache.clone(), v_cache.clone()
    TritonAttentionBackend().forward(q, k, v, KVLayer(k_cache, v_cache), meta)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    slots = meta.slot_mapping
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    others = torch.ones(flat_k.shape[0], dtype=torch.bool, device=slots.device)
    others[slots] = False
    for after, before in ((flat_k, before_k), (flat_v, before_v)):
        before = before.view(-1, *before.shape[2:])
        torch.testing.assert_close(after[others], before[others], rtol=0, atol=0, equal_nan=True)


CPU_SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 8, 4),  # MHA
    (2, 2, 32, 16),  # MHA
    (4, 2, 16, 16),  # GQA 2
    (6, 2, 16, 4),  # GQA 3 (group padded to 4)
    (8, 2, 32, 4),  # GQA 4
    (2, 1, 24, 4),  # GQA 2, head_dim not a power of two (padded to 32)
]


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_mixed_fp32(shape: tuple[int, int, int, int], num_splits: int | None) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(_make_case(MIXED, *shape, torch.float32, device, seed=sum(shape)), FP32_TOL, num_splits)


@pytest.mark.parametrize("shape", [(4, 4, 16, 16), (4, 2, 32, 4)])
def test_mixed_bf16(shape: tuple[int, int, int, int]) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(_make_case(MIXED, *shape, torch.bfloat16, device, seed=1), BF16_TOL, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_fp64(num_splits: int) -> None:
    """fp64 inputs accumulate in fp64 (exactness runs compare at 1e-10)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _make_case(MIXED, 4, 2, 32, 4, torch.float64, device, seed=11)  # sqrt(32) inexact
    _check(case, FP64_TOL, num_splits)


@pytest.mark.parametrize(
    "heads,tile_rows,launches", [((4, 4), 64, 1), ((4, 4), 16, 2), ((8, 2), 16, 1)]
)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_rows_share_a_launch_with_tall_tiles_only(
    monkeypatch, heads: tuple[int, int], tile_rows: int, launches: int, num_splits: int | None
) -> None:
    """Decode and prefill tiles run in one launch when the prefill tiles' row block (rows x
    GQA group) reaches 64, else in two; the results are right either way."""
    launched = []
    real = pa._launch
    monkeypatch.setattr(pa, "_launch", lambda *a: launched.append(a[0].shape[0]) or real(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _make_case(MIXED, *heads, 16, 4, torch.float32, device, seed=5, tile_rows=tile_rows)
    _check(case, FP32_TOL, num_splits)
    assert len(launched) == launches and sum(launched) == case[-1].tile_seg.shape[0]


@pytest.mark.parametrize("use_dot", [True, False])
def test_decode_only_mha(use_dot: bool) -> None:
    """Decode-only batch: the one-row launch alone, with both inner products, split and not, at
    a head size of 16 and at one padded to 16."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LaunchConfig(block_n=32, num_warps=4, num_stages=2, use_dot=use_dot)
    for num_splits, head_dim, seed in ((1, 16, 3), (4, 16, 4), (4, 12, 5)):
        case = _make_case(DECODE, 2, 2, head_dim, 16, torch.float32, device, seed=seed)
        _check(case, FP32_TOL, num_splits=num_splits, decode_config=cfg)


def _pad_tiles(meta: AttentionMetadata, num_one_pad: int, num_chunk_pad: int) -> AttentionMetadata:
    """The tile table in launch order, each launch followed by tiles of zero rows (as a CUDA-graph
    bucket fills its fixed grids); they name the last segment, which has history to read."""
    order = meta.tile_order.long()
    k, last = meta.num_one_row_tiles, meta.num_segments - 1

    def padded(t: torch.Tensor, fill: int) -> torch.Tensor:
        t = t[order]
        one, chunk = (torch.full((n,), fill, dtype=t.dtype) for n in (num_one_pad, num_chunk_pad))
        return torch.cat([t[:k], one.to(t.device), t[k:], chunk.to(t.device)])

    num_tiles = order.shape[0] + num_one_pad + num_chunk_pad
    return replace(
        meta,
        tile_seg=padded(meta.tile_seg, last),
        tile_row_start=padded(meta.tile_row_start, meta.seg_row_starts_host[last]),
        tile_num_rows=padded(meta.tile_num_rows, 0),
        tile_order=torch.arange(num_tiles, dtype=torch.int32, device=order.device),
        num_one_row_tiles=k + num_one_pad,
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_zero_row_tiles_change_nothing(num_splits: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, k_cache, v_cache, meta = _make_case(MIXED, 4, 2, 16, 4, torch.float32, device, 12)
    _check((q, k, v, k_cache, v_cache, _pad_tiles(meta, 5, 3)), FP32_TOL, num_splits)


def test_zero_row_tile_writes_nothing() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, k_cache, v_cache, meta = _make_case(MIXED, 4, 2, 16, 4, torch.float32, device, 13)
    # writes the KV
    expected = TorchAttentionBackend().forward(q, k, v, KVLayer(k_cache, v_cache), meta)
    num_rows = meta.tile_num_rows.clone()
    num_rows[0] = 0  # tile 0: rows 0-15 of the 37-row chunk
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, KVLayer(k_cache, v_cache), replace(meta, tile_num_rows=num_rows), num_splits=1, out=out
    )
    assert torch.isnan(out[:16]).all()
    assert _rel_err(out[16:], expected[16:]) <= FP32_TOL


@pytest.mark.parametrize("num_splits", [None, 8])
@pytest.mark.parametrize(
    "segments",
    [[(0, 37), (600, 1), (300, 1), (1000, 24), (5, 1)], [(600, 1), (300, 1), (1000, 1), (5, 1)]],
    ids=["mixed", "decode-only"],
)
def test_a_grid_sized_for_longer_contexts_splits_each_tile_by_its_own(
    monkeypatch, num_splits, segments
):
    """CUDA graphs size the grid for the longest context a row may reach (`max_context`, here
    64K): a tile splits its own context (into pieces of >= the split policy's length when the
    count is automatic: decode-only launches split finer), and the splits past it do nothing.
    The automatic count as on a 132-SM GPU."""
    monkeypatch.setattr("vllm_rlt.kernels.paged_attention.sm_count", lambda device: 132)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, k_cache, v_cache, meta = _make_case(segments, 4, 2, 16, 16, torch.float32, device, 21)
    _check((q, k, v, k_cache, v_cache, replace(meta, max_context=65536)), FP32_TOL, num_splits)


def test_few_decode_rows_split_finer_than_other_launches():
    """On 132 SMs with 16 KV heads: 1-33 decode rows (at most 4 programs per SM) get ~2
    programs per SM in 128-position splits; 34 decode rows the general policy, and any launch
    with prefill tiles the chunk policy."""
    policies = [splits.split_policy(rows * 16, True, 132) for rows in (1, 8, 16, 32, 33, 34)]
    assert policies == [splits.DECODE_SPLITS] * 5 + [splits.SPLITS]
    assert splits.split_policy(16, False, 132) == splits.CHUNK_SPLITS
    assert splits.choose_num_splits(16 * 16, 65536, 132, splits.DECODE_SPLITS) == 2
    assert splits.choose_num_splits(32 * 16, 65536, 132, splits.DECODE_SPLITS) == 1
    assert splits.choose_num_splits(16, 65536, 132, splits.DECODE_SPLITS) == 17
    assert splits.choose_num_splits(128, 65536, 132, splits.DECODE_SPLITS) == 3
    assert splits.choose_num_splits(256, 65536, 132, splits.CHUNK_SPLITS) == 5
    assert splits.choose_num_splits(256, 512, 132, splits.CHUNK_SPLITS) == 2  # >= 256 each


def test_launches_with_prefill_tiles_that_fill_the_gpu_do_not_split():
    """On 132 SMs: a launch with prefill tiles of fewer than 2 programs per SM before splitting
    splits towards 8 per SM; from 2 per SM (a 2,048-row prefill invocation's 32 tiles x 16 KV
    heads has 4) it runs unsplit, whatever its context, as mixed CUDA graphs do. Decode-only
    launches of the general policy split up to 8 per SM."""
    assert splits.choose_num_splits(263, 65536, 132, splits.CHUNK_SPLITS) == 5
    assert splits.choose_num_splits(264, 65536, 132, splits.CHUNK_SPLITS) == 1
    assert splits.launch_splits(32 * 16, 16, 2048, 132, False) == (splits.CHUNK_SPLITS, 1, 0)
    assert splits.choose_num_splits(264, 65536, 132, splits.SPLITS) == 4
    assert splits.choose_num_splits(1056, 65536, 132, splits.SPLITS) == 1


def test_decode_launches_balance_pieces_over_the_rows():
    """Decode-only launches of the fine policy on 132 SMs with 16 KV heads: 16 pieces per KV head
    over all rows, in a grid of up to 16 programs per SM (at least the fill policy's count, at
    most 128-position splits of the context bound)."""
    assert splits.decode_balance(8 * 16, 16, 65536, 132) == (16, 16)
    assert splits.decode_balance(1 * 16, 16, 65536, 132) == (17, 16)  # the fill policy's 17
    assert splits.decode_balance(32 * 16, 16, 65536, 132) == (5, 16)
    assert splits.decode_balance(8 * 16, 16, 1000, 132) == (7, 16)  # 1000 // 128
    assert splits.launch_splits(8 * 16, 16, 65536, 132, True) == (splits.DECODE_SPLITS, 16, 16)
    assert splits.launch_splits(8 * 16, 16, 65536, 132, False) == (splits.CHUNK_SPLITS, 9, 0)
    assert splits.launch_splits(34 * 16, 16, 65536, 132, True) == (splits.SPLITS, 2, 0)


@pytest.mark.parametrize("max_context", [None, 65536])
def test_one_long_decode_row_among_short_ones(monkeypatch, max_context) -> None:
    """4 SMs, 2 KV heads: 4 pieces per KV head over the rows' 5,544 keys, so the row at 5,000
    positions splits into 4 pieces of 1,408 and the short rows into one each (eagerly, and in a
    grid sized for 64K positions as CUDA graphs size it); outputs match the reference."""
    monkeypatch.setattr("vllm_rlt.kernels.paged_attention.sm_count", lambda device: 4)
    assert splits.decode_balance(4 * 2, 2, 65536, 4) == (4, 4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    segs = [(300, 1), (5000, 1), (200, 1), (40, 1)]
    q, k, v, k_cache, v_cache, meta = _make_case(segs, 4, 2, 16, 16, torch.float32, device, 31)
    meta = meta if max_context is None else replace(meta, max_context=max_context)
    _check((q, k, v, k_cache, v_cache, meta), FP32_TOL)


@pytest.mark.parametrize("num_sms,rows", [(4, 1), (2, 1), (2, 2), (2, 3)])
def test_decode_configs_by_grid_fill(monkeypatch, num_sms: int, rows: int) -> None:
    """bf16 decode-only launches take their launch config from the programs per SM before
    splitting (4 KV heads: 1 program per SM keeps DECODE_CONFIG, 2 and 4 take the fine config,
    6 DECODE_CONFIG again), and each config matches the reference; launches with prefill tiles
    keep DECODE_CONFIG."""
    monkeypatch.setattr("vllm_rlt.kernels.paged_attention.sm_count", lambda device: num_sms)
    fill = rows * 4 / num_sms
    fine = FINE_DECODE_CONFIG
    assert decode_config_for(rows * 4, True, num_sms) == (fine if 1 < fill <= 4 else DECODE_CONFIG)
    assert decode_config_for(rows * 4, False, num_sms) == DECODE_CONFIG
    device = "cuda" if torch.cuda.is_available() else "cpu"
    segs = [(300 + 37 * i, 1) for i in range(rows)]
    _check(_make_case(segs, 4, 4, 16, 16, torch.bfloat16, device, seed=30 + rows), BF16_TOL)


def test_kv_write() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_kv_write(_make_case(MIXED, 4, 2, 8, 4, torch.float32, device, seed=5))


def test_strided_q_k_v() -> None:
    """q/k/v as column slices of one fused qkv projection (row stride != heads * head_dim)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, k_cache, v_cache, meta = _make_case(MIXED, 4, 2, 8, 16, torch.float32, device, 6)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    q_s, k_s, v_s = qkv.split([32, 16, 16], dim=1)
    case = (q_s.view(-1, 4, 8), k_s.view(-1, 2, 8), v_s.view(-1, 2, 8), k_cache, v_cache, meta)
    assert not case[0].is_contiguous()
    _check(case, FP32_TOL)


# GPU: 1e-5 for fp32 holds because fp32 dots run with input_precision="ieee" (no TF32), and the
# torch reference runs with TF32 off (torch's default for matmul).
LONG = [(0, 128), (8064, 128), (4000, 32), (8191, 1), (4095, 1), (2047, 1), (300, 1), (1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(16, 16), (16, 4)])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_gpu_long_contexts(
    dtype: torch.dtype, heads: tuple[int, int], num_splits: int | None
) -> None:
    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = False
    case = _make_case(LONG, *heads, 128, 16, dtype, "cuda", seed=7)
    _check(case, FP32_TOL if dtype == torch.float32 else BF16_TOL, num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_8k(dtype: torch.dtype) -> None:
    """Few decode rows at 4K-8K: the auto split path (the one the benchmark times)."""
    segs = [(8191, 1), (6000, 1), (4096, 1), (7777, 1)]
    case = _make_case(segs, 16, 16, 128, 16, dtype, "cuda", seed=8)
    _check(case, FP32_TOL if dtype == torch.float32 else BF16_TOL)
    cfg = LaunchConfig(block_n=64, num_warps=4, num_stages=3, use_dot=False)
    _check(case, FP32_TOL if dtype == torch.float32 else BF16_TOL, decode_config=cfg)


@pytest.mark.gpu
def test_gpu_kv_write_and_large_tiles() -> None:
    _check_kv_write(_make_case(LONG, 16, 16, 128, 16, torch.bfloat16, "cuda", seed=9))
    # Larger tiles (64 rows) as a runner may build them for prefill.
    q, k, v, k_cache, v_cache, meta = _make_case(LONG, 16, 16, 128, 16, torch.float32, "cuda")
    tables = [meta.block_tables[s].tolist() for s in range(meta.num_segments)]
    meta64 = build_attention_metadata(
        [s for s, _ in LONG], [r for _, r in LONG], tables, 16, "cuda", tile_rows=64
    )
    _check((q, k, v, k_cache, v_cache, meta64), FP32_TOL)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
