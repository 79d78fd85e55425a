"""Early launch (`vllm_rlt.kernels.pdl`): off where it cannot work, and on Hopper GPUs the early
launched few-row GEMM reads its input only after the kernel before it wrote it."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.kernels import fused_ops, pdl, skinny_gemm


def test_early_launch_is_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert not pdl.pdl(torch.device("cpu"))
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_early_gemm_after_a_norm_in_a_graph_matches_the_plain_launch(monkeypatch, rows):
    """norm -> GEMM captured in a CUDA graph and replayed over changing inputs: with the early
    launch the GEMM starts while the norm runs; its products must equal those of plain launches
    bit for bit (the same arithmetic; a read of x before the norm wrote it would differ)."""
    device = torch.device("cuda")
    if not pdl.pdl(device):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(6144, 2048, device=device, generator=gen).bfloat16() / 2048**0.5
    norm_w = torch.rand(2048, device=device, generator=gen).bfloat16() + 0.5
    x = torch.empty(rows, 2048, device=device, dtype=torch.bfloat16)

    def forward():
        return skinny_gemm.skinny_linear(fused_ops.rms_norm(x, norm_w, 1e-6), w)

    inputs = [torch.randn(rows, 2048, device=device, generator=gen).bfloat16() for _ in range(4)]
    x.copy_(inputs[0])
    forward()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    early = []
    for value in inputs:
        x.copy_(value)
        graph.replay()
        early.append(out.clone())
    monkeypatch.setattr(pdl, "ENABLED", False)
    for value, got in zip(inputs, early, strict=True):
        x.copy_(value)
        assert torch.equal(got, forward())
