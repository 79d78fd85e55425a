"""Prefill/decode disaggregation, 1 prefill + 1 decode process over gloo, fp32: random
workloads (staggered arrivals, prompts 1-300, chunks 1-64, atomic / split / WCPB on the
prefill side, early exit on and off) give every request the tokens and exit depths a single
engine gives; no block leaks on either side; a multi-chunk prompt's first chunk reaches the
decode engine before the prefill engine has finished the prompt."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.engine.harness import Job, compare, make_engine, run_batched
from vllm_rlt.config import DisaggConfig, EngineConfig
from vllm_rlt.disagg.router import PDRouter
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

MODES = {
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wcpb": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
}
ARRIVAL_GAP_S = 0.02  # seconds per arrival step
TIMEOUT_S = 120  # a run that takes longer fails (nothing may hang)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=21)


def workload(seed: int) -> tuple[list[Job], dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(8):
        prompt = rng.choices(range(256), k=rng.choice([rng.randint(1, 40), rng.randint(1, 300)]))
        params = SamplingParams(
            max_tokens=rng.randint(1, 6),
            temperature=rng.choice([0.0, 0.0, 1.0]),
            seed=rng.randrange(10**6),
            exit_threshold=rng.choice([1.0, 0.3, 0.5, 0.8]),  # 1.0: exits off
            ignore_eos=True,
        )
        jobs.append(Job(f"w{i}", prompt, params, rng.randint(0, 8)))
    settings = {
        "prefill_chunk_size": rng.randint(1, 64),
        "max_num_batched_tokens": rng.randint(16, 64),
        "max_num_seqs": rng.randint(2, 8),
    }
    return jobs, settings


async def run_pd(router: PDRouter, jobs: list[Job]) -> dict[str, tuple]:
    async def one(job: Job) -> tuple[str, tuple]:
        await asyncio.sleep(job.arrival_step * ARRIVAL_GAP_S)
        last = None
        async for out in await router.add_request(job.req_id, job.prompt, job.params):
            last = out
        c = last.outputs[0]
        return job.req_id, (tuple(c.token_ids), tuple(c.exit_depths))

    return dict(await asyncio.gather(*(one(j) for j in jobs)))


@pytest.mark.parametrize("mode", list(MODES))
def test_pd_equals_single_engine(model_dir, mode):
    jobs, settings = workload(list(MODES).index(mode))
    settings |= MODES[mode]
    single = make_engine(model_dir, **settings)
    want = run_batched(single, jobs)
    config = EngineConfig.from_kwargs(
        model=str(model_dir), device="cpu", attention_backend="torch", dtype="float32",
        num_kv_blocks=4096, block_size=4, **settings,
    )  # fmt: skip
    router = PDRouter(config, DisaggConfig(pd_prefill=1, pd_decode=1), record_timings=True)

    async def scenario():
        try:
            got = await asyncio.wait_for(run_pd(router, jobs), TIMEOUT_S)
            return got, await router.probe()
        finally:
            await router.shutdown()

    got, statuses = asyncio.run(scenario())
    assert compare(single, jobs, got, want, "last_exited") == 0
    for status in statuses:  # nothing leaked on either side
        assert status.num_free_blocks == status.num_total_blocks
        assert status.num_running == status.num_waiting == 0
    chunk = settings["prefill_chunk_size"]
    multi = [j for j in jobs if len(j.prompt) > chunk and len(j.prompt) > 4]
    assert multi, "the workload has a multi-chunk prompt"
    for job in multi:  # the transfer overlapped the prefill of later chunks
        t = router.timings[job.req_id]
        assert t["first_chunk_at"] < t["prefill_done_at"], job.req_id
