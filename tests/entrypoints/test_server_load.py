"""Load and faults over real HTTP: 200 concurrent streaming requests, 30% of the clients
disconnecting at random points; /metrics counters agree with what was sent."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import ServerThread, read_metrics, tiny_engine, wait_idle
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import write_tiny_ouro

MODEL = "tiny-load"
EXTRA = {"ignore_eos": True, "exit_threshold": 0.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("load") / "tiny", seed=9)
    engine = tiny_engine(model_dir, num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=64)
    with ServerThread(build_app(engine, MODEL)) as srv:
        srv.engine = engine
        yield srv


async def stream_text(client, prompt: str, max_tokens: int, stop_after: int | None = None):
    """Stream a greedy completion; with `stop_after`, disconnect after that many chunks."""
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body=EXTRA,
    )  # fmt: skip
    text, chunks = "", 0
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            await stream.close()  # the client goes away mid-stream
            return None
    return text


def test_200_concurrent_streams_with_30_percent_disconnects(server):
    rng = random.Random(0)
    prompts = [f"def f{i}(x):\n    return x * {i}" for i in range(20)]
    max_tokens = 8

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60
        ) as client:
            alone = {p: await stream_text(client, p, max_tokens) for p in prompts}
            jobs = []
            for i in range(200):
                prompt = prompts[i % len(prompts)]
                leave = rng.randint(1, max_tokens) if rng.random() < 0.3 else None
                jobs.append((prompt, leave))
            results = await asyncio.wait_for(
                asyncio.gather(*(stream_text(client, p, max_tokens, s) for p, s in jobs)),
                timeout=120,
            )
            return alone, jobs, results

    alone, jobs, results = asyncio.run(run())
    left = sum(1 for _, s in jobs if s is not None)
    assert 40 <= left <= 80
    for (prompt, stop_after), text in zip(jobs, results, strict=True):
        if stop_after is None:
            assert text == alone[prompt]  # same tokens as when run alone
    wait_idle(server.engine)
    m = read_metrics(server.url)
    assert m["vllm:num_requests_running"] == 0
    assert m["vllm_rlt:num_free_kv_blocks"] == m["vllm_rlt:num_total_kv_blocks"]
    assert m['vllm:request_success_total{finished_reason="abort"}'] >= 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_counters_agree_with_what_was_sent(server):
    wait_idle(server.engine)
    tok = server.engine.tokenizer
    before = read_metrics(server.url)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    sent_prompt, sent_out = 0, 0
    for i, (prompt, n_out) in enumerate([("import os", 3), ("class A:", 5), ("x = [1, 2]", 2)]):
        stream = i % 2 == 1
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n_out, temperature=0, stream=stream,
            extra_body=EXTRA,
        )  # fmt: skip
        if stream:
            list(out)
        sent_prompt += len(tok.encode(prompt).ids)
        sent_out += n_out
    wait_idle(server.engine)
    after = read_metrics(server.url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == sent_prompt
    assert delta("vllm:generation_tokens_total") == sent_out
    assert delta('vllm:request_success_total{finished_reason="length"}') == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta('vllm_rlt:exit_depth_bucket{le="+Inf"}') == sent_out
