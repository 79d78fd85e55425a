"""No request can hurt another, over real HTTP: bodies that once killed the engine are 400s while
streams run, and a fault in one request's own processing ends that request alone (a stream gets
an error event then [DONE], a plain request a 500) while the others finish with their solo text.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import ServerThread, tiny_engine, wait_idle
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import write_tiny_ouro

MODEL = "tiny"
PROMPTS = [f"def f{i}(x):" for i in range(8)]
KILLERS = [  # each once ended the engine loop for every request
    {"prompt": "a", "max_tokens": 2, "top_k": 9223372036854775808},
    {"prompt": "a", "max_tokens": 2, "temperature": 0, "seed": 9223372036854775807, "n": 2},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("isolation") / "tiny", seed=5)
    engine = tiny_engine(model_dir, max_num_seqs=8, num_kv_blocks=512)
    with ServerThread(build_app(engine, MODEL)) as srv:
        srv.engine = engine
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        yield srv


def _stream_text(client, prompt: str, started: threading.Event | None = None) -> str:
    text = ""
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if started is not None:
            started.set()
        text += "".join(c.text for c in chunk.choices)
    return text


def _run_streams(client, prompts: list[str], while_running) -> list[str]:
    """Stream every prompt at once; once all have produced output, call `while_running()`."""
    texts: list[str | None] = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        texts[i] = _stream_text(client, prompts[i], started[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(timeout=60)
    while_running()
    for t in threads:
        t.join(timeout=120)
    return texts


def test_engine_killing_bodies_are_400_while_streams_run(server):
    solo = [_stream_text(server.client, p) for p in PROMPTS]
    answers = []

    def send_killers() -> None:
        for body in KILLERS:
            answers.append(httpx.post(server.url + "/v1/completions", json=body))

    assert _run_streams(server.client, PROMPTS, send_killers) == solo
    assert [a.status_code for a in answers] == [400, 400]
    assert [a.json()["error"]["param"] for a in answers] == ["top_k", "seed"]
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server.engine)


def test_a_fault_in_one_request_ends_it_alone(server, monkeypatch):
    """The victim's detokenization raises mid-generation: its stream gets an error event and
    [DONE], a non-streaming victim a 500; the other streams finish with their solo text."""
    solo = [_stream_text(server.client, p) for p in PROMPTS[:4]]
    victim = server.engine.tokenizer.encode("class Victim:").ids
    process = server.engine.outputs.process

    def faulty(req):
        if req.prompt_token_ids == victim and len(req.output_token_ids) == 4:
            raise RuntimeError("detokenizer fault")
        return process(req)

    monkeypatch.setattr(server.engine.outputs, "process", faulty)
    body = {"prompt": "class Victim:", "max_tokens": 20, "ignore_eos": True}
    answers: dict[str, object] = {}

    def send_victims() -> None:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}
        ) as r:
            answers["stream"] = [line for line in r.iter_lines() if line]
        answers["plain"] = httpx.post(server.url + "/v1/completions", json=body)

    assert _run_streams(server.client, PROMPTS[:4], send_victims) == solo
    events = [line.removeprefix("data: ") for line in answers["stream"]]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "InternalServerError" and "failed while generating" in error["message"]
    assert answers["plain"].status_code == 500
    assert "failed while generating" in answers["plain"].json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server.engine)  # the victims' KV blocks are free again
    assert _stream_text(server.client, PROMPTS[0]) == solo[0]
