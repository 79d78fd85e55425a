"""Batch-invariant paged attention (`paged_attention(..., invariant=True)`): a row's output is
the same bits as a decode row alone, beside other requests' decode rows, inside a prefill tile
of its own request at any offset, and beside other tiles (CPU: interpreter, fp32; GPU: bf16
with --run-gpu)."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.attention.metadata import build_attention_metadata
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.paged_attention import INVARIANT_TILE_ROWS, paged_attention

BLOCK = 16
SMALL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs where its tensors are
CASES = [
    pytest.param(SMALL_DEVICE, torch.float32, 300, (4, 2, 32)),
    pytest.param("cuda", torch.bfloat16, 3000, (16, 16, 128), marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, 3000, (16, 4, 128), marks=pytest.mark.gpu),
]


class _Setup:
    """Three requests' K/V written for positions 0..length-1 (each on its own shuffled blocks)
    and a query per (request, position)."""

    def __init__(self, device, dtype, length, heads, num_requests=3):
        num_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator().manual_seed(0)
        per_req = -(-length // BLOCK)
        perm = torch.randperm(per_req * num_requests, generator=gen).tolist()
        self.tables = [perm[i * per_req : (i + 1) * per_req] for i in range(num_requests)]
        shape = (per_req * num_requests, BLOCK, num_kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self.v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        self.q = torch.randn(num_requests, length, num_heads, head_dim, generator=gen)
        self.q = self.q.to(device=device, dtype=dtype)
        self.device = device

    def run(self, segments: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Segments as (request, first position, rows) in one invocation -> each one's output."""
        meta = build_attention_metadata(
            [s for _, s, _ in segments], [n for *_, n in segments],
            [self.tables[r] for r, _, _ in segments], BLOCK, self.device, INVARIANT_TILE_ROWS,
        )  # fmt: skip
        q = torch.cat([self.q[r, s : s + n] for r, s, n in segments])
        out = paged_attention(q, KVLayer(self.k, self.v), meta, invariant=True)
        return list(out.split([n for *_, n in segments]))


@pytest.mark.parametrize("device,dtype,length,heads", CASES)
def test_a_row_is_the_same_bits_in_every_invocation(device, dtype, length, heads):
    s = _Setup(device, dtype, length, heads)
    probe = [length // 3, length - 1, 63, 64, 65]  # positions of request 0, around tile edges
    for p in probe:
        alone = s.run([(0, p, 1)])[0]
        beside_decode = s.run([(1, 5, 1), (0, p, 1), (2, length - 1, 1)])[1]
        assert torch.equal(beside_decode, alone), p
        for offset in (0, 1, 17, 63):  # p as row `offset` of a prefill tile of its request
            start = p - offset
            if start < 0:
                continue
            rows = min(INVARIANT_TILE_ROWS - offset % INVARIANT_TILE_ROWS, length - start)
            rows = max(rows, offset + 1)
            tile = s.run([(2, 0, 40), (0, start, rows), (1, length // 2, 1)])[1]
            assert torch.equal(tile[offset], alone[0]), (p, offset)


@pytest.mark.parametrize("device,dtype,length,heads", CASES)
def test_every_position_alone_equals_its_row_of_the_chunked_prompt(device, dtype, length, heads):
    """Every position of a request as a row alone (the last KV step of a context that ends on a
    step boundary needs no mask) and as its row of the request's prompt in 64-row chunk tiles
    (the chunk's own keys are a masked step): the same bits at every position, so a row's
    result does not depend on where its tile starts."""
    if device == "cpu":  # the interpreter: two chunk boundaries are enough
        length = 2 * INVARIANT_TILE_ROWS + 2
    s = _Setup(device, dtype, length, heads, num_requests=1)
    alone = torch.cat(s.run([(0, p, 1) for p in range(length)]))
    step = INVARIANT_TILE_ROWS
    chunks = [(0, start, min(step, length - start)) for start in range(0, length, step)]
    assert torch.equal(torch.cat(s.run(chunks)), alone)


def test_invariant_launch_refuses_taller_tiles():
    s = _Setup("cpu", torch.float32, 200, (2, 2, 16), num_requests=1)
    meta = build_attention_metadata([0], [130], [s.tables[0]], BLOCK, "cpu", 128)
    with pytest.raises(ValueError, match="at most 64 rows"):
        paged_attention(s.q[0, :130], KVLayer(s.k, s.v), meta, invariant=True)
