"""`vllm-rlt serve`: flags, the default model name, binding the port before anything else, and
a real start with no arguments (the packaged model) / Ctrl-C shutdown."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess

import openai
import pytest

from tests.entrypoints.server_utils import CLI, ServeProcess
from vllm_rlt.entrypoints import serve_cmd


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_and_served_model_name():
    args = _parse(["/models/ouro-1.4b/", "--num-kv-blocks", "64", "--max-waiting-requests", "3"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert args.num_kv_blocks == 64 and args.max_waiting_requests == 3
    assert (args.shutdown_timeout, args.timeout_keep_alive, args.body_read_timeout) == (30, 5, 30)
    assert serve_cmd.served_name(args) == "ouro-1.4b"
    assert serve_cmd.served_name(_parse([])) == "tiny-ouro-stdlib"
    assert serve_cmd.served_name(_parse(["m", "--served-model-name", "x"])) == "x"
    assert (args.chat_template, args.disable_log_stats, args.disable_log_requests) == (
        None,
        False,
        False,
    )
    assert args.log_stats_interval == 10
    logs = _parse(["--chat-template", "t.jinja", "--disable-log-stats", "--disable-log-requests",
                   "--log-stats-interval", "2.5"])  # fmt: skip
    assert (logs.chat_template, logs.disable_log_stats, logs.disable_log_requests) == (
        "t.jinja",
        True,
        True,
    )
    assert logs.log_stats_interval == 2.5


def test_bind_listens_on_the_port_or_exits_in_one_line():
    with serve_cmd.bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens already, before the server starts
        with pytest.raises(SystemExit, match=f"^error: port {port} on 127.0.0.1: cannot listen: "):
            serve_cmd.bind("127.0.0.1", port)
    with pytest.raises(SystemExit, match="^error: host 'no-such-host.invalid' cannot be resolved"):
        serve_cmd.bind("no-such-host.invalid", 8000)


def test_a_port_in_use_ends_serve_before_it_claims_to_serve():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [*CLI, "serve", "--port", str(port), "--device", "cpu"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (1, "")
    assert (
        result.stderr == f"error: port {port} on 127.0.0.1: cannot listen: Address already in use\n"
    )


def test_serve_without_arguments_serves_the_packaged_model_and_stops_on_ctrl_c(tmp_path):
    flags = ["--device", "cpu", "--num-kv-blocks", "64", "--api-key", "k"]
    with ServeProcess(tmp_path / "log", flags) as server:
        name = "tiny-ouro-stdlib"
        assert f"serving '{name}' on {server.url}/v1" in server.log().splitlines()[0]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k")
        assert [m.id for m in client.models.list().data] == [name]
        done = client.completions.create(
            model=name, prompt="import os\n", max_tokens=16, temperature=0
        )
        assert done.choices[0].text.strip() and done.choices[0].finish_reason in ("length", "stop")
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=30) == 0
        log = server.log()
        assert "Traceback" not in log and "server stopped" in log
