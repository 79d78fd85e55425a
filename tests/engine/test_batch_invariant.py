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
    Job,
    kv_all_free,
    make_engine,
    random_jobs,
    run_batched,
    run_serial,
)
from vllm_rlt.config import ConfigError, EngineConfig, ModelConfig
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cpu_per_depth_states_are_the_same_bits(model_dir, kv_cache_dtype):
    # the GPU diagnostic (benchmarks/probes/invariance.py) on the tiny model, its slowest case
    # only (the interpreter is slow): every depth's states and the logits of a 13-token prompt
    # prefilled by WCPB beside another request are bitwise those of atomic prefill alone (the
    # torch path differs there by ~1e-6), over the model's KV dtype and over FP8
    settings = dict(dtype="float32", device="cpu", attention_backend="auto", block_size=4,
                    prefill_chunk_size=4, max_num_batched_tokens=8, num_kv_blocks=512,
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    report = invariance.diagnostic(
        model_dir, True, list(range(3, 16)), list(range(50, 55)), [("wcpb", True)], **settings
    )
    assert all(d == 0 for diffs in report.values() for d in diffs), report


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_bf16_every_schedule_equals_serial(model_dir, enforce_eager, kv_cache_dtype):
    jobs = random_jobs(random.Random(3), 12, vocab=256, depth=4, max_prompt=30)
    _check_every_schedule_equals_serial(
        model_dir, "cuda", "bfloat16", jobs, SCHEDULES, enforce_eager=enforce_eager,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip


def feature_jobs(seed: int, threshold: float, spacing: int) -> list[Job]:
    """Greedy jobs arriving `spacing` steps apart, most of them behind one of two 12-token
    system prompts (prefix-cache hits for blocks of 4 once an earlier one's prompt is cached)."""
    rng = random.Random(seed)
    systems = [rng.choices(range(256), k=12) for _ in range(2)]
    jobs = []
    for i in range(10):
        prompt = (systems[i % 2] if i < 8 else []) + rng.choices(range(256), k=rng.randint(1, 20))
        params = SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.0,
                                exit_threshold=threshold, ignore_eos=True)  # fmt: skip
        jobs.append(Job(f"f{i}", prompt, params, spacing * i))
    return jobs


def _two_largest(jobs: list[Job]) -> int:
    """KV blocks (of 4 positions, in each of the tiny model's 4 planes) for two of the largest
    jobs at once: 8 at once must preempt."""
    return 2 * 4 * -(-max(len(j.prompt) + j.params.max_tokens for j in jobs) // 4)


# each feature on (against serial generation with it off): the jobs' arrival spacing, the
# engine settings, and what shows that the feature ran
FEATURES = {
    "prefix_hits": (
        3, lambda jobs: {"enable_prefix_caching": True}, lambda e: e.scheduler.prefix_hits > 0
    ),
    "preemption": (
        0, lambda jobs: {"num_kv_blocks": _two_largest(jobs)},
        lambda e: e.scheduler.num_preemptions > 0,
    ),
    "speculation": (  # prompts prefilled in few steps: most steps decode alone, with drafts
        0, lambda jobs: {"num_speculative_tokens": 2, "max_num_batched_tokens": 64,
                         "prefill_chunk_size": 32},
        lambda e: e.stats_dict()["spec_draft_tokens"] > 0,
    ),
}  # fmt: skip


def check_feature_equals_serial(model_dir, device, dtype, feature, threshold) -> None:
    """batch_invariant: 8 requests at once with `feature` give the tokens and exit depths of
    serial generation without it, exactly."""
    spacing, settings, exercised = FEATURES[feature]
    jobs = feature_jobs(len(feature), threshold, spacing)
    # the engine's exit threshold too: speculation with the gate (lanes) needs the gate on
    common = dict(
        device=device, backend="triton", dtype=dtype, batch_invariant=True, exit_threshold=threshold
    )
    serial = make_engine(model_dir, max_num_seqs=1, enable_prefix_caching=False, **common)
    want = run_serial(serial, jobs)
    defaults = {"enable_prefix_caching": False, "scheduling_mode": "mixed",
                "prefill_chunk_size": 5, "max_num_batched_tokens": 16}  # fmt: skip
    engine = make_engine(model_dir, max_num_seqs=8, **common, **{**defaults, **settings(jobs)})
    assert run_batched(engine, jobs) == want
    assert exercised(engine), feature
    assert kv_all_free(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [1.0, 0.5])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gpu_bf16_prefix_hits_preemption_and_speculation_equal_serial(
    model_dir, monkeypatch, feature, threshold
):
    # every window drafts (the random test model accepts few drafts)
    monkeypatch.setattr(SpecPlanner, "acceptance", lambda self: 1.0)
    check_feature_equals_serial(model_dir, "cuda", "bfloat16", feature, threshold)
