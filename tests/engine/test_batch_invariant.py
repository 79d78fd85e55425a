"""batch_invariant: the setting's checks, and that scheduling never changes a token - every
scheduling mode, chunk size and budget gives the tokens and exit depths of serial generation
exactly (no near-tie allowance), and the per-depth states of a prompt are the same bits in every
prefill mode. The CPU case runs the invariant kernels under the Triton interpreter in fp32; the
GPU cases run bf16 with and without CUDA graphs (--run-gpu), where it matters most."""

from __future__ import annotations

import random

import pytest

from benchmarks.probes import invariance
from tests.engine.harness import (
    kv_all_free,
    make_engine,
    random_jobs,
    run_batched,
    run_serial,
)
from vllm_rlt.config import ConfigError, EngineConfig, ModelConfig
from vllm_rlt.models.tiny import write_tiny_ouro

SCHEDULES = [
    {"scheduling_mode": "refill", "prefill_chunk_size": 7},
    {"scheduling_mode": "mixed", "prefill_chunk_size": 3},
    {"scheduling_mode": "mixed", "prefill_chunk_size": 5, "wavefront_chunked_prefill": True},
    {"scheduling_mode": "mixed", "prefill_chunk_size": 16, "wavefront_chunked_prefill": True,
     "max_num_batched_tokens": 24},
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


@pytest.mark.parametrize(
    "name,value", [("layer_kernels", "skinny"), ("attention_backend", "torch")]
)
def test_other_kernels_are_refused_by_name(name, value):
    with pytest.raises(ConfigError, match=f"{name}.*batch_invariant"):
        ModelConfig(batch_invariant=True, **{name: value})


def test_kernel_names():
    assert ModelConfig(batch_invariant=True).kernel_names() == ("triton_invariant", "invariant")
    chosen = ModelConfig(attention_backend="torch", layer_kernels="fused")
    assert chosen.kernel_names() == ("torch", "fused")
    assert EngineConfig.from_kwargs(batch_invariant=True).model.batch_invariant


def _check_every_schedule_equals_serial(model_dir, device, dtype, jobs, schedules, **kw):
    common = dict(device=device, backend="triton", dtype=dtype, batch_invariant=True, **kw)
    want = run_serial(make_engine(model_dir, max_num_seqs=1, **common), jobs)
    for schedule in schedules:
        engine = make_engine(model_dir, max_num_seqs=8, **common, **schedule)
        got = run_batched(engine, jobs)
        assert got == want, schedule
        assert kv_all_free(engine)


def test_cpu_per_depth_states_are_the_same_bits(model_dir):
    # the GPU diagnostic (benchmarks/probes/invariance.py) on the tiny model, its slowest case
    # only (the interpreter is slow): every depth's states and the logits of a 13-token prompt
    # prefilled by WCPB beside another request are bitwise those of atomic prefill alone (the
    # torch path differs there by ~1e-6)
    settings = dict(dtype="float32", device="cpu", attention_backend="auto", block_size=4,
                    prefill_chunk_size=4, max_num_batched_tokens=8, num_kv_blocks=512)  # fmt: skip
    report = invariance.diagnostic(
        model_dir, True, list(range(3, 16)), list(range(50, 55)), [("wcpb", True)], **settings
    )
    assert all(d == 0 for diffs in report.values() for d in diffs), report


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_bf16_every_schedule_equals_serial(model_dir, enforce_eager):
    jobs = random_jobs(random.Random(3), 12, vocab=256, depth=4, max_prompt=30)
    _check_every_schedule_equals_serial(
        model_dir, "cuda", "bfloat16", jobs, SCHEDULES, enforce_eager=enforce_eager
    )
