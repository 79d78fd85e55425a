"""Data-parallel replicas, 2 engine processes behind one front end, fp32: a random workload with
staggered arrivals gives every request the tokens and exit depths a single engine gives; both
replicas serve (least-loaded routing); no blocks are held afterwards; bad input is a ValueError
(the replica's `Rejected(invalid=True)`, the app's 400), as is n > 1."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.disagg.test_pd_equivalence import TIMEOUT_S, run_pd
from tests.engine.harness import compare, make_engine, random_jobs, run_batched
from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg.replicas import ReplicaRouter
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.serve_config import DisaggConfig

SETTINGS = {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True,
            "prefill_chunk_size": 16, "max_num_batched_tokens": 32, "max_num_seqs": 4}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=23)


def test_replicas_equal_single_engine(model_dir):
    single = make_engine(model_dir, **SETTINGS)
    jobs = random_jobs(random.Random(5), 24, 256, single.num_loops, max_prompt=80)
    want = run_batched(single, jobs)
    config = EngineConfig.from_kwargs(
        model=str(model_dir), device="cpu", attention_backend="torch", dtype="float32",
        num_kv_blocks=4096, block_size=4, **SETTINGS,
    )  # fmt: skip
    router = ReplicaRouter(config, DisaggConfig(data_parallel_size=2))

    async def scenario():
        try:
            got = await asyncio.wait_for(run_pd(router, jobs), TIMEOUT_S)
            with pytest.raises(ValueError, match="prompt is empty"):
                await router.add_request("empty", [], SamplingParams(max_tokens=1))
            with pytest.raises(ValueError, match="n=1"):
                await router.add_request("n2", [1, 2], SamplingParams(max_tokens=1, n=2))
            return got, await router.probe()
        finally:
            await router.shutdown()

    got, statuses = asyncio.run(scenario())
    assert compare(single, jobs, got, want, "last_exited") == 0
    assert all(e.routed for e in router.engines)  # least-loaded: both replicas served
    assert sum(e.routed for e in router.engines) == len(jobs) + 1  # (+ the rejected one)
    assert all(e.load == 0 for e in router.engines)
    for status in statuses:  # nothing leaked on either replica
        assert status.num_free_blocks == status.num_total_blocks
        assert status.num_running == status.num_waiting == 0
