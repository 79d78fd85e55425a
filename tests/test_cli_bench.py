"""`vllm-rlt bench serve|throughput|latency` on the packaged tiny model: live progress, the
percentile table, the JSON result, and the serving benchmark over HTTP against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.entrypoints.server_utils import ServerThread, tiny_engine
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import default_model_dir

ENGINE = ["--device", "cpu", "--num-kv-blocks", "128", "--block-size", "4"]


def _table(out: str) -> dict[str, list[float]]:
    """The percentile table's rows: metric -> [mean, p50, p90, p99] in ms."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("(ms)"))
    assert lines[start].split()[1:] == ["mean", "p50", "p90", "p99"]
    rows = {}
    for line in lines[start + 1 :]:
        name, *values = line.split()
        if len(values) != 4:
            break
        rows[name] = [float(v) for v in values]
    return rows


def test_bench_serve_in_process_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--num-requests", "5", "--input-lens", "6", "--output-len", "4",
            "--concurrency", "2", "--warmup-requests", "1", "--out", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "requests: 100%" in printed.err and "5/5" in printed.err  # live progress
    table = _table(printed.out)
    assert list(table) == ["TTFT", "TPOT", "ITL", "E2E"]
    assert all(0 < p50 <= p99 for _, p50, _, p99 in table.values())
    assert "completed: 5" in printed.out
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 5 and result["summary"]["failed"] == 0
    assert result["engine"]["generated_tokens"] == 5 * 4  # the warm-up request is excluded
    assert result["summary"]["ttft_s"]["p50"] * 1e3 == pytest.approx(table["TTFT"][1], abs=0.01)


def test_bench_serve_over_http_against_a_server(capsys):
    app = build_app(tiny_engine(default_model_dir()), "tiny")
    with ServerThread(app) as server:
        argv = ["bench", "serve", "--backend", "http", "--base-url", server.url,
                "--served-model-name", "tiny", "--num-requests", "3", "--input-lens", "5",
                "--output-len", "3", "--profile", "serial"]  # fmt: skip
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "completed: 3" in out and "failed: 0" in out
    assert _table(out)["E2E"][0] > 0


def test_bench_throughput_and_latency(tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "3",
            "--out", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "4/4" in printed.err and list(_table(printed.out)) == ["TTFT", "TPOT", "ITL", "E2E"]
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4
    assert result["summary"]["output_token_throughput"] > 0
    assert result["engine"]["generated_tokens"] == 4 * 3

    argv = ["bench", "latency", "--batch-size", "2", "--input-len", "4", "--output-len", "2",
            "--num-iters-warmup", "1", "--num-iters", "3", "--out", str(out), *ENGINE]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "batches: 100%" in printed.err and "3/3" in printed.err
    (latency,) = _table(printed.out).values()
    result = json.loads(out.read_text())
    assert len(result["latencies_s"]) == 3 and result["summary"]["batch_size"] == 2
    assert latency[1] == pytest.approx(result["summary"]["latency_s"]["p50"] * 1e3, abs=0.01)


def test_bench_reports_bad_values_in_one_line():
    with pytest.raises(SystemExit) as info:
        main(["bench", "latency", "--num-iters", "0", *ENGINE])
    assert info.value.code == "error: num_iters must be > 0, got 0"
    with pytest.raises(SystemExit) as info:
        main(["bench", "throughput", "--num-prompts", "0", *ENGINE])
    assert info.value.code == "error: num_prompts must be > 0, got 0"
    with pytest.raises(SystemExit) as info:
        main(["bench", "serve", "--backend", "http", "--base-url", "http://127.0.0.1:1"])
    assert str(info.value.code).startswith("error: base_url http://127.0.0.1:1: no server answers")


def test_the_repository_entry_point_runs_bench_serve():
    argv = [sys.executable, "-m", "benchmarks.serving", "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: vllm-rlt bench serve")
