"""`vllm-rlt serve`: flags, the default model name, and a real start with no arguments (the
packaged model) / Ctrl-C shutdown."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from tests.entrypoints.server_utils import free_port
from vllm_rlt.entrypoints import serve_cmd


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_and_served_model_name():
    args = _parse(["/models/ouro-1.4b/", "--num-kv-blocks", "64", "--max-waiting-requests", "3"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.num_kv_blocks == 64 and args.max_waiting_requests == 3
    assert serve_cmd.served_name(args) == "ouro-1.4b"
    assert serve_cmd.served_name(_parse([])) == "tiny-ouro-stdlib"
    assert serve_cmd.served_name(_parse(["m", "--served-model-name", "x"])) == "x"


def test_serve_without_arguments_serves_the_packaged_model_and_stops_on_ctrl_c():
    port = free_port()
    cli = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve"]
    flags = ["--port", str(port), "--device", "cpu", "--num-kv-blocks", "64", "--api-key", "k"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.PIPE
    proc = subprocess.Popen(cli + flags, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        name = "tiny-ouro-stdlib"
        assert f"serving '{name}' on http://127.0.0.1:{port}/v1" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k")
        assert [m.id for m in client.models.list().data] == [name]
        done = client.completions.create(
            model=name, prompt="import os\n", max_tokens=16, temperature=0
        )
        assert done.choices[0].text.strip() and done.choices[0].finish_reason in ("length", "stop")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        log = proc.stdout.read()
        assert "Traceback" not in log and "server stopped" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
