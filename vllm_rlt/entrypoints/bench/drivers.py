"""Drivers that replay a workload and record every request the same way.

`run_inprocess` talks to an `AsyncLLMEngine` in this process; `run_http` streams from an
OpenAI-compatible `/v1/completions` endpoint. A chunk is an engine output with new tokens
(in-process) or an SSE event that carries choices (HTTP), as docs/benchmarks/README.md §2 defines
TTFT and ITL.
`gpu_activity` measures the GPU busy time of whatever runs inside it (CUDA only). `on_done`, when
given, is called as each request ends (live progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from vllm_rlt.entrypoints.bench.metrics import RequestRecord, device_time_by_name, gpu_busy_seconds
from vllm_rlt.entrypoints.bench.workload import RequestSpec, Workload
from vllm_rlt.sampling_params import SamplingParams

SendFn = Callable[[int, RequestSpec, RequestRecord], Awaitable[None]]
OnDone = Callable[[], None] | None


async def _replay(
    workload: Workload, send: SendFn, on_done: OnDone
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival offset, at most `concurrency` in flight; the wait for
    the semaphore is not counted in TTFT."""
    gate = asyncio.Semaphore(workload.concurrency)
    records: list[RequestRecord] = [None] * len(workload.requests)  # type: ignore[list-item]
    start = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> None:
        delay = start + spec.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            rec = RequestRecord(time.perf_counter(), len(spec.prompt_token_ids))
            records[i] = rec
            try:
                await send(i, spec, rec)
            except Exception:
                rec.ok = False
            if on_done is not None:
                on_done()

    await asyncio.gather(*(one(i, s) for i, s in enumerate(workload.requests)))
    return records, time.perf_counter() - start


@contextlib.contextmanager
def gpu_activity():
    """Record the GPU's kernels, copies and memsets (CUPTI activity only, no host-op tracing)
    while the block runs; on exit the yielded dict gets `gpu_busy_s`, their merged duration, and
    `gpu_kernels`, the 20 activity names with the most GPU time ([name, us, count]).
    Recording adds a little host time per launch, so runs measured this way are reported
    apart from timed runs."""
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, float] = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield result
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        result["gpu_busy_s"] = gpu_busy_seconds(events)
        result["gpu_kernels"] = device_time_by_name(events)[:20]


async def run_inprocess(engine, workload: Workload, tag: str = "bench", on_done: OnDone = None):
    """Replay `workload` against an AsyncLLMEngine; returns (records, duration_s)."""

    async def send(i: int, spec: RequestSpec, rec: RequestRecord) -> None:
        params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
        seen = 0
        async for out in engine.generate(f"{tag}-{i}", spec.prompt_token_ids, params):
            n = len(out.outputs[0].token_ids)
            if n > seen:
                rec.chunk_s.append(time.perf_counter())
                seen = n
        rec.output_tokens = seen

    return await _replay(workload, send, on_done)


async def run_http(
    base_url: str,
    model: str,
    workload: Workload,
    api_key: str | None = None,
    on_done: OnDone = None,
):
    """Replay `workload` against `{base_url}/v1/completions` with streaming."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None) as client:

        async def send(i: int, spec: RequestSpec, rec: RequestRecord) -> None:
            body = {
                "model": model,
                "prompt": spec.prompt_token_ids,
                "max_tokens": spec.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices"):
                        rec.chunk_s.append(time.perf_counter())
                    if event.get("usage"):
                        rec.output_tokens = event["usage"]["completion_tokens"]

        return await _replay(workload, send, on_done)
