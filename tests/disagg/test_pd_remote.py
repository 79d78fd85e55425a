"""Engines on other hosts, tested on one: the decode engine runs as `vllm-rlt pd-engine`, a
process the front end did not start, connected over the control port with the shared secret.
Its requests give a single engine's tokens and exit depths; when it is killed the front end
sees its connection close, reports it by name and host, and fails what it served. A wrong
secret, a missing one and engines that never connect end the start with a clear error."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from tests.disagg.test_pd_equivalence import MODES, TIMEOUT_S, multi_chunk_workload, run_pd
from tests.engine.harness import compare, make_engine, run_batched
from vllm_rlt.config import ConfigError, EngineConfig
from vllm_rlt.disagg import engines
from vllm_rlt.disagg.engines import free_port
from vllm_rlt.disagg.router import PDRouter
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.serve_config import AUTHKEY_ENV, DisaggConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=21)


def start_remote(port: int, rank: int, secret: str, stderr=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "pd-engine",
           "--pd-connect", f"127.0.0.1:{port}", "--pd-rank", str(rank)]  # fmt: skip
    env = os.environ | {AUTHKEY_ENV: secret, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stderr=stderr, text=True)


def test_a_remote_decode_engine_serves_and_its_death_is_seen(model_dir, monkeypatch):
    monkeypatch.setenv(AUTHKEY_ENV, "s3cret")
    jobs, settings = multi_chunk_workload(0)
    settings |= MODES["wcpb"]
    single = make_engine(model_dir, "cpu", "torch", **settings)
    want = run_batched(single, jobs)
    config = EngineConfig.from_kwargs(
        model=str(model_dir), device="cpu", attention_backend="torch", dtype="float32",
        num_kv_blocks=4096, block_size=4, **settings,
    )  # fmt: skip
    port = free_port("127.0.0.1")
    disagg = DisaggConfig(pd_prefill=1, pd_decode=1, pd_remote_decode=1, pd_control_port=port)
    remote = start_remote(port, rank=1, secret="s3cret")
    try:
        router = PDRouter(config, disagg)
        decode = router.engines[1]
        assert decode.process is None and decode.pid == remote.pid
        assert decode.host == socket.gethostname()

        async def scenario():
            try:
                got = await asyncio.wait_for(run_pd(router, jobs), TIMEOUT_S)
                statuses = await router.probe()
                remote.kill()
                for _ in range(500):  # its connection closes: the front end sees it die
                    if not router.is_healthy:
                        break
                    await asyncio.sleep(0.01)
                return got, statuses
            finally:
                await router.shutdown()

        got, statuses = asyncio.run(scenario())
        assert compare(single, jobs, got, want, "last_exited") == 0
        assert all(s.num_free_blocks == s.num_total_blocks for s in statuses)
        assert not router.is_healthy
        assert f"decode engine 0 (pid {remote.pid} on {socket.gethostname()}) died" in (
            router.health_message
        )
    finally:
        remote.kill()
        remote.wait()


def test_a_remote_engine_with_the_wrong_secret_is_not_admitted(model_dir, monkeypatch):
    monkeypatch.setenv(AUTHKEY_ENV, "right")
    # the default deadline: only a refused handshake ends the start early, with its own message
    config = EngineConfig.from_kwargs(model=str(model_dir), device="cpu", dtype="float32")
    port = free_port("127.0.0.1")
    disagg = DisaggConfig(pd_prefill=1, pd_decode=1, pd_remote_decode=1, pd_control_port=port)
    remote = start_remote(port, rank=1, secret="wrong", stderr=subprocess.PIPE)
    try:
        with pytest.raises(ConfigError, match=r"remote engines \[1\] did not connect: .* refused"):
            PDRouter(config, disagg)
        assert remote.wait(timeout=30) == 1  # the handshake failed on its side too: one line
        assert remote.stderr.read() == (
            f"error: the front end at 127.0.0.1:{port} refused {AUTHKEY_ENV}\n"
        )
    finally:
        remote.kill()
        remote.wait()


def test_remote_settings_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="pd_control_port must be >= 1"):
        DisaggConfig(pd_prefill=1, pd_decode=1, pd_remote_decode=1)
    with pytest.raises(ConfigError, match="pd_remote_prefill must be in 0..pd_prefill - 1"):
        DisaggConfig(pd_prefill=1, pd_decode=1, pd_remote_prefill=1, pd_control_port=9)
    with pytest.raises(ConfigError, match="pd_remote_decode must be in 0..pd_decode"):
        DisaggConfig(pd_prefill=1, pd_decode=1, pd_remote_decode=2, pd_control_port=9)
    d = DisaggConfig(pd_prefill=3, pd_decode=2, pd_remote_prefill=1, pd_remote_decode=1,
                     pd_control_port=9)  # fmt: skip
    assert [d.is_remote(r) for r in range(5)] == [False, False, True, False, True]
    monkeypatch.delenv(AUTHKEY_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {AUTHKEY_ENV} on every host"):
        engines.authkey()
