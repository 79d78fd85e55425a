"""The native decode attention's CUDA source, run on the CPU: the host compiler builds
`csrc/decode_attention.cu` over an emulation of the CUDA features it uses (`cuda_emu.h`: each
thread of a cluster a host thread, shuffles and barriers as waits, shared memory per block, a
cluster's blocks reading each other's), and the kernel's arithmetic, indexing, piece split and
cluster merge are checked against the torch reference. It does not check what only a GPU shows
(launch attributes, alignment faults, timing): the `gpu` tests do. Skipped without g++ or the
CUDA headers (`tests/kernels/emulation.py`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.attention.test_triton_backend import BF16_TOL, _make_case, _rel_err
from tests.kernels.emulation import build_emulated
from vllm_rlt.attention.torch_backend import TorchAttentionBackend
from vllm_rlt.kernels import native
from vllm_rlt.kernels.kv_format import FP8, KVLayer, quantize


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    source = native.SOURCES / "decode_attention.cu"
    return native.declare(build_emulated(source, tmp_path_factory.mktemp("emulated")))


def _run(library, q, cache, meta, pieces: int) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    err = library.vrlt_decode_attention(
        *native.launch_args(q, cache, meta, out, pieces, early=False, stream=None)
    )
    assert err == 0, library.vrlt_error_string(err)
    return out


# decode rows at positions 0 (one key), across block edges and longer than a piece
ROWS = [(0, 1), (16, 1), (130, 1), (700, 1)]


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, dtype, pieces",
    [
        (2, 2, 128, torch.bfloat16, 1),  # one piece: no cluster
        (2, 2, 128, torch.bfloat16, 8),
        (4, 2, 64, torch.float16, 2),  # GQA groups of 2
        (8, 2, 64, torch.bfloat16, 2),  # groups of 4
        (3, 3, 96, torch.bfloat16, 4),  # Huginn's head size: 12 of 16 lanes per position
    ],
)
def test_emulated_native_decode_equals_the_torch_reference(emulated, heads, kv_heads, head_dim,
                                                            dtype, pieces):  # fmt: skip
    q, k, v, k_cache, v_cache, meta = _make_case(ROWS, heads, kv_heads, head_dim, 16, dtype, "cpu")
    cache = KVLayer(k_cache, v_cache)
    expected = TorchAttentionBackend().forward(q, k, v, cache, meta)  # also writes k, v
    got = _run(emulated, q, cache, meta, pieces)
    assert _rel_err(got, expected) <= BF16_TOL


def test_emulated_native_decode_over_fp8(emulated):
    q, k, v, k_cache, v_cache, meta = _make_case(ROWS, 2, 2, 128, 16, torch.bfloat16, "cpu")
    scales = (0.05, 0.1)
    cache = KVLayer(quantize(k_cache, scales[0], FP8), quantize(v_cache, scales[1], FP8), *scales)
    expected = TorchAttentionBackend().forward(q, k, v, cache, meta)
    got = _run(emulated, q, cache, meta, 4)
    assert _rel_err(got, expected) <= BF16_TOL


def test_emulated_padding_tiles_write_nothing(emulated):
    """A tile of zero rows (CUDA-graph buckets fill their grids with them) leaves its row alone,
    in every block of its cluster."""
    q, k, v, k_cache, v_cache, meta = _make_case(ROWS, 2, 2, 64, 16, torch.bfloat16, "cpu")
    cache = KVLayer(k_cache, v_cache)
    expected = TorchAttentionBackend().forward(q, k, v, cache, meta)
    num_rows = meta.tile_num_rows.clone()
    num_rows[1] = 0
    got = _run(emulated, q, cache, replace(meta, tile_num_rows=num_rows), 2)
    assert torch.isnan(got[1]).all()
    others = [0, 2, 3]
    assert _rel_err(got[others], expected[others]) <= BF16_TOL
