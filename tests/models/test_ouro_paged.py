"""The paged Ouro (prelude / recurrent core / coda over paged depth-aware KV), run by the model
runner (`PlanDriver`), against the dense reference at every depth: whole prompts, chunked
prompts, incremental decode with exits, and random invocations that mix requests, depths and
positions. fp32 on CPU; both attention backends;
both layer-kernel paths ("auto" is torch on CPU and fused on CUDA; "fused" on CPU runs the Triton
kernels under the interpreter).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import GQA, MHA, rel_err, tiny_model
from tests.schedule_sim import SimRequest, run_random_schedule, stacked
from vllm_rlt.models.reference import DenseOuroReference
from vllm_rlt.worker.plan_driver import PlanDriver, prompt_rows

BACKENDS = ["torch", "triton"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# fp32 results match the reference to 1e-5 relative. SHARED-layout runs are compared in fp64:
# there every position reads the final state of all earlier ones, a chain of 4 x layers x
# positions steps that amplifies rounding (a 1e-7 relative weight perturbation moved the
# reference's own fp32 output by 3e-4 on a 29-token case), so only fp64 separates real
# differences from rounding.
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def check_against_reference(model, ids, states, gates, loops=None, layout="last_exited"):
    ref = DenseOuroReference.from_model(model).run(ids, loops, layout)
    tol = TOL[model.lm_head.weight.dtype]
    assert rel_err(states, ref.hidden) < tol
    assert rel_err(gates, ref.gate_logits) < tol
    weight = model.lm_head.weight
    logits = model.coda(torch.nan_to_num(states.to(weight.device, ref.logits.dtype)))
    ran = ~torch.isnan(ref.logits)
    assert rel_err(torch.where(ran, logits, float("nan")), ref.logits) < tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "backend,chunk,kernels",
    [("torch", c, "auto") for c in (None, 1, 3, 16)]
    + [("triton", c, "auto") for c in (None, 3, 16)]
    + [("torch", 3, "fused"), ("triton", 16, "fused")],
)
@pytest.mark.parametrize("heads", [MHA, GQA], ids=["mha", "gqa"])
def test_prompt_all_depths_in_chunks(device, backend, chunk, kernels, heads):
    model = tiny_model(seed=1, backend=backend, device=device, layer_kernels=kernels, **heads)
    ids = random.Random(0).choices(range(model.config.vocab_size), k=37)
    driver = PlanDriver(model, num_blocks=64, block_size=4)
    states, gates = driver.prefill_all_depths("a", ids, chunk)
    check_against_reference(model, ids, states, gates)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernels", ["auto", "fused"])
def test_incremental_decode_with_exits(device, backend, kernels):
    """Prefill, then decode tokens one at a time, each stopping after its own number of loops;
    the skipped-depth copy makes later tokens read min(d, exit depth)."""
    model = tiny_model(seed=2, backend=backend, device=device, layer_kernels=kernels, **GQA)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    decode = [79, 32, 38, 46, 26, 43]
    decode_loops = [2, 4, 1, 3, 1, 4]
    driver = PlanDriver(model, num_blocks=32, block_size=4)
    driver.add("a", prompt + decode)
    states, gates = driver.run([prompt_rows("a", 0, len(prompt), 0)], loop_count=4)
    nan_state = torch.full_like(states[:, :1], float("nan"))
    for i, loops in enumerate(decode_loops):
        pos = len(prompt) + i
        col_states = nan_state.clone()
        col_gates = torch.full((4, 1), float("nan"), device=device)
        token = driver.run([prompt_rows("a", pos, 1, 0)], loop_count=loops)
        col_states[:loops], col_gates[:loops] = token
        driver.exit("a", [pos], [loops - 1])
        states = torch.cat([states, col_states], 1)
        gates = torch.cat([gates, col_gates], 1)
    loops = [4] * len(prompt) + decode_loops
    check_against_reference(model, prompt + decode, states, gates, loops)


def random_requests(rng: random.Random, num: int, vocab: int, exits: bool) -> list[SimRequest]:
    reqs = []
    for r in range(num):
        prompt_len, decode_len = rng.randint(1, 24), rng.randint(0, 6)
        ids = rng.choices(range(vocab), k=prompt_len + decode_len)
        loops = [4] * prompt_len + [rng.randint(1, 4) if exits else 4 for _ in range(decode_len)]
        reqs.append(SimRequest(f"r{r}", ids, loops))
    return reqs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "backend,layout,seed,kernels",
    [("torch", "last_exited", s, "auto") for s in range(6)]
    + [("torch", "shared", s, "auto") for s in range(3)]
    + [("triton", "last_exited", s, "auto") for s in (0, 1)]
    + [("triton", "shared", 0, "auto")]
    + [("triton", "last_exited", 1, "fused")],
)
def test_mixed_invocations_match_reference(device, backend, layout, seed, kernels):
    """Random dependency-valid invocations mixing requests, depths and positions (with early
    exits) reproduce the reference's LAST_EXITED or SHARED history for every request."""
    rng = random.Random(seed)
    dtype = torch.float64 if layout == "shared" else torch.float32
    heads = GQA if seed % 2 else MHA
    model = tiny_model(
        seed=seed, backend=backend, dtype=dtype, device=device, layer_kernels=kernels, **heads
    )
    reqs = random_requests(rng, num=4, vocab=model.config.vocab_size, exits=True)
    driver = PlanDriver(model, num_blocks=512, block_size=rng.choice([1, 4, 8]), layout=layout)
    history = run_random_schedule(driver, reqs, seed, layout, max_rows=rng.choice([3, 12, 40]))
    mixed = [
        s for s in history if min(len({x.request_id for x in s}), len({x.depth for x in s})) >= 2
    ]
    assert mixed, "the schedule never mixed requests and depths in one invocation"
    for req in reqs:
        states, gates = stacked(req, 4, model.config.hidden_size)
        check_against_reference(model, req.token_ids, states, gates, req.loops, layout)


def test_reused_blocks_do_not_leak_previous_kv():
    """A request that gets the blocks of a freed request computes exactly what it computes in a
    fresh cache: stale KV beyond its length is never read."""
    model = tiny_model(seed=7, **GQA)
    driver = PlanDriver(model, num_blocks=8, block_size=4)
    driver.prefill_all_depths("old", list(range(30, 38)))
    driver.finish("old")
    assert driver.num_free_blocks == 8
    ids = [1, 2, 3, 4, 5]
    states, gates = driver.prefill_all_depths("new", ids)
    assert {b for t in driver.tables["new"] for b in t} == set(range(8))  # the old request's
    fresh_states, _ = PlanDriver(model, 8, 4).prefill_all_depths("new", ids)
    assert torch.equal(states, fresh_states)
    check_against_reference(model, ids, states, gates)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "backend,kernels", [("torch", "auto"), ("triton", "auto"), ("triton", "fused")]
)
def test_bf16_differs_from_fp32_only_by_bf16_rounding(device, backend, kernels):
    """bf16 has no exact oracle. The budget is the error the dense reference itself makes when
    run in bf16 (same bf16 weights, compared with fp32 arithmetic): the paged model, chunked, on
    either backend and either layer-kernel path, must stay within twice that (it rounds at
    different places)."""
    model = tiny_model(
        seed=4, backend=backend, device=device, dtype=torch.bfloat16, layer_kernels=kernels, **GQA
    )
    fp32 = tiny_model(seed=4, device=device, dtype=torch.bfloat16, **GQA).float()
    ids = random.Random(4).choices(range(model.config.vocab_size), k=37)
    states, gates = PlanDriver(model, 64, 4).prefill_all_depths("a", ids, 8)
    exact = DenseOuroReference.from_model(fp32).run(ids)
    rounded = DenseOuroReference.from_model(model).run(ids)
    budget_h = rel_err(rounded.hidden, exact.hidden)
    budget_g = rel_err(rounded.gate_logits, exact.gate_logits)
    assert 1e-3 < budget_h < 0.1  # bf16 rounding is really there, and modest
    assert rel_err(states, exact.hidden) <= 2 * budget_h
    assert rel_err(gates, exact.gate_logits) <= 2 * budget_g
