"""`vllm-rlt inspect` runs end to end on a tiny checkpoint and on a built-in tiny model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import write_tiny_huginn
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.entrypoints.inspect_cmd import exit_distribution
from vllm_rlt.models.tiny import write_tiny_ouro


def test_inspect_prints_every_depth_and_checks(tmp_path, capsys):
    path = write_tiny_ouro(tmp_path / "m", seed=2)
    assert main(["inspect", str(path), "--prompt", "for i in range(10):", "--check"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("loop ")]
    assert [line.split(":")[0] for line in lines] == ["loop 1", "loop 2", "loop 3", "loop 4"]
    assert all(line.count(",") == 4 for line in lines)  # top-5 tokens per depth
    assert "cdf 1.000" in lines[-1]
    assert "-> OK" in out


def test_inspect_huginn_without_a_gate_and_checks(tmp_path, capsys):
    path = write_tiny_huginn(tmp_path / "h", seed=2)
    assert main(["inspect", str(path), "--prompt", "for i in range(10):", "--check"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("loop ")]
    assert [line.split(":")[0] for line in lines] == ["loop 1", "loop 2", "loop 3", "loop 4"]
    assert not any("exit gate" in line for line in lines)
    assert "huginn_raven" in out and "-> OK" in out


def test_inspect_reports_a_bad_device_in_one_line():
    with pytest.raises(SystemExit) as info:
        main(["inspect", "--device", "cuda:99"])
    assert str(info.value.code).startswith("error: device='cuda:99'")


def test_exit_distribution_matches_the_definition():
    g = torch.tensor([0.0, 1.0, -1.0, 5.0])
    lam = torch.sigmoid(g.double())
    p, cdf = exit_distribution(g)
    assert torch.allclose(p[0], lam[0])
    assert torch.allclose(p[1], lam[1] * (1 - lam[0]))
    assert torch.allclose(p[3], (1 - lam[0]) * (1 - lam[1]) * (1 - lam[2]))  # lambda_T unused
    assert torch.allclose(cdf[-1], torch.tensor(1.0, dtype=torch.float64))


def test_console_script_inspects_the_packaged_model_when_none_is_given():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "inspect", "--prompt", "hello"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tiny-ouro-stdlib (ouro, 4 loops" in result.stdout
    assert "loop 4:" in result.stdout
