"""Run a real uvicorn server for an app in a background thread, or `vllm-rlt serve` in a
subprocess (tests of the HTTP API)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.openai.api_server import build_app


def tiny_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    config = EngineConfig.from_kwargs(model=str(model_dir), device="cpu", dtype="float32", **kw)
    return LLMEngine(config)


@contextlib.contextmanager
def tiny_server(model_dir, model: str, api_key: str | None, **app_options):
    """A tiny engine served on 127.0.0.1 (`srv.engine` is the engine), for a module fixture;
    `app_options`: more `build_app` arguments."""
    engine = tiny_engine(model_dir)
    with ServerThread(build_app(engine, model, api_key=api_key, **app_options)) as srv:
        srv.engine = engine
        yield srv


def openai_client(srv, api_key: str | None) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app, **options):
        """`options`: more uvicorn.Config options (e.g. http=, timeout_keep_alive=)."""
        self.port = free_port()
        options = {"host": "127.0.0.1", "port": self.port, "log_level": "warning", **options}
        self.server = uvicorn.Server(uvicorn.Config(app, **options))
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


CLI = [sys.executable, "-m", "vllm_rlt.entrypoints.cli"]


class ServeProcess:
    """`vllm-rlt serve FLAGS` in a subprocess on a free port; its output goes to `log_path`.
    `command` replaces `python -m vllm_rlt.entrypoints.cli` (e.g. a script that patches the
    engine first). Entering waits until /health answers 200; leaving kills it if still running."""

    def __init__(self, log_path: Path, flags: list[str], command: list[str] = CLI):
        self.port = free_port()
        self.log_path = log_path
        self.argv = [*command, "serve", "--port", str(self.port), *flags]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def __enter__(self) -> ServeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the server did not start:\n{self.log()}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def read_metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples, parsed by prometheus_client, keyed `name{label="v",...}`
    (labels sorted) without the `model_name` label, which every sample must carry."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None), f"{sample.name} has no model_name label"
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[sample.name + (f"{{{shown}}}" if shown else "")] = sample.value
    return out


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    """Wait until no request runs and every KV block is free."""
    kv = engine.kv_manager
    deadline = time.monotonic() + timeout
    while kv.num_free_blocks != kv.num_total_blocks or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running or holding KV blocks"
        time.sleep(0.02)
