"""The resident-launch probe's kernels compute the chain they time (one program: the
interpreter runs programs one after another, so a grid barrier can only pass with one)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.persistent_probe import resident, torch_chain
from vllm_rlt.kernels.device_info import INTERPRET

# (N, K) per projection, each N >= the next projection's K, as in the probe's Ouro chain
SHAPES = ((96, 32), (32, 32), (128, 32), (32, 64))


@pytest.mark.parametrize("prefetch", [0, 1, 6])  # register tiles without / with the early
def test_resident_chain_matches_torch_and_resets_its_barrier(prefetch):  # load; tl.dot, 4 stages
    if not INTERPRET:
        pytest.skip("CPU tensors need Triton's interpreter; on a GPU the probe checks itself")
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(2, n, k, generator=gen) / k**0.5 for n, k in SHAPES]
    x = torch.randn(128, generator=gen)
    a, b = torch.zeros(128), torch.zeros(128)
    bar = torch.zeros(2, dtype=torch.int32)
    want = torch_chain(x, weights)
    resident(x, a, b, weights, bar, 1, prefetch, 16, 32, 4, 0)
    torch.testing.assert_close(x[:32], want, rtol=1e-5, atol=1e-5)
    assert bar.tolist() == [0, 0]  # the last program out zeroed the counters
    resident(x, a, b, weights, bar, 1, prefetch, 16, 32, 4, 0)  # again, from the result
    torch.testing.assert_close(x[:32], torch_chain(want, weights), rtol=1e-5, atol=1e-5)
