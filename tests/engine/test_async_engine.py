"""AsyncLLMEngine: one loop owns the engine; results match the sync engine; closing a stream
aborts its request and frees its KV at once; a failed step fails every stream."""

from __future__ import annotations

import asyncio

import pytest

from tests.entrypoints.server_utils import tiny_engine
from vllm_rlt.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStoppedError
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("async") / "tiny", seed=5)


async def _collect(engine: AsyncLLMEngine, req_id: str, prompt, params):
    last = None
    async for out in engine.generate(req_id, prompt, params):
        last = out
    return last


def test_matches_sync_engine_and_abort_frees_kv(model_dir):
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=2, ignore_eos=True),
    ]
    prompts = ["def f(x):", [5, 6, 7, 8]]
    sync = tiny_engine(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        sync.add_request(str(i), prompt, p)
    want = {o.request_id: [c.token_ids for c in o.outputs] for o in sync.generate_all()}

    async def main():
        engine = AsyncLLMEngine(tiny_engine(model_dir))
        long = engine.generate("long", "x", SamplingParams(max_tokens=200, ignore_eos=True))
        first = await long.__anext__()
        assert len(first.outputs[0].token_ids) == 1
        outs = await asyncio.gather(
            *(_collect(engine, str(i), prompts[i], params[i]) for i in range(len(prompts)))
        )
        await long.aclose()  # aborts "long" before the next step
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request("bad", "x", SamplingParams(max_tokens=5000))
        await engine.generate("after", "y", SamplingParams(max_tokens=1)).__anext__()
        kv = engine.engine.kv_manager
        assert kv.num_free_blocks == kv.num_total_blocks
        assert not engine.engine.has_unfinished_requests()
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert {o.request_id: [c.token_ids for c in o.outputs] for o in outs} == want
    assert all(o.finished for o in outs)


def test_failed_step_fails_streams_and_later_requests(model_dir):
    async def main():
        engine = AsyncLLMEngine(tiny_engine(model_dir))
        stream = await engine.add_request("a", "x", SamplingParams(max_tokens=50))
        await stream.__anext__()

        def broken():
            raise RuntimeError("boom")

        engine.engine.step = broken
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError) as err:
            await engine.add_request("b", "x", SamplingParams(max_tokens=2))
        assert not isinstance(err.value, EngineStoppedError)
        assert isinstance(engine.error, RuntimeError)

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_shutdown_ends_open_streams_and_later_requests_as_stopped(model_dir):
    async def main():
        engine = AsyncLLMEngine(tiny_engine(model_dir))
        stream = await engine.add_request("a", "x", SamplingParams(max_tokens=50))
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineStoppedError):
            await engine.add_request("b", "x", SamplingParams(max_tokens=2))
        assert engine.error is None and not engine.is_healthy  # stopped, not failed

    asyncio.run(asyncio.wait_for(main(), timeout=30))
