"""Prefix caching: outputs are identical with caching on and off in every prefill strategy and
scheduling mode (repeated prompts, shared system prompts with distinct suffixes, eviction under
pressure), and hit counts equal what the block arithmetic predicts."""

from __future__ import annotations

import random

import pytest

from tests.engine.harness import Job, compare, kv_all_free, make_engine, run_batched
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

D = 4
BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=41)


def greedy(max_tokens: int = 1, threshold: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, exit_threshold=threshold)


def test_hits_follow_the_block_arithmetic(model_dir):
    rng = random.Random(0)
    a = rng.choices(range(256), k=21)
    eng = make_engine(model_dir, block_size=BLOCK, prefill_chunk_size=5)
    sched = eng.scheduler

    def run(req_id: str, prompt: list[int]) -> tuple[int, int]:
        queries, hits = sched.prefix_queries, sched.prefix_hits
        run_batched(eng, [Job(req_id, prompt, greedy(3))])
        return sched.prefix_queries - queries, sched.prefix_hits - hits

    assert run("a", a) == (20, 0)  # the last position is always recomputed
    assert run("a2", a) == (20, 20)  # 5 full blocks of the 20 positions before it
    assert run("sys", a[:12] + [7, 7, 7, 7, 7]) == (16, 12)  # the shared 3 blocks
    assert run("short", a[:8]) == (7, 4)  # 7 positions hold one full block
    assert run("other", [a[0] + 1] + a[1:]) == (20, 0)  # a different first block breaks the chain
    assert kv_all_free(eng)


def test_eviction_takes_the_least_recently_released_blocks(model_dir):
    """24 blocks; A's 16 positions take 4 blocks per plane. X, 16 other positions, takes the 8
    blocks nobody used, then A's last two block rows (released first): A finds 2 blocks again."""
    rng = random.Random(1)
    a, x = rng.choices(range(256), k=16), rng.choices(range(256), k=16)
    eng = make_engine(model_dir, block_size=BLOCK, num_kv_blocks=24, prefill_chunk_size=16)
    for job in (Job("a", a, greedy()), Job("x", x, greedy())):
        run_batched(eng, [job])
    hits = eng.scheduler.prefix_hits
    run_batched(eng, [Job("a2", a, greedy())])
    assert eng.scheduler.prefix_hits - hits == 8
    assert kv_all_free(eng)


def shared_prefix_jobs(seed: int) -> list[Job]:
    """Repeated prompts and system prompts with distinct suffixes, staggered arrivals."""
    rng = random.Random(seed)
    systems = [rng.choices(range(256), k=rng.randint(4, 24)) for _ in range(2)]
    jobs = []
    for i in range(rng.randint(4, 7)):
        suffix = rng.choices(range(256), k=rng.randint(0, 10))
        prompt = rng.choice(systems) + suffix if suffix else rng.choice(systems)
        params = SamplingParams(
            max_tokens=rng.randint(1, 8),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randrange(10**6),
            exit_threshold=rng.choice([1.0, 0.5]),
            ignore_eos=True,
        )
        jobs.append(Job(f"s{i}", prompt, params, arrival_step=rng.randint(0, 12)))
    return jobs


@pytest.mark.parametrize("strategy", ["atomic", "split", "wavefront"])
@pytest.mark.parametrize("mode", ["refill", "no_refill", "mixed"])
@pytest.mark.parametrize("pressure", [False, True])
def test_caching_on_equals_caching_off(model_dir, strategy, mode, pressure):
    if strategy == "atomic" and mode != "refill":
        pytest.skip("atomic prefill is refill scheduling")
    near_ties = hits = 0
    for seed in range(4):
        jobs = shared_prefix_jobs(seed)
        longest = max(len(j.prompt) + j.params.max_tokens - 1 for j in jobs)
        settings = {
            "block_size": BLOCK,
            "prefill_chunk_size": 3 + seed,
            "max_num_batched_tokens": 16,
            "max_num_seqs": 4,
            "scheduling_mode": mode,
            "wavefront_chunked_prefill": strategy == "wavefront",
            "max_prefill_stall_loops": 1 if strategy == "split" else None,
        }
        if pressure:  # one longest request fits, and a little more: eviction and preemption
            settings["num_kv_blocks"] = D * (-(-longest // BLOCK) + 2)
        results = {}
        for caching in (False, True):
            eng = make_engine(model_dir, enable_prefix_caching=caching, **settings)
            results[caching] = run_batched(eng, jobs)
            assert kv_all_free(eng)
        near_ties += compare(eng, jobs, results[True], results[False], "last_exited")
        hits += eng.scheduler.prefix_hits
    assert hits > 0  # the cache was really used
    assert near_ties <= 1


def test_shared_layout_caches_prompt_blocks_too(model_dir):
    """Under SHARED a prompt position's KV after prefill is its last loop's (position waves), so
    cached blocks hold what a prefill from position 0 leaves: same outputs, real hits."""
    jobs = shared_prefix_jobs(7)
    results, hits = {}, 0
    for caching in (False, True):
        eng = make_engine(
            model_dir, block_size=BLOCK, kv_layout="shared", enable_prefix_caching=caching
        )
        results[caching] = run_batched(eng, jobs)
        hits = eng.scheduler.prefix_hits
        assert kv_all_free(eng)
    assert hits > 0
    assert compare(eng, jobs, results[True], results[False], "shared") <= 1
