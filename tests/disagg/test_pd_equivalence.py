"""Prefill/decode disaggregation, 1 prefill + 1 decode process over gloo, fp32: random
workloads (staggered arrivals, prompts 1-300, chunks 1-64, atomic / split / WCPB on the
prefill side, early exit on and off, an FP8 KV cache or not) give every request the tokens
and exit depths a single engine gives; no block leaks on either side; a multi-chunk prompt's
first chunk reaches the decode engine before the prefill engine has finished the prompt; a
prompt the decode engine has seen is transferred without the blocks its prefix cache holds.
The workloads are the WCPB suite's (`tests/engine/test_wcpb.py`)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.engine.harness import Job, compare, make_engine, run_batched
from tests.engine.test_wcpb import workload
from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg.front_end import FrontEnd
from vllm_rlt.disagg.router import PDRouter
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.serve_config import DisaggConfig

MODES = {
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wcpb": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
    # an FP8 KV cache on both sides: its bytes cross unchanged
    "wcpb_fp8": {
        "scheduling_mode": "mixed",
        "wavefront_chunked_prefill": True,
        "kv_cache_dtype": "fp8",
    },
}
ARRIVAL_GAP_S = 0.02  # seconds per arrival step
TIMEOUT_S = 120  # a run that takes longer fails (nothing may hang)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=21)


def multi_chunk_workload(first_seed: int) -> tuple[list[Job], dict]:
    """The WCPB suite's random workload (test_wcpb.workload) of the first seed from
    `first_seed` on with a prompt of three chunks or more."""
    for seed in itertools.count(first_seed):
        jobs, settings = workload(seed)
        if any(len(j.prompt) > 2 * settings["prefill_chunk_size"] for j in jobs):
            return jobs, settings
    raise AssertionError("unreachable")


async def run_pd(router: FrontEnd, jobs: list[Job]) -> dict[str, tuple]:
    """Every job through a front end (PD or replicas), each at its arrival step; (tokens,
    exit depths) by request id."""

    async def one(job: Job) -> tuple[str, tuple]:
        await asyncio.sleep(job.arrival_step * ARRIVAL_GAP_S)
        last = None
        async for out in await router.add_request(job.req_id, job.prompt, job.params):
            last = out
        c = last.outputs[0]
        return job.req_id, (tuple(c.token_ids), tuple(c.exit_depths))

    return dict(await asyncio.gather(*(one(j) for j in jobs)))


@pytest.mark.parametrize(
    "mode,device",
    [
        *((mode, "cpu") for mode in MODES),
        # one GPU: both engines on it, the KV through host memory over gloo
        pytest.param("wcpb", "cuda", marks=pytest.mark.gpu),
        pytest.param("wcpb_fp8", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_pd_equals_single_engine(model_dir, mode, device):
    jobs, settings = multi_chunk_workload(10 * list(MODES).index(mode))
    settings |= MODES[mode]
    backend = "torch" if device == "cpu" else "triton"
    single = make_engine(model_dir, device, backend, **settings)
    want = run_batched(single, jobs)
    config = EngineConfig.from_kwargs(
        model=str(model_dir), device=device, attention_backend=backend, dtype="float32",
        num_kv_blocks=4096, block_size=4, **settings,
    )  # fmt: skip
    router = PDRouter(config, DisaggConfig(pd_prefill=1, pd_decode=1), record_transfers=True)
    longest = max(jobs, key=lambda j: len(j.prompt))

    async def scenario():
        try:
            got = await asyncio.wait_for(run_pd(router, jobs), TIMEOUT_S)
            # the longest prompt again: the decode engine's prefix cache holds its blocks
            again = [Job(f"{longest.req_id}-again", longest.prompt, longest.params)]
            got |= await asyncio.wait_for(run_pd(router, again), TIMEOUT_S)
            return got, await router.probe()
        finally:
            await router.shutdown()

    got, statuses = asyncio.run(scenario())
    assert compare(single, jobs, got, want, "last_exited") == 0
    assert got[f"{longest.req_id}-again"] == want[longest.req_id]
    skipped = router.transfers[f"{longest.req_id}-again"]["skip_blocks"]
    assert skipped == (len(longest.prompt) - 1) // 4  # whole blocks before the last position
    for status in statuses:  # nothing leaked on either side
        assert status.num_free_blocks == status.num_total_blocks
        assert status.num_running == status.num_waiting == 0
    chunk = settings["prefill_chunk_size"]
    # the transfer streamed beside the prefill: a prompt of three chunks or more went in at least
    # two sends, its first ones queued while later chunks still ran (when they arrive is up to the
    # receiving thread, so the clock times are not compared)
    for job in [j for j in jobs if len(j.prompt) > 2 * chunk]:
        assert router.transfers[job.req_id]["chunks"] >= 2, job.req_id
    # /metrics' transfer counters: every prompt block not in the decode cache, every plane
    kv = single.runner.kv_cache.kv  # [L, 2, blocks, block_size, Hkv, d]
    position_bytes = kv[:, :, 0, 0].numel() * kv.element_size()
    prompts = {j.req_id: len(j.prompt) for j in jobs} | {
        f"{longest.req_id}-again": len(longest.prompt)
    }
    sent_blocks = sum(-(-n // 4) - router.transfers[r]["skip_blocks"] for r, n in prompts.items())
    stats, planes = router.snapshot.stats, single.kv_manager.num_planes
    assert stats["pd_transfers"] == len(prompts)
    assert stats["pd_kv_transfer_bytes"] == sent_blocks * planes * 4 * position_bytes
    assert stats["pd_kv_transfer_skipped_blocks"] == skipped
    overlap = [t["prefill_done_at"] - t["first_chunk_at"] for t in router.transfers.values()]
    assert stats["pd_transfer_overlap_seconds"] == pytest.approx(sum(max(0, o) for o in overlap))
