"""Connections under faults and slow clients: a 500 leaves the keep-alive connection usable; a
body that does not arrive within --body-read-timeout gets 408; a connection that sends no whole
request head within --timeout-keep-alive is closed; the server stays healthy throughout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.entrypoints.server_utils import ServerThread, tiny_engine
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.entrypoints.openai.lifecycle import HeadTimeoutH11Protocol
from vllm_rlt.models.tiny import write_tiny_ouro

BODY_READ_TIMEOUT = 1.0
KEEP_ALIVE = 1


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("connections") / "tiny", seed=4)
    app = build_app(tiny_engine(model_dir), "tiny", body_read_timeout=BODY_READ_TIMEOUT)
    with ServerThread(app, http=HeadTimeoutH11Protocol, timeout_keep_alive=KEEP_ALIVE) as srv:
        srv.app = app
        yield srv


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(4096)
    return int(status_line.split()[1]), headers, body


def _get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes `sock` (after whatever it still sends) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def test_a_500_keeps_the_connection_usable(server, monkeypatch):
    def broken(*_):
        raise RuntimeError("/secret/path.py: bug")

    monkeypatch.setattr(server.app.state.server.metrics, "render", broken)
    with _connect(server) as sock:
        sock.sendall(_get("/metrics"))
        status, headers, body = _read_response(sock)
        assert status == 500
        error = json.loads(body)["error"]
        assert error["type"] == "InternalServerError" and error["code"] == 500
        assert "secret" not in error["message"]
        if headers.get("connection") != "close":  # then the same connection must go on
            sock.sendall(_get("/health"))
            assert _read_response(sock)[0] == 200


def test_a_body_slower_than_the_body_read_timeout_gets_408(server):
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"prompt": "x", ')
        status, headers, body = _read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert BODY_READ_TIMEOUT <= time.monotonic() - start < BODY_READ_TIMEOUT + 5
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "RequestTimeoutError" and error["code"] == 408
        assert _closed_within(sock, 5)
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHo"], ids=["idle", "half-head"])
def test_a_connection_without_a_whole_request_head_is_closed(server, sent):
    with _connect(server) as sock:
        sock.sendall(sent)
        assert _closed_within(sock, KEEP_ALIVE + 5)
    with _connect(server) as sock:  # a connection whose first request came in time goes on
        sock.sendall(_get("/health"))
        assert _read_response(sock)[0] == 200
        time.sleep(KEEP_ALIVE / 2)
        sock.sendall(_get("/health"))
        assert _read_response(sock)[0] == 200
