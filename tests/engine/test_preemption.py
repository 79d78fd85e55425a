"""Preemption with exact recovery: under a KV cache that holds one maximum-length request, every
request of a random workload still produces exactly its solo tokens and exit depths, in every
prefill strategy (atomic, split, WCPB) and scheduling mode, with and without prefix caching; no
block leaks; every workload finishes in a bounded number of steps."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from tests.engine.harness import Job, compare, kv_all_free, make_engine, random_extras, run_batched
from tests.engine.test_speculative_gate import _jobs as gate_jobs
from vllm_rlt.models.tiny import default_model_dir, write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

D = 4
BLOCK = 4
STRATEGIES = ("atomic", "split", "wavefront")
MODES = ("refill", "no_refill", "mixed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=33)


def workload(seed: int):
    """Random jobs (staggered arrivals, exits on or off, greedy and sampled, logit biases and
    penalties, shared prefixes) and engine settings; the KV cache holds exactly one request of
    the longest job's length."""
    rng = random.Random(seed)
    exits = rng.random() < 0.5
    system = rng.choices(range(256), k=rng.randint(0, 8))
    jobs = []
    for i in range(rng.randint(2, 4)):
        prompt = system + rng.choices(range(256), k=rng.randint(1, 20))
        params = SamplingParams(
            max_tokens=rng.randint(1, 10),
            temperature=rng.choice([0.0, 0.0, 1.0]),
            seed=rng.randrange(10**6),
            exit_threshold=rng.choice([0.3, 0.5, 0.8]) if exits else 1.0,
            logprobs=rng.choice([None, None, 2]),
            ignore_eos=True,
            **random_extras(seed, i, range(256)),  # (a resumed request recounts its output)
        )
        jobs.append(Job(f"p{i}", prompt, params, rng.randint(0, 6), rng.randint(0, 2)))
    longest = max(len(j.prompt) + j.params.max_tokens - 1 for j in jobs)
    strategy = STRATEGIES[seed % 3]
    settings = {
        "num_kv_blocks": D * -(-longest // BLOCK),
        "block_size": BLOCK,
        "prefill_chunk_size": rng.randint(1, 16),
        "max_num_batched_tokens": rng.randint(4, 32),
        "max_num_seqs": rng.randint(2, 6),
        "scheduling_mode": "refill" if strategy == "atomic" else MODES[seed // 3 % 3],
        "wavefront_chunked_prefill": strategy == "wavefront",
        "max_prefill_stall_loops": 1 if strategy == "split" else None,
        "enable_prefix_caching": rng.random() < 0.5,
        "queue_policy": rng.choice(["fcfs", "priority"]),
        "async_scheduling": rng.random() < 0.7,
        "max_context_with_decode": rng.choice([0, 12, 2048]),  # R7: always, past 12, never
    }
    return jobs, settings


def step_bound(jobs) -> int:
    """Steps a workload may take: every position of every job through every depth, one row per
    step, and the time its latest arrival waits, four times over."""
    work = sum((len(j.prompt) + j.params.max_tokens) * D for j in jobs)
    return 4 * (work + max(j.arrival_step for j in jobs)) + 50


def run_workload(model_dir, seed: int, device="cpu", backend="torch", **extra) -> tuple[int, int]:
    """Returns (preemptions, near-ties); `extra`: settings of both engines (the solo one and
    the preempting one)."""
    jobs, settings = workload(seed)
    solo = make_engine(model_dir, device, backend, max_num_seqs=1, **extra)
    want = {}
    for job in jobs:
        want.update(run_batched(solo, [Job(job.req_id, job.prompt, job.params)]))
    eng = make_engine(model_dir, device, backend, **settings, **extra)
    steps = itertools.count(1)

    def bounded(_):
        assert next(steps) <= step_bound(jobs), f"workload {seed} exceeds its step bound"

    got = run_batched(eng, jobs, check=bounded)
    near_ties = compare(eng, jobs, got, want, "last_exited")
    assert kv_all_free(eng)  # cached blocks nobody holds count as free
    assert eng.kv_manager.pool.plane_usage() == [0] * D
    return eng.scheduler.num_preemptions, near_ties


SUITE = 200


@pytest.mark.parametrize("block", range(8))
def test_preempted_requests_equal_their_solo_runs(model_dir, block):
    """200 workloads in 8 blocks; preemption must really happen in most of them."""
    seeds = range(block * SUITE // 8, (block + 1) * SUITE // 8)
    results = [run_workload(model_dir, s) for s in seeds]
    preempted = sum(1 for p, _ in results if p)
    total = sum(p for p, _ in results)
    near_ties = sum(t for _, t in results)
    print(f"block {block}: {preempted}/{len(seeds)} workloads preempted, {total} preemptions")
    assert preempted >= len(seeds) // 2
    assert near_ties <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_preemption_on_gpu(model_dir, backend):
    """A subset on CUDA (fp32, CUDA graphs with the triton backend)."""
    results = [run_workload(model_dir, s, "cuda", backend) for s in range(24)]
    assert sum(1 for p, _ in results if p) >= 12
    assert sum(t for _, t in results) <= 2


def test_held_tokens_do_not_wait_for_a_request_preemption_keeps_taking():
    """refill scheduling at fixed depth, tokens that exited wait for the others' (phase hold).
    A resumed request whose recompute left no block for its next token was preempted as its
    decode row was placed, admitted again and recomputed in the next step, and so on, while
    the held requests waited for it: the engine never finished (found by fuzzing). Such a plan
    is now made again without the preempted request."""
    jobs = [
        replace(j, params=replace(j.params, exit_threshold=1.0, min_loops=None, temperature=0.0))
        for j in gate_jobs(3142, 9)
    ]
    kw = dict(block_size=4, scheduling_mode="refill", prefill_chunk_size=16,
              max_num_batched_tokens=64)  # fmt: skip
    solo = make_engine(default_model_dir(), max_num_seqs=1, **kw)
    solo.eos_token_ids = (7, 11)
    want = {}
    for job in jobs:
        want.update(run_batched(solo, [Job(job.req_id, job.prompt, job.params)]))
    eng = make_engine(default_model_dir(), max_num_seqs=6, num_kv_blocks=160, **kw)
    eng.eos_token_ids = (7, 11)
    steps = itertools.count(1)

    def bounded(_):
        assert next(steps) <= 400, "the engine makes no progress"

    assert run_batched(eng, jobs, check=bounded) == want
    assert eng.scheduler.num_preemptions > 0 and kv_all_free(eng)
