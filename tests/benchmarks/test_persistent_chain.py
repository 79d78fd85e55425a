"""The persistent-chain probe's kernel (`benchmarks/probes/persistent_chain.cu`), run on the CPU
over the CUDA emulation (`tests/kernels/emulation.py`): a chain whose projections cover several
row groups and K chunks per block, wrap the ring of weight tiles, and leave a block without
rows (it still takes part in every grid barrier) equals torch projection by projection."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probes import persistent_chain as pc
from tests.kernels.emulation import build_emulated

# (N, K) over 5 blocks: K = 1096 is two K chunks, N = 48 two row groups per block, N = 8 leaves
# the fifth block without rows, N = 1104 takes 28 tiles per block (the ring of 8 wraps)
SHAPES = [(48, 1096), (24, 48), (8, 24), (1104, 8), (40, 1096), (16, 40)]
BLOCKS = 5


@pytest.mark.parametrize("rows", [1, 2])
def test_emulated_persistent_chain_equals_torch(tmp_path, rows):
    library = pc.declare(build_emulated(pc.SOURCE, tmp_path))
    gen = torch.Generator().manual_seed(rows)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n, k in SHAPES]
    chain = pc.Chain(weights, torch.randn(rows, SHAPES[0][1], generator=gen).bfloat16())
    chain.run(library, blocks=BLOCKS, stream=None)
    assert chain.max_rel_err() < 1e-2  # bf16 outputs of fp32 sums
    assert chain.counter.item() == BLOCKS * (len(SHAPES) - 1)  # every block at every barrier
