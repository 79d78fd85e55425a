"""`vllm-rlt serve`'s log lines (start line, periodic stats, per-request lines, and the flags
that turn them off) and `--chat-template` (a file, or the template itself), read from the
output of a real server process."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.entrypoints.server_utils import ServeProcess
from vllm_rlt.models.tiny import write_tiny_ouro

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("logs") / "tiny", seed=7)


def _flags(model_dir, *more: str) -> list[str]:
    return [str(model_dir), "--device", "cpu", "--num-kv-blocks", "64", *more]


def _rendered(server: ServeProcess) -> str:
    """The chat prompt the server builds for MESSAGES."""
    ids = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def _wait_for(server: ServeProcess, pattern: str, timeout: float = 20.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while not (found := re.search(pattern, server.log())):
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{server.log()}"
        time.sleep(0.1)
    return found


def test_start_stats_and_request_lines_with_a_template_file(model_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    flags = _flags(model_dir, "--chat-template", str(template), "--log-stats-interval", "0.5")
    with ServeProcess(tmp_path / "log", flags) as server:
        start = (
            r"serving 'tiny' \(\S+tiny\) dtype=float32 device=cpu depth=4; KV cache: 64 blocks of "
            r"16 positions over 4 planes, max_model_len (\d+); maximum concurrency for \1 tokens "
            r"per request: (\d+\.\d\d)x"
        )
        found = _wait_for(server, start)
        assert float(found[2]) == pytest.approx(64 // 4 * 16 / int(found[1]), abs=0.01)
        _wait_for(server, r"engine: mixed scheduling, WCPB off, chunk \d+, budget \d+ tokens, "
                          r"\d+ sequences; CUDA graphs off; exits ouro at threshold ")  # fmt: skip
        assert _rendered(server) == "[user] hi\n[assistant] "
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="tiny", prompt="import os", max_tokens=5, n=2, extra_body={"ignore_eos": True}
        )
        received = (
            rf"Received request {out.id}: 1 prompt\(s\) of \[\d+\] tokens, "
            r"prompt_token_ids: \[[\d, ]+\], params: SamplingParams\(n=2"
        )
        _wait_for(server, received)
        _wait_for(server, rf"Finished request {out.id}: finish_reason length,length, 10 generated")
        stats = (
            r"Avg prompt throughput: (\d+\.\d) tokens/s, Avg generation throughput: (\d+\.\d) "
            r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, "
            r"Prefix cache hit rate: \d+\.\d%, Loops per token: (\d\.\d\d)"
        )
        found = _wait_for(server, stats)
        deadline = time.monotonic() + 10
        while not any(float(m[2]) > 0 for m in re.finditer(stats, server.log())):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        busy = [m for m in re.finditer(stats, server.log()) if float(m[2]) > 0]
        assert 1.0 <= float(busy[0][3]) <= 4.0


def test_disabled_logs_and_an_inline_template(model_dir, tmp_path):
    flags = _flags(model_dir, "--chat-template", TEMPLATE, "--log-stats-interval", "0.2",
                   "--disable-log-stats", "--disable-log-requests")  # fmt: skip
    with ServeProcess(tmp_path / "log", flags) as server:
        assert _rendered(server) == "[user] hi\n[assistant] "
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
        assert chat.usage.prompt_tokens == len(
            httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        )
        time.sleep(1.0)  # five stats intervals
        log = server.log()
        assert "maximum concurrency" in log
        assert "Avg prompt throughput" not in log and "Received request" not in log
        assert "Finished request" not in log
