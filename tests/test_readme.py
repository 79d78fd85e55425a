"""Every `python` and `bash` block of README.md runs as written and prints something sane.

A block right after `<!-- readme-test: skip (why) -->` is not run. The block after
`<!-- readme-test: server -->` is started as the server, on a free port in place of 8000, and the
blocks that address 127.0.0.1:8000 run against it. Every other block runs in a temporary
directory with this interpreter's scripts (`vllm-rlt`) on the PATH.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.server_utils import free_port

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(
    r"(?:<!-- readme-test: (?P<marker>\w+)[^>]*-->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```",
    re.S,
)
SERVER_ADDRESS = "127.0.0.1:8000"
# what a block whose code holds the key must print
EXPECTED = {
    "vllm-rlt --version": "vllm-rlt ",
    "vllm-rlt inspect": "-> OK",
    "vllm-rlt generate": "finish: ",
    "vllm-rlt bench": "(ms)",
    "llm.generate": "[4, ",  # exit depths: the first token runs every loop
}


@dataclass(frozen=True)
class Block:
    line: int  # where the block starts in README.md
    lang: str  # python or bash
    code: str
    marker: str | None  # skip, server or None

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def _blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(text.count("\n", 0, m.start("code")), m["lang"], m["code"], m["marker"])
        for m in BLOCK.finditer(text)
    ]


BLOCKS = _blocks()
OFFLINE = [b for b in BLOCKS if b.marker is None and SERVER_ADDRESS not in b.code]
CLIENTS = [b for b in BLOCKS if b.marker is None and SERVER_ADDRESS in b.code]


def _env() -> dict[str, str]:
    scripts = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": scripts + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1"}


def _argv(block: Block) -> list[str]:
    if block.lang == "python":
        return [sys.executable, "-c", block.code]
    return ["bash", "-euo", "pipefail", "-c", block.code]


def _run(block: Block, cwd: Path) -> str:
    """Runs the block; its stdout, checked to be sane."""
    result = subprocess.run(
        _argv(block), cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip(), f"{block.id} printed nothing"
    assert "Traceback" not in result.stderr, result.stderr
    for key, expected in EXPECTED.items():
        if key in block.code:
            assert expected in result.stdout, f"{block.id}: no {expected!r} in\n{result.stdout}"
    return result.stdout


def test_the_blocks_are_found_and_marked():
    assert {b.marker for b in BLOCKS} == {None, "skip", "server"}
    assert len([b for b in BLOCKS if b.marker == "server"]) == 1
    assert OFFLINE and CLIENTS
    assert all(b.lang in ("python", "bash") for b in BLOCKS)


@pytest.mark.parametrize("block", OFFLINE, ids=lambda b: b.id)
def test_block_runs(block, tmp_path):
    _run(block, tmp_path)


def _on_port(code: str, port: int) -> str:
    return code.replace(SERVER_ADDRESS, f"127.0.0.1:{port}").replace(
        "--port 8000", f"--port {port}"
    )


def test_server_block_serves_the_client_blocks(tmp_path):
    (server,) = [b for b in BLOCKS if b.marker == "server"]
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        command = ["bash", "-c", "exec " + _on_port(server.code, port).strip()]
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        for block in CLIENTS:
            block = Block(block.line, block.lang, _on_port(block.code, port), None)
            out = _run(block, tmp_path)
            if block.code.startswith("curl"):
                choice = json.loads(out)["choices"][0]
                assert choice["text"] and choice["finish_reason"] in ("length", "stop")
                assert 1 <= len(choice["exit_depths"]) <= 24
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
