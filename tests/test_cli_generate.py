"""`vllm-rlt generate`: flags come from the config fields and reach the engine."""

from __future__ import annotations

import pytest

from vllm_rlt.entrypoints.cli import main
from vllm_rlt.models.tiny import write_tiny_ouro


def test_generate_prints_completions_and_stats(tmp_path, capsys):
    path = write_tiny_ouro(tmp_path / "m", seed=1)
    argv = ["generate", str(path), "--prompt", "def f(x):", "--prompt", "import os",
            "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--exit-threshold", "0.5",
            "--scheduling-mode", "no_refill", "--prefill-chunk-size", "3", "--device", "cpu",
            "--num-kv-blocks", "128", "--block-size", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("finish: length") == 2
    assert "'generated_tokens': 10" in out


def test_generate_reports_bad_flags_by_name(tmp_path, capsys):
    path = write_tiny_ouro(tmp_path / "m", seed=1)
    with pytest.raises(SystemExit):
        main(["generate", str(path), "--prompt", "x", "--scheduling-mode", "eager"])
    assert "argument --scheduling-mode: invalid choice: 'eager'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="max_tokens"):
        main(["generate", str(path), "--prompt", "x", "--max-tokens", "0"])
