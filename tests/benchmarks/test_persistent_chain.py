"""The persistent-chain probe's kernel (`benchmarks/probes/persistent_chain.cu`), run on the CPU
over the CUDA emulation (`tests/kernels/emulation.py`): a chain whose projections cover several
row groups and K chunks per block, wrap the ring of weight tiles, and leave some blocks without
rows (they still take part in every grid barrier) equals torch projection by projection."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probes import persistent_chain as pc
from tests.kernels.emulation import build_emulated

# (N, K): K = 1096 is two K chunks, N = 48 two row groups per block, N = 9 leaves the fourth
# block without rows, N = 1100 takes 35 tiles per block (the ring of 8 wraps)
SHAPES = [(48, 1096), (20, 48), (9, 16), (1100, 8), (40, 1096), (16, 40)]


@pytest.mark.parametrize("rows", [1, 2])
def test_emulated_persistent_chain_equals_torch(tmp_path, rows):
    library = pc.declare(build_emulated(pc.SOURCE, tmp_path))
    gen = torch.Generator().manual_seed(rows)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n, k in SHAPES]
    chain = pc.Chain(weights, torch.randn(rows, SHAPES[0][1], generator=gen).bfloat16())
    chain.run(library, blocks=4, stream=None)
    assert chain.max_rel_err() < 1e-2  # bf16 outputs of fp32 sums
    assert chain.counter.item() == 4 * (len(SHAPES) - 1)  # every block at every barrier
