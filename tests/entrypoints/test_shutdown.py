"""`vllm-rlt serve` stopping: SIGTERM lets running requests finish or, past --shutdown-timeout,
ends them (an error event then [DONE]; a non-streaming request gets 503), new requests get 503
meanwhile, and the process exits 0 with a quiet log; an engine loop that dies of a fault ends the
process with status 1 within seconds."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.entrypoints.server_utils import ServeProcess
from vllm_rlt.entrypoints.openai.lifecycle import DEAD_ENGINE_DRAIN_S

FLAGS = ["--device", "cpu", "--num-kv-blocks", "8192", "--max-num-seqs", "16"]
NUM_STREAMS = 12
LONG = 1000  # max_tokens of a generation that outlasts the tests


def _body(max_tokens: int, stream: bool) -> dict:
    return {"prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def _stream(url: str, max_tokens: int, started: threading.Semaphore) -> list[str]:
    """The SSE payloads of one streaming completion; releases `started` at the first one."""
    events, body = [], _body(max_tokens, True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    started.release()
    return events


def _ending(events: list[str]) -> str:
    """'full' for a stream that ran to max_tokens, the error's type for one that was ended."""
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if "error" in last:
        assert set(last["error"]) == {"message", "type", "param", "code"}
        return last["error"]["type"]
    assert last["choices"][0]["finish_reason"] == "length"
    return "full"


def _open_streams(pool, url: str, max_tokens: int) -> list:
    started = threading.Semaphore(0)
    futures = [pool.submit(_stream, url, max_tokens, started) for _ in range(NUM_STREAMS)]
    for _ in futures:
        assert started.acquire(timeout=60), "a stream did not start"
    return futures


def _send_partial_body(port: int) -> socket.socket:
    """A client that declares a 100-byte body and sends 10 bytes of it."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"prompt":')
    return sock


def _quiet(log: str) -> bool:
    return "Traceback" not in log and "Exception" not in log and "ERROR" not in log


def test_sigterm_lets_running_streams_finish_and_exits_0(tmp_path):
    with ServeProcess(tmp_path / "log", FLAGS) as server, ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = _open_streams(pool, server.url, max_tokens=24)
        _send_partial_body(server.port).close()  # a client that leaves mid-body: no noise
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert [_ending(f.result(timeout=60)) for f in futures] == ["full"] * NUM_STREAMS
        assert server.proc.wait(timeout=30 + 2) == 0
        assert time.monotonic() - sent < 30 + 2
        log = server.log()
        assert "server stopped" in log and _quiet(log), log


def test_shutdown_timeout_ends_running_requests_and_new_ones_get_503(tmp_path):
    flags = [*FLAGS, "--shutdown-timeout", "2"]
    pool = ThreadPoolExecutor(NUM_STREAMS + 1)
    with ServeProcess(tmp_path / "log", flags) as server, pool:
        url = server.url + "/v1/completions"
        whole = pool.submit(httpx.post, url, json=_body(LONG, False), timeout=60)
        futures = _open_streams(pool, server.url, max_tokens=LONG)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while httpx.get(server.url + "/health").status_code == 200:  # until the gate closes
            assert time.monotonic() - sent < 2
            time.sleep(0.02)
        late = httpx.post(url, json=_body(4, False))
        assert late.status_code == 503 and late.headers["connection"] == "close"
        assert late.json()["error"]["type"] == "ServiceUnavailableError"
        endings = [_ending(f.result(timeout=60)) for f in futures]
        assert endings == ["ServiceUnavailableError"] * NUM_STREAMS
        assert whole.result().status_code == 503
        assert whole.result().json()["error"]["code"] == 503
        assert server.proc.wait(timeout=2 + 2) == 0
        assert time.monotonic() - sent < 2 + 2
        log = server.log()
        assert "server stopped" in log and _quiet(log), log


# Runs `vllm-rlt serve` with every engine step failing once the file argv[1] exists.
FAULTY_SERVE = """
import os, sys
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints import cli

step = LLMEngine.step

def step_or_fault(self):
    if os.path.exists(sys.argv[1]):
        raise RuntimeError("injected device fault")
    return step(self)

LLMEngine.step = step_or_fault
sys.exit(cli.main(sys.argv[2:]))
"""


def test_engine_death_fails_requests_and_exits_non_zero(tmp_path):
    trigger = tmp_path / "fault"
    command = [sys.executable, "-c", FAULTY_SERVE, str(trigger)]
    with ServeProcess(tmp_path / "log", FLAGS, command) as server, ThreadPoolExecutor(2) as pool:
        started = threading.Semaphore(0)
        futures = [pool.submit(_stream, server.url, LONG, started) for _ in range(2)]
        for _ in futures:
            assert started.acquire(timeout=60)
        slow = _send_partial_body(server.port)  # a slow client must not keep the server up
        trigger.touch()
        faulted = time.monotonic()
        assert [_ending(f.result(timeout=30)) for f in futures] == ["InternalServerError"] * 2
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.proc.wait(timeout=DEAD_ENGINE_DRAIN_S + 3) == 1
        assert time.monotonic() - faulted < DEAD_ENGINE_DRAIN_S + 3
        slow.close()
        log = server.log()
        assert "injected device fault" in log and "server stopped: the engine failed" in log
