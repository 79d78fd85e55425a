"""Run a real uvicorn server for an app in a background thread (tests of the HTTP API)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine


def tiny_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    config = EngineConfig.from_kwargs(model=str(model_dir), device="cpu", dtype="float32", **kw)
    return LLMEngine(config)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app):
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def read_metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples by name (labels included)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    """Wait until no request runs and every KV block is free."""
    kv = engine.kv_manager
    deadline = time.monotonic() + timeout
    while kv.num_free_blocks != kv.num_total_blocks or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running or holding KV blocks"
        time.sleep(0.02)
