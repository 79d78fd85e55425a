"""The FP8 KV cache through the engine (`kv_cache_dtype="fp8"`), fp32 compute on CPU: what
batching, chunking, the prefill strategy, prefix caching, preemption, speculation and Huginn's
layout do not change with a bf16 or fp32 cache they do not change with FP8 either (the stored
bits of a position are a function of its K and V alone); the checkpoint's K and V scales are
read, checked and used; the cache takes one byte per element."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.harness import kv_all_free, make_engine, random_jobs, run_batched, run_serial
from tests.engine.test_huginn_engine import greedy_jobs as huginn_jobs
from tests.engine.test_preemption import run_workload
from tests.engine.test_prefix_caching import shared_prefix_jobs
from tests.engine.test_speculative import greedy_jobs as speculation_jobs
from tests.helpers import write_tiny_huginn
from vllm_rlt.config import CacheConfig
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.engine.kv_sizing import GIB, plan_kv_blocks
from vllm_rlt.kernels.kv_format import FP8
from vllm_rlt.models.loader import CheckpointError
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

FP8_KV = {"kv_cache_dtype": "fp8"}
STRATEGIES = {
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed", "max_prefill_stall_loops": 1},
    "wcpb": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


def with_scales(model_dir, tmp_path, scales: dict[str, float]):
    """A copy of `model_dir` whose checkpoint also holds the given scalar tensors."""
    out = tmp_path / "scaled"
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    tensors |= {name: torch.tensor(value) for name, value in scales.items()}
    save_file(tensors, out / "model.safetensors")
    return out


def ouro_scale_names(num_layers: int = 2) -> list[str]:
    return [
        f"model.layers.{i}.self_attn.{kv}_scale" for i in range(num_layers) for kv in ("k", "v")
    ]


_SERIAL: dict = {}


def serial(model_dir, device, backend):
    if (device, backend) not in _SERIAL:
        interpreted = (device, backend) == ("cpu", "triton")  # slow: a smaller workload
        jobs = random_jobs(
            random.Random(3), 3 if interpreted else 8, 256, 4, 12 if interpreted else 40
        )
        solo = make_engine(model_dir, device, backend, max_num_seqs=1, **FP8_KV)
        _SERIAL[device, backend] = jobs, run_serial(solo, jobs)
    return _SERIAL[device, backend]


@pytest.mark.parametrize(
    "device,backend,strategy",
    [
        *(("cpu", "torch", strategy) for strategy in STRATEGIES),
        ("cpu", "triton", "wcpb"),  # the Triton kernels under the interpreter
        *(pytest.param("cuda", "triton", s, marks=pytest.mark.gpu) for s in STRATEGIES),
    ],
)
def test_batched_equals_serial(model_dir, device, backend, strategy):
    jobs, want = serial(model_dir, device, backend)
    eng = make_engine(
        model_dir, device, backend, prefill_chunk_size=3, max_num_batched_tokens=9,
        max_num_seqs=3, **STRATEGIES[strategy], **FP8_KV,
    )  # fmt: skip
    assert eng.runner.kv_cache.kv.dtype == FP8
    assert run_batched(eng, jobs) == want
    assert kv_all_free(eng)


def greedy_logprobs(eng) -> torch.Tensor:
    """The logprobs of the greedy tokens of one fixed request."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True)
    eng.add_request("a", list(range(10, 40)), params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            c = out.outputs[0]
    return torch.tensor([t[tok] for t, tok in zip(c.logprobs, c.token_ids, strict=True)])


def test_the_cache_changes_what_attention_reads(model_dir):
    """FP8 is really stored: the logprobs move off the fp32 cache's by about e4m3's rounding."""
    fp8, full = (greedy_logprobs(make_engine(model_dir, kv_cache_dtype=d)) for d in ("fp8", "auto"))
    diff = (fp8 - full).abs().max()
    assert 0 < diff < 0.1, diff


def test_prefix_caching_on_equals_off(model_dir):
    hits = 0
    for seed in range(2):
        jobs = shared_prefix_jobs(seed)
        results = {}
        for caching in (False, True):
            eng = make_engine(
                model_dir, enable_prefix_caching=caching, prefill_chunk_size=3 + seed,
                max_num_batched_tokens=16, max_num_seqs=4, **STRATEGIES["wcpb"], **FP8_KV,
            )  # fmt: skip
            results[caching] = run_batched(eng, jobs)
            assert kv_all_free(eng)
        assert results[True] == results[False]
        hits += eng.scheduler.prefix_hits
    assert hits > 0


def test_preempted_requests_equal_their_solo_runs(model_dir):
    results = [run_workload(model_dir, seed, **FP8_KV) for seed in range(9)]
    preemptions, near_ties = zip(*results, strict=True)
    assert sum(1 for p in preemptions if p) >= 4 and sum(near_ties) == 0


def test_speculation_equals_plain_decoding(model_dir, monkeypatch):
    monkeypatch.setattr(SpecPlanner, "acceptance", lambda self: 1.0)  # every window drafts
    jobs = speculation_jobs(0, 6)
    want = run_serial(make_engine(model_dir, max_num_seqs=1, **FP8_KV), jobs)
    eng = make_engine(
        model_dir, num_speculative_tokens=2, speculative_draft_loops=2, max_num_seqs=3,
        prefill_chunk_size=3, **STRATEGIES["wcpb"], **FP8_KV,
    )  # fmt: skip
    assert run_batched(eng, jobs) == want
    assert eng.scheduler.spec.num_windows > 0 and kv_all_free(eng)


def test_huginn_batched_equals_serial(tmp_path):
    """Huginn's checkpoint has no KV scales: its FP8 cache stores at 1.0."""
    model_dir = write_tiny_huginn(tmp_path / "huginn", seed=6)
    jobs = huginn_jobs(1, 5, vocab=256)
    want = run_serial(make_engine(model_dir, max_num_seqs=1, **FP8_KV), jobs)
    eng = make_engine(model_dir, max_num_seqs=3, max_num_batched_tokens=12, **FP8_KV)
    assert eng.runner.kv_cache.scales == [(1.0, 1.0)] * len(eng.runner.kv_cache.scales)
    assert run_batched(eng, jobs) == want


def test_checkpoint_scales_are_read_and_used(model_dir, tmp_path):
    values = dict(zip(ouro_scale_names(), (0.375, 0.5, 1.5, 0.3125), strict=True))
    eng = make_engine(with_scales(model_dir, tmp_path, values), **FP8_KV)
    assert eng.runner.kv_cache.scales == [(0.375, 0.5), (1.5, 0.3125)]
    plain = make_engine(model_dir, **FP8_KV)
    assert plain.runner.kv_cache.scales == [(1.0, 1.0)] * 2
    assert not torch.equal(greedy_logprobs(eng), greedy_logprobs(plain))


@pytest.mark.parametrize(
    "values,match",
    [
        ({"model.layers.0.self_attn.k_scale": 0.5}, "has KV scales but not"),
        ({name: -1.0 for name in ouro_scale_names()}, "one positive finite value"),
        ({name: [1.0, 2.0] for name in ouro_scale_names()}, "one positive finite value"),
    ],
)
def test_bad_checkpoint_scales_are_refused(model_dir, tmp_path, values, match):
    with pytest.raises(CheckpointError, match=match):
        make_engine(with_scales(model_dir, tmp_path, values), **FP8_KV)


def test_an_fp8_block_takes_a_byte_per_element(model_dir):
    from vllm_rlt.models.loader import read_config

    config = read_config(model_dir)
    cache = CacheConfig(kv_cache_memory_gb=0.01, block_size=4)
    blocks = {
        dtype: plan_kv_blocks(cache, config, 4, dtype, torch.device("cpu"), None).num_blocks
        for dtype in (torch.float32, torch.bfloat16, FP8)
    }
    per_block = config.num_kv_layers * 2 * 4 * config.num_key_value_heads * config.head_dim
    assert blocks[FP8] == int(0.01 * GIB // per_block)
    assert blocks[FP8] // 4 == blocks[torch.float32] and blocks[FP8] // 2 == blocks[torch.bfloat16]
