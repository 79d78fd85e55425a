"""The persistent-chain probe's kernel (`benchmarks/probes/persistent_chain.cu`), run on the CPU
over the CUDA emulation (`tests/kernels/emulation.py`): a chain of every input mode (a norm,
attention, the sandwich step, SwiGLU, a slice) whose projections cover several row groups and K
chunks per block, wrap the ring of weight tiles, and leave a block without rows (it still takes
part in every grid barrier) equals torch step by step; so does the baseline the probe times, and
the probe's layer plan chains."""

from __future__ import annotations

import pytest
import torch

from benchmarks.model_shapes import OURO_1_4B
from benchmarks.probes import persistent_chain as pc
from tests.kernels.emulation import build_emulated

# (N, K, mode) over 5 blocks: K = 1032 is two K chunks, N = 1032 takes 26 tiles per block (the
# ring of 8 wraps), N = 8 leaves the fifth block without rows; one head of 128 dimensions
PLAN = [
    (384, 1032, pc.NORM),
    (1032, 128, pc.ATTEND),
    (80, 1032, pc.ADD_NORM),
    (1032, 40, pc.SWIGLU),
    (8, 1032, pc.ADD_NORM),
    (1032, 8, pc.SLICE),
]
BLOCKS = 5


# (rows, positions, pieces): pieces of 16 positions; of 2 each, the last 6 empty
@pytest.mark.parametrize("rows, ctx, pieces", [(1, 48, 3), (2, 16, 8)])
def test_emulated_persistent_chain_equals_torch(tmp_path, rows, ctx, pieces):
    library = pc.declare(build_emulated(pc.SOURCE, tmp_path))
    gen = torch.Generator().manual_seed(rows)
    chain = pc.random_chain(PLAN, rows, 1, ctx, pieces, "cpu", gen)
    chain.run(library, blocks=BLOCKS)
    assert chain.max_rel_err() < 1e-2  # bf16 stores of fp32 sums
    barriers = len(PLAN) - 1 + 2  # and the attention's two
    assert chain.counter.item() == BLOCKS * barriers  # every block at every barrier


def test_the_layer_plan_chains():
    plan = pc.layer_plan(OURO_1_4B, 2)
    layer = [pc.NORM, pc.ATTEND, pc.ADD_NORM, pc.SWIGLU]
    assert [mode for *_, mode in plan] == layer + [pc.ADD_NORM] + layer[1:]
    heads = OURO_1_4B["num_attention_heads"]
    pc.random_chain(plan[:4], 1, heads, 16, 1, "cpu", torch.Generator())  # raises if unchained


@pytest.mark.parametrize("skinny", [True, False], ids=["few-row-gemm", "torch-linear"])
def test_the_separate_launches_compute_the_same_chain(tmp_path, skinny):
    """The baseline the probe times (the engine's kernels, here under the Triton interpreter)
    ends where the persistent kernel does, within the bf16 roundings of six steps."""
    library = pc.declare(build_emulated(pc.SOURCE, tmp_path))
    chain = pc.random_chain(PLAN, 2, 1, 48, 3, "cpu", torch.Generator().manual_seed(5))
    chain.run(library, blocks=BLOCKS)
    got, ref = pc.separate(chain, skinny).float(), chain.ys[-1].float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1.5e-2  # 6e-3 measured
