"""The paged Huginn (prelude and coda over the edge planes, one plane per recurrence), run by the
model runner (`PlanDriver`), against the dense reference: the state after every recurrence and
the logits after the coda, whole prompts and chunked, with the zero initial state and with the
seeded like-init noise; the config parser, the initial-state distribution and the loader's
handling of the release's extra tensors. fp32 on CPU. The fused and skinny layer kernels
against the torch path, on CPU (Triton interpreter) and, marked `gpu`, on CUDA."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.helpers import rel_err, tiny_huginn, tiny_huginn_config, write_tiny_huginn
from vllm_rlt.models.huginn import like_init_noise
from vllm_rlt.models.huginn_reference import DenseHuginnReference
from vllm_rlt.models.loader import CheckpointError, load_model
from vllm_rlt.models.registry import UnsupportedConfigError
from vllm_rlt.worker.plan_driver import PlanDriver

TOL = 1e-5
BLOCK = 4


def paged_prefill(model, ids, chunk, seed=0, init_scale=0.0):
    """Run a prompt chunk by chunk through the model runner (prelude, every recurrence and the
    coda's blocks over paged KV, in tiles of 4 rows); returns the states [D, S, E] and the
    logits [S, V] of every position."""
    driver = PlanDriver(model, 256, BLOCK, tile_rows=4)
    states, gates = driver.prefill_all_depths("a", ids, chunk, seed, init_scale)
    assert not gates.any()
    # the coda again for every position (it rewrites the same K/V) gives every position's logits
    logits = torch.cat([driver.logits("a", states[-1, p : p + 1], p) for p in range(len(ids))])
    return states[..., : model.config.n_embd], logits


LAYER_CASES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param("cuda", torch.float32, marks=pytest.mark.gpu, id="cuda-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu, id="cuda-bf16"),
]


@pytest.mark.parametrize("kernels", ["fused", "skinny"])
@pytest.mark.parametrize("device,dtype", LAYER_CASES)
def test_layer_kernels_compute_what_the_torch_path_computes(device, dtype, kernels):
    """Norms, the q/k step and the MLP's activation as Triton kernels, projections fused or on
    the few-row GEMM (chunks of 5 rows), 2 recurrences: fp32 within 1e-5 of the torch path; bf16
    no further from it than bf16 rounding itself puts the torch path from fp32 arithmetic (as
    tests/models/test_layer_kernels.py)."""
    backend = "triton" if device == "cuda" else "torch"
    ids = random.Random(2).choices(range(96), k=13)

    def run(dtype, kernels, to_fp32=False):
        model = tiny_huginn(4, dtype, backend, device, kernels, mean_recurrence=2)
        return paged_prefill(model.float() if to_fp32 else model, ids, 5)

    (states, logits), (plain, plain_logits) = run(dtype, kernels), run(dtype, "torch")
    if dtype == torch.float32:
        assert rel_err(states, plain) < TOL and rel_err(logits, plain_logits) < TOL
        return
    exact, exact_logits = run(dtype, "torch", to_fp32=True)
    budget = rel_err(plain, exact)
    assert 1e-3 < budget < 0.1  # bf16 rounding is there, and modest
    assert rel_err(states, plain) <= budget
    assert rel_err(logits, plain_logits) <= rel_err(plain_logits, exact_logits)


@pytest.mark.parametrize("loops", [1, 4, 8])
@pytest.mark.parametrize("chunk", [None, 1, 5])
@pytest.mark.parametrize(
    "layers", [(1, 2, 1), (2, 2, 1)], ids=["one-edge-plane", "two-edge-planes"]
)
def test_prompt_matches_reference_at_every_recurrence(loops, chunk, layers):
    p, c, coda = layers
    model = tiny_huginn(
        seed=3,
        mean_recurrence=loops,
        n_layers=p + c + coda,
        n_layers_in_prelude=p,
        n_layers_in_recurrent_block=c,
        n_layers_in_coda=coda,
    )
    assert model.num_edge_planes == (1 if layers == (1, 2, 1) else 2)
    ids = random.Random(loops).choices(range(model.config.vocab_size), k=13)
    states, logits = paged_prefill(model, ids, chunk or len(ids))
    ref = DenseHuginnReference.from_model(model).run(ids)
    assert rel_err(states, ref.states) < TOL
    assert rel_err(logits, ref.logits) < TOL


@pytest.mark.parametrize("chunk", [None, 3])
def test_seeded_initial_state_matches_reference_given_the_same_noise(chunk):
    model = tiny_huginn(seed=4)
    ids = random.Random(1).choices(range(model.config.vocab_size), k=11)
    states, logits = paged_prefill(model, ids, chunk or len(ids), seed=77, init_scale=0.5)
    noise = like_init_noise(
        torch.full((11,), 77), torch.arange(11), torch.full((11,), 0.5), model.config
    )
    ref = DenseHuginnReference.from_model(model).run(ids, initial_states=noise)
    assert rel_err(states, ref.states) < TOL
    assert rel_err(logits, ref.logits) < TOL
    zero = DenseHuginnReference.from_model(model).run(ids)
    assert rel_err(states, zero.states) > 1e-3  # the noise reached the states


def test_like_init_noise_distribution():
    config = tiny_huginn_config(n_embd=5280 // 4, n_heads=11)
    seeds, positions = torch.arange(64) % 3, torch.arange(64)
    x = like_init_noise(seeds, positions, torch.ones(64), config)
    std = config.init_std * config.embed_scale
    assert abs(float(x.std()) / std - 0.9866) < 0.02  # a normal truncated at 3 sigma
    assert float(x.abs().max()) <= 3 * std + 1e-6
    again = like_init_noise(seeds.flip(0), positions.flip(0), torch.ones(64), config)
    assert torch.equal(again, x.flip(0))  # a function of (seed, position) alone
    scaled = like_init_noise(seeds, positions, torch.full((64,), 0.5), config)
    assert torch.allclose(scaled, x * 0.5)
    assert not like_init_noise(seeds, positions, torch.zeros(64), config).any()


def test_release_config_defaults():
    c = tiny_huginn_config()
    release = type(c).from_dict({"model_type": "huginn_raven"})
    assert (release.n_embd, release.head_dim, release.num_loops) == (5280, 96, 32)
    assert math.isclose(release.init_std, 0.0087039, rel_tol=1e-4)
    assert release.num_kv_layers == 4
    with pytest.raises(UnsupportedConfigError, match="injection_type"):
        type(c).from_dict({"model_type": "huginn_raven", "injection_type": "add"})
    with pytest.raises(UnsupportedConfigError, match="num_key_value_heads"):
        type(c).from_dict({"model_type": "huginn_raven", "num_key_value_heads": 5})
    with pytest.raises(UnsupportedConfigError, match="n_layers=9"):
        type(c).from_dict({"model_type": "huginn_raven", "n_layers": 9})
    gen = type(c).from_dict(
        {"model_type": "huginn_raven", "eos_token_id": 65505, "generation_eos_token_id": [1, 2]}
    )
    assert gen.eos_token_id == [1, 2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loader_reads_the_release_layout(tmp_path, dtype):
    path = write_tiny_huginn(tmp_path / "m", seed=2)
    loaded = load_model(path, dtype=dtype, device="cpu")
    model = loaded.model
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.dtype == getattr(torch, dtype)
    assert model.rope.dtype == torch.float32
    assert loaded.config.eos_token_id == [1, 4]
    want = tiny_huginn(seed=2, vocab_size=loaded.config.vocab_size)
    got = dict(model.named_parameters())
    for name, tensor in want.named_parameters():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), name


def test_loader_vets_the_extra_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_huginn(tmp_path / "m")
    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, file)
    load_model(path, device="cpu")  # the duplicate head may be absent
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"] + 1}, file)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_model(path, device="cpu")
    save_file({**tensors, "freqs_cis": tensors["freqs_cis"] * 0.5}, file)
    with pytest.raises(CheckpointError, match="freqs_cis differs"):
        load_model(path, device="cpu")


def test_release_shape_for_dummy_benchmarks(tmp_path):
    from benchmarks.model_shapes import write_shape
    from vllm_rlt.models.loader import read_config

    config = read_config(write_shape("huginn-0125", tmp_path / "h"))
    assert (config.n_embd, config.n_heads, config.vocab_size, config.num_loops) == (
        5280,
        55,
        65536,
        32,
    )
    assert config.eos_token_id == [65505, 65508]  # from generation_config.json
    # bf16 KV per token: 4 core layers x (32 recurrence planes + 1 edge plane) x K, V: 2.66 MiB,
    # the reference's 132 layer-slots
    planes = config.num_loops + 1
    per_token = planes * config.num_kv_layers * 2 * config.n_embd * 2
    assert planes * config.num_kv_layers == 132 and abs(per_token / 2**20 - 2.66) < 0.01
