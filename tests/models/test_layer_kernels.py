"""The fused layer path: fused q/k/v and gate/up weights share memory with the HF-named
parameters through construction, dtype conversion, random init and checkpoint loading; the
fused model (fused GEMMs + Triton kernels), and the skinny one (the same with its projections of
up to 16 rows on the few-row GEMM kernel, RoPE in the q/k/v GEMM where heads are wide enough:
not in the tiny shape; the prompts run in chunks of 8), compute what the torch path computes.

The model comparison runs on CPU (Triton interpreter, tiny shapes) and, marked `gpu`, on CUDA
with a mid-size shape too. fp32: within 1e-5 (the paths differ only in GEMM shapes and the order
of the RMSNorm sums). bf16: both paths round to bf16 at the same places (the kernels reproduce
every torch rounding, see tests/kernels), so the gap between them must stay below the error that
bf16 rounding itself causes (the bf16 torch path against fp32 arithmetic on the same weights);
an arithmetic bug (a swapped weight or norm, a missing rounding) would be of that size or O(1).
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import GQA, rel_err, tiny_model
from vllm_rlt.models.loader import init_random_weights, load_model
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.plan_driver import PlanDriver


def fused_groups(model):
    """(fused weight, [HF-named weights in order]) for every fused group of every layer."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        yield attn.qkv_weight, [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        yield mlp.gate_up_weight, [mlp.gate_proj.weight, mlp.up_proj.weight]


def assert_views(model) -> None:
    for fused, parts in fused_groups(model):
        assert torch.equal(fused, torch.cat(parts))
        offset = 0
        for p in parts:  # each part is the slice of the fused storage at its offset
            assert p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert p.storage_offset() == fused.storage_offset() + offset
            offset += p.numel()


def test_fused_weights_are_views_through_init_and_conversion():
    model = tiny_model(seed=3, **GQA)
    assert_views(model)
    names = set(model.state_dict())
    assert not any("qkv" in n or "gate_up" in n for n in names)  # checkpoints keep HF names
    before = model.model.layers[0].self_attn.qkv_weight.clone()
    init_random_weights(model, seed=9)  # writes through the HF-named views
    assert not torch.equal(model.model.layers[0].self_attn.qkv_weight, before)
    assert_views(model)
    model.to(torch.bfloat16)  # converts parameter by parameter, then fuses again
    assert_views(model)
    assert model.model.layers[0].mlp.gate_up_weight.dtype == torch.bfloat16
    qkv = model.model.layers[0].self_attn.qkv_weight
    model.to(torch.bfloat16)  # a no-op conversion keeps the same storage
    assert model.model.layers[0].self_attn.qkv_weight is qkv
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage() for p in model.parameters()}
    assert sum(s.nbytes() for s in storages.values()) == param_bytes  # nothing stored twice


def test_loader_fills_the_fused_weights(tmp_path):
    path = write_tiny_ouro(tmp_path / "m", seed=5)
    tensors = load_file(str(path / "model.safetensors"))
    model = load_model(path, device="cpu").model
    assert_views(model)
    attn = model.model.layers[1].self_attn
    expected = torch.cat([tensors[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_weight, expected)
    mlp = model.model.layers[1].mlp
    gate_up = [tensors[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")]
    assert torch.equal(mlp.gate_up_weight, torch.cat(gate_up))


def test_layer_kernels_choice():
    model = tiny_model(**GQA)
    assert model.layer_kernels == "auto"
    with pytest.raises(ValueError, match="layer_kernels"):
        tiny_model(layer_kernels="cudnn", **GQA)


MID = {"hidden_size": 256, "intermediate_size": 704, "head_dim": 64}
CASES = [
    pytest.param("cpu", {}, torch.float32, id="cpu-tiny-fp32"),
    pytest.param("cpu", {}, torch.bfloat16, id="cpu-tiny-bf16"),
    pytest.param("cpu", {"head_dim": 32}, torch.bfloat16, id="cpu-hd32-bf16"),  # RoPE epilogue
    pytest.param("cuda", {}, torch.float32, marks=pytest.mark.gpu, id="cuda-tiny-fp32"),
    pytest.param("cuda", MID, torch.float32, marks=pytest.mark.gpu, id="cuda-mid-fp32"),
    pytest.param("cuda", MID, torch.bfloat16, marks=pytest.mark.gpu, id="cuda-mid-bf16"),
]


@pytest.mark.parametrize("kernels", ["fused", "skinny"])
@pytest.mark.parametrize("device,shape,dtype", CASES)
def test_fused_model_matches_the_torch_path(device, shape, dtype, kernels):
    # the attention backend is common to both paths: Triton on CUDA, the faster torch one on CPU
    backend = "triton" if device == "cuda" else "torch"
    ids = random.Random(6).choices(range(96), k=29)

    def run(dtype: torch.dtype, kernels: str, to_fp32: bool = False):
        model = tiny_model(6, dtype, backend, device, layer_kernels=kernels, **GQA, **shape)
        model = model.float() if to_fp32 else model
        return PlanDriver(model, 64, 4).prefill_all_depths("a", ids, 8)

    (fused, fused_gates), (plain, plain_gates) = run(dtype, kernels), run(dtype, "torch")
    if dtype == torch.float32:
        assert rel_err(fused, plain) < 1e-5
        assert rel_err(fused_gates, plain_gates) < 1e-5
        return
    exact, exact_gates = run(dtype, "torch", to_fp32=True)  # bf16 weights, fp32 arithmetic
    budget = rel_err(plain, exact)
    assert 1e-3 < budget < 0.1  # bf16 rounding is there, and modest
    assert rel_err(fused, plain) <= budget
    assert rel_err(fused_gates, plain_gates) <= rel_err(plain_gates, exact_gates)
