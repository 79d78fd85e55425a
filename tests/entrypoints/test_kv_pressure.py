"""KV pressure over real HTTP: a server whose KV cache holds exactly one request of
max_model_len positions serves 32 concurrent greedy streams that run (nearly) that long; each
gets exactly its solo output (requests are preempted and recompute), /metrics counts the
preemptions and the prefix-cache lookups, and the KV usage of every plane returns to 0."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from tests.entrypoints.server_utils import ServerThread, read_metrics, tiny_engine, wait_idle
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

MODEL = "tiny-pressure"
MAX_LEN = 64
BLOCK = 4
EXTRA = {"ignore_eos": True, "exit_threshold": 0.5}  # early exits: recompute keeps their depths


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("pressure") / "tiny", seed=5)


def jobs() -> list[tuple[list[int], int]]:
    """32 (prompt token ids, max_tokens): 16 prompts, each twice, half of them after a shared
    8-token prefix; prompt + max_tokens within 4 of MAX_LEN."""
    rng = random.Random(1)
    system = rng.choices(range(3, 400), k=8)
    out = []
    for i in range(16):
        prompt = (system if i % 2 else []) + rng.choices(range(3, 400), k=rng.randint(3, 12))
        max_tokens = MAX_LEN - len(prompt) - rng.randint(0, 4)
        out += [(prompt, max_tokens)] * 2
    return out


def solo_texts(model_dir, work) -> tuple[dict[int, str], int]:
    """Each distinct job's greedy text run alone in an offline engine with a large KV cache,
    and the model's number of KV planes."""
    engine = tiny_engine(model_dir, num_kv_blocks=4096, block_size=BLOCK)
    texts = {}
    for i, (prompt, max_tokens) in enumerate(work):
        if i % 2:
            continue
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **EXTRA)
        engine.add_request(str(i), prompt, params)
        (out,) = engine.generate_all()
        texts[i] = texts[i + 1] = out.outputs[0].text
    return texts, engine.kv_manager.num_planes


async def stream(client, prompt: list[int], max_tokens: int) -> tuple[str, str]:
    chunks = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body=EXTRA,
    )  # fmt: skip
    text, reason = "", None
    async for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def test_32_streams_through_a_kv_cache_for_one_request(model_dir):
    work = jobs()
    solo, planes = solo_texts(model_dir, work)
    num_blocks = planes * -(-MAX_LEN // BLOCK)  # exactly one request of MAX_LEN positions
    engine = tiny_engine(
        model_dir, num_kv_blocks=num_blocks, block_size=BLOCK, max_model_len=MAX_LEN,
        max_num_seqs=8, max_num_batched_tokens=32,
    )  # fmt: skip
    assert engine.max_model_len == MAX_LEN

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            models = await client.models.list()
            assert models.data[0].model_extra["max_model_len"] == MAX_LEN
            got = await asyncio.gather(*(stream(client, p, n) for p, n in work))
            wait_idle(engine)
            await stream(client, work[0][0], 4)  # the second run finds the first's blocks
            before = read_metrics(server.url)
            await stream(client, work[0][0], 4)
            return got, before

    with ServerThread(build_app(engine, MODEL)) as server:
        got, before = asyncio.run(run())
        assert [text for text, _ in got] == [solo[i] for i in range(len(work))]
        assert all(reason == "length" for _, reason in got)
        assert before["vllm:num_preemptions_total"] > 0
        m = read_metrics(server.url)
        queried = len(work[0][0]) - 1  # the last prompt position is always computed
        for name, grew in (("queries", queried), ("hits", queried // BLOCK * BLOCK)):
            name = f"vllm:prefix_cache_{name}_total"
            assert m[name] - before[name] == grew
        deadline = time.monotonic() + 10  # the snapshot follows the engine's last step
        usage = [f'vllm_rlt:kv_cache_usage_perc_by_plane{{plane="{p}"}}' for p in range(planes)]
        while any(m[name] for name in usage) or m["vllm:kv_cache_usage_perc"]:
            assert time.monotonic() < deadline, {name: m[name] for name in usage}
            time.sleep(0.05)
            m = read_metrics(server.url)
