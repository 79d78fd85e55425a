"""Server behaviour under load and failure: 429 when the waiting queue is full, and a dead
engine loop (health 503, an error event then [DONE] on open streams, 500 for new requests)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_utils import ServerThread, tiny_engine
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import write_tiny_ouro


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("failures") / "tiny", seed=4)
    engine = tiny_engine(model_dir, max_num_seqs=1)
    app = build_app(engine, "tiny", max_waiting_requests=1)
    with ServerThread(app) as srv:
        srv.engine = engine
        srv.async_engine = app.state.server.engine
        yield srv


def _long(stream: bool) -> dict:
    return {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": stream}


ERROR_TYPES = {429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == ERROR_TYPES[status]
    return err


def test_full_waiting_queue_answers_429(server):
    url = server.url + "/v1/completions"
    with httpx.stream("POST", url, json=_long(True)) as running:
        lines = running.iter_lines()  # keep it: a collected iterator closes the connection
        assert next(lines).startswith("data: ")  # the first request runs (max_num_seqs=1)
        waiting = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": _long(False)})
        waiting.start()
        deadline = time.monotonic() + 10
        while server.async_engine.snapshot.num_waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        resp = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
        _error(resp, 429)
        assert resp.headers["retry-after"] == "1"
    waiting.join(timeout=60)
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_dead_engine_loop_is_reported(server, monkeypatch):
    url = server.url + "/v1/completions"
    assert httpx.get(server.url + "/health").status_code == 200
    with httpx.stream("POST", url, json=_long(True)) as resp:
        lines = (line for line in resp.iter_lines() if line)
        assert next(lines).startswith("data: {")

        def broken_step():
            raise RuntimeError("/secret/path.py: device lost")

        monkeypatch.setattr(server.engine, "step", broken_step)
        events = [line.removeprefix("data: ") for line in lines]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "InternalServerError" and error["code"] == 500
    assert "secret" not in error["message"] and ".py" not in error["message"]
    _error(httpx.get(server.url + "/health"), 503)
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": 2}), 500)
    _error(httpx.post(url, json={"prompt": "x", "max_tokens": 2, "stream": True}), 500)
