"""The persistent-chain probe's kernel (`benchmarks/probes/persistent_chain.cu`), run on the CPU
over the CUDA emulation (`tests/kernels/emulation.py`): a chain of every input mode (a norm, a
slice, the sandwich step, SwiGLU) whose projections cover several row groups and K chunks per
block, wrap the ring of weight tiles, and leave a block without rows (it still takes part in
every grid barrier) equals torch step by step; the probe's layer plan chains."""

from __future__ import annotations

import pytest
import torch

from benchmarks.model_shapes import OURO_1_4B
from benchmarks.probes import persistent_chain as pc
from tests.kernels.emulation import build_emulated

# (N, K, mode) over 5 blocks: K = 1032 is two K chunks, N = 1032 takes 26 tiles per block (the
# ring of 8 wraps), N = 8 leaves the fifth block without rows
PLAN = [
    (32, 1032, pc.NORM),
    (1032, 16, pc.SLICE),
    (80, 1032, pc.ADD_NORM),
    (1032, 40, pc.SWIGLU),
    (8, 1032, pc.ADD_NORM),
    (1032, 8, pc.SLICE),
]
BLOCKS = 5


@pytest.mark.parametrize("rows", [1, 2])
def test_emulated_persistent_chain_equals_torch(tmp_path, rows):
    library = pc.declare(build_emulated(pc.SOURCE, tmp_path))
    chain = pc.random_chain(PLAN, rows, "cpu", torch.Generator().manual_seed(rows))
    chain.run(library, blocks=BLOCKS, stream=None)
    assert chain.max_rel_err() < 1e-2  # bf16 stores of fp32 sums
    assert chain.counter.item() == BLOCKS * (len(PLAN) - 1)  # every block at every barrier


def test_the_layer_plan_chains():
    plan = pc.layer_plan(OURO_1_4B, 2)
    assert [mode for *_, mode in plan] == [pc.NORM, pc.SLICE, pc.ADD_NORM, pc.SWIGLU] + [
        pc.ADD_NORM,
        pc.SLICE,
        pc.ADD_NORM,
        pc.SWIGLU,
    ]
    pc.random_chain(plan[:4], 1, "cpu", torch.Generator())  # raises if a step does not chain
