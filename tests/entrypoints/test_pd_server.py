"""`vllm-rlt serve --pd-prefill 2 --pd-decode 2`: four engine processes behind one front end,
driven with the `openai` client over real HTTP. 100 concurrent streaming requests get a single
engine's outputs; with one decode engine killed mid-run, the other requests still do, the
killed engine's requests end with an error, nothing hangs, /health reports the degraded state
and the surviving engines hold no blocks once idle; then the same with a prefill engine killed.
Clients that disconnect mid-stream leave no blocks behind either."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import CLI, ServeProcess, read_metrics, tiny_engine
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

SETTINGS = {"num_kv_blocks": 1024, "max_num_seqs": 16, "prefill_chunk_size": 8,
            "max_num_batched_tokens": 64, "wavefront_chunked_prefill": True}  # fmt: skip
EXIT_THRESHOLD = 0.5
TIMEOUT_S = 120  # a phase that takes longer fails (nothing may hang)


def flags(model_dir, *engines: str) -> list[str]:
    """`vllm-rlt serve` flags: the tiny model, SETTINGS, and `engines` (the engine processes)."""
    out = [str(model_dir), *engines, "--device", "cpu", "--dtype", "float32", "--block-size",
           "4", "--disable-log-requests"]  # fmt: skip
    for name, value in SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("pd") / "tiny", seed=9)


def jobs(seed: int, num: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            rng.choices(range(1, 200), k=rng.randint(1, 60)),
            SamplingParams(
                max_tokens=max_tokens,
                temperature=rng.choice([0.0, 1.0]),
                seed=rng.randrange(10**6),
                ignore_eos=True,
                exit_threshold=EXIT_THRESHOLD,
            ),  # fmt: skip
        )
        for _ in range(num)
    ]


def single_engine_texts(model_dir, work) -> list[str]:
    engine = tiny_engine(model_dir, **SETTINGS)
    for i, (prompt, params) in enumerate(work):
        engine.add_request(str(i), prompt, params)
    done = {o.request_id: o.outputs[0].text for o in engine.generate_all()}
    return [done[str(i)] for i in range(len(work))]


async def stream(client, prompt, params: SamplingParams, started: asyncio.Event, leave: bool):
    """The streamed text; `leave`: disconnect after the first chunk (None)."""
    out = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
        seed=params.seed, stream=True,
        extra_body={"ignore_eos": True, "exit_threshold": EXIT_THRESHOLD},
    )  # fmt: skip
    text = ""
    async for chunk in out:
        started.set()
        if leave:
            await out.close()
            return None
        text += "".join(c.text for c in chunk.choices)
    return text


async def run_all(url: str, work, on_started=None, leave=()) -> list[str | None | Exception]:
    """Every job at once; each result is the streamed text, None for the jobs in `leave`
    (their clients disconnect after the first chunk), or the error that ended it.
    `on_started` runs once some stream has received a chunk."""
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S
    ) as client:
        started = asyncio.Event()
        tasks = [
            asyncio.create_task(stream(client, p, s, started, i in leave))
            for i, (p, s) in enumerate(work)
        ]
        if on_started is not None:
            await started.wait()
            on_started()
        return await asyncio.gather(*tasks, return_exceptions=True)


def engine_pids(log: str, label: str) -> list[int]:
    """The pids `vllm-rlt serve` printed for `label` ("prefill engines", "replicas", ...)."""
    found = re.search(label + r": pids \[([\d, ]+)\]", log)
    return [int(p) for p in found.group(1).split(",")]


def check_partial(got, want) -> None:
    """Some requests ended with an error (the killed engine's), the others have their
    single-engine outputs."""
    failed = [g for g in got if isinstance(g, Exception)]
    assert failed, "the killed engine's requests end with an error"
    assert all(isinstance(g, openai.APIError) for g in failed), failed[:3]
    done = [(g, w) for g, w in zip(got, want, strict=True) if isinstance(g, str)]
    assert done, "the other engines' requests complete"
    assert all(g == w for g, w in done)


def wait_free(url: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard: generous on a loaded machine
    while True:
        m = read_metrics(url)
        if m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0:
            return
        assert time.monotonic() < deadline, f"blocks still held: {m['vllm:kv_cache_usage_perc']}"
        time.sleep(0.1)


def test_2p2d_streams_then_a_decode_and_a_prefill_engine_die(model_dir, tmp_path):
    work = jobs(0, 100, 8)
    long_work = jobs(1, 100, 24)
    want = single_engine_texts(model_dir, work)
    want_long = single_engine_texts(model_dir, long_work)
    leave = set(range(0, 100, 10))  # these clients disconnect after their first chunk

    def run(items, on_started=None, leave=()):
        return asyncio.run(asyncio.wait_for(run_all(srv.url, items, on_started, leave), TIMEOUT_S))

    pd = flags(model_dir, "--pd-prefill", "2", "--pd-decode", "2")
    with ServeProcess(tmp_path / "serve.log", pd) as srv:
        got = run(work, leave=leave)
        assert got == [None if i in leave else w for i, w in enumerate(want)]
        wait_free(srv.url)
        m = read_metrics(srv.url)  # every request's KV moved (the clients that left had a token)
        assert m["vllm_rlt:pd_transfers_total"] == len(work)
        assert m["vllm_rlt:pd_kv_transfer_chunks_total"] >= len(work)
        assert m["vllm_rlt:pd_kv_transfer_bytes_total"] > 0

        victim = engine_pids(srv.log(), "decode engines")[1]
        check_partial(run(long_work, lambda: os.kill(victim, signal.SIGKILL)), want_long)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        assert "degraded: decode engine 1" in health.json()["error"]["message"]
        wait_free(srv.url)  # the survivors freed the failed requests' blocks
        assert run(work[:10]) == want[:10]  # the survivors go on serving

        victim = engine_pids(srv.log(), "prefill engines")[0]
        check_partial(run(long_work, lambda: os.kill(victim, signal.SIGKILL)), want_long)
        assert "prefill engine 0" in httpx.get(srv.url + "/health").json()["error"]["message"]
        wait_free(srv.url)
        assert run(work[:10]) == want[:10]  # one prefill and one decode engine still serve


def test_prefill_engines_without_decode_engines_is_a_one_line_error():
    done = subprocess.run(
        [*CLI, "serve", "--port", "0", "--pd-prefill", "1"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: pd_prefill and pd_decode must be both 0 or both >= 1, got (1, 0)"
    ]
