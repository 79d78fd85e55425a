"""`vllm-rlt serve --data-parallel-size 2`: two replica processes behind one front end, driven
with the `openai` client over real HTTP. 40 concurrent streaming requests get a single engine's
outputs and /metrics sums both replicas; with replica 1 killed mid-run, its requests end with
an error, the others complete correctly, /health names it (503) and replica 0 goes on serving;
with replica 0 killed too, the server stops (exit status 1). Replicas with disaggregation is a
one-line error."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import httpx
import pytest

from tests.entrypoints.server_utils import CLI, ServeProcess, read_metrics
from tests.entrypoints.test_pd_server import (
    TIMEOUT_S,
    check_partial,
    engine_pids,
    flags,
    jobs,
    run_all,
    single_engine_texts,
    wait_free,
)
from vllm_rlt.models.tiny import write_tiny_ouro


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("dp") / "tiny", seed=9)


def test_two_replicas_stream_then_one_dies_then_both(model_dir, tmp_path):
    work = jobs(0, 40, 8)
    long_work = jobs(1, 40, 24)
    want = single_engine_texts(model_dir, work)
    want_long = single_engine_texts(model_dir, long_work)

    def run(items, on_started=None):
        return asyncio.run(asyncio.wait_for(run_all(srv.url, items, on_started), TIMEOUT_S))

    with ServeProcess(tmp_path / "serve.log", flags(model_dir, "--data-parallel-size", "2")) as srv:
        assert run(work) == want
        wait_free(srv.url)
        m = read_metrics(srv.url)  # the replicas' gauges, summed
        assert m["vllm:num_requests_waiting"] == 0
        assert "vllm_rlt:pd_transfers_total" not in m  # no KV moves between replicas

        pids = engine_pids(srv.log(), "replicas")
        assert len(pids) == 2
        check_partial(run(long_work, lambda: os.kill(pids[1], signal.SIGKILL)), want_long)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        message = health.json()["error"]["message"]
        assert message == f"degraded: replica 1 (pid {pids[1]}) died; 1 of 2 engines serve"
        wait_free(srv.url)  # replica 0 holds no blocks of the failed requests
        assert run(work[:10]) == want[:10]  # replica 0 goes on serving

        os.kill(pids[0], signal.SIGKILL)  # no replica left: the server stops
        assert srv.proc.wait(timeout=TIMEOUT_S) == 1
        assert "vllm-rlt: server stopped: the engine failed" in srv.log()


def test_replicas_with_disaggregation_is_a_one_line_error():
    argv = [*CLI, "serve", "--port", "0", "--data-parallel-size", "2", "--pd-prefill", "1"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: data_parallel_size must be 1 when pd_prefill or pd_decode is set (replicas or "
        "disaggregation, not both), got 2"
    ]
