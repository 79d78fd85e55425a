"""The `vllm-rlt` command as a vLLM user meets it: --version, --help with every default and the
choices of enumerated settings, MODEL or --model, and one-line errors with a non-zero status."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import vllm_rlt
from vllm_rlt.entrypoints import cli_args
from vllm_rlt.entrypoints.cli import build_parser, main

COMMANDS = [("serve",), ("generate",), ("inspect",), ("bench", "serve"), ("bench", "throughput"),
            ("bench", "latency")]  # fmt: skip


def _subparser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _usage_error(argv: list[str], capsys) -> str:
    """The stderr of a usage error (status 2), checked to be one line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def _setting_error(argv: list[str]) -> str:
    """The message of a setting the command cannot run with (status 1), checked to be one line."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    return message


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"vllm-rlt {vllm_rlt.__version__}\n"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_shows_the_default_of_every_flag(path):
    parser = _subparser(path)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.required or not action.help:
            continue
        assert "default" in formatter._get_help_string(action), action.option_strings


def test_help_shows_config_defaults_and_choices():
    text = " ".join(_subparser(("serve",)).format_help().split())
    assert "--scheduling-mode {refill,no_refill,mixed}" in text
    assert "mixed: prefill rows fill the budget beside decode rows (default: mixed)" in text
    assert "--kv-layout {last_exited,shared}" in text and "--queue-policy {fcfs,priority}" in text
    assert "--exit-mode {ouro,ouro_delayed,trace}" in text
    assert "--dtype {auto,float32,bfloat16,float16}" in text
    assert "--max-num-seqs MAX_NUM_SEQS most requests running at once (and so per batch) " \
        "(default: 8)" in text  # fmt: skip
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in text
    assert "(default: True)" in text and "--port PORT port to listen on (0: any) (default: 8000)"
    inspect = " ".join(_subparser(("inspect",)).format_help().split())
    assert (
        "--attention-backend {auto,torch,triton,triton_invariant}" in inspect
        and "(default: 16)" in inspect
    )


def test_a_value_outside_the_choices_is_one_line(capsys):
    err = _usage_error(["serve", "--scheduling-mode", "eager"], capsys)
    assert err.startswith("vllm-rlt serve: error: argument --scheduling-mode: invalid choice")
    assert "'refill', 'no_refill', 'mixed'" in err
    err = _usage_error(["generate", "--prompt", "x", "--dtype", "fp8"], capsys)
    assert "argument --dtype: invalid choice: 'fp8'" in err


def test_an_abbreviated_flag_is_refused(capsys):
    err = _usage_error(["serve", "--max-num-seq", "8"], capsys)
    assert err.startswith("vllm-rlt: error: unrecognized arguments: --max-num-seq")
    err = _usage_error(["bench", "throughput", "--num-prompt", "4"], capsys)
    assert err.startswith("vllm-rlt: error: unrecognized arguments: --num-prompt")


def test_port_outside_the_range_is_one_line(capsys):
    err = _usage_error(["serve", "--port", "99999"], capsys)
    assert "argument --port: must be in 0..65535 (0: any free port), got 99999" in err
    assert "must be a port number" in _usage_error(["serve", "--port", "http"], capsys)


def test_model_as_positional_or_flag(capsys):
    parser = build_parser()
    for argv in (["serve", "m"], ["serve", "--model", "m"], ["serve", "m", "--model", "m"]):
        args = parser.parse_args(argv)
        cli_args.resolve_model(args, args.parser)
        assert args.model == "m" and "model_option" not in vars(args)
    args = parser.parse_args(["bench", "latency", "--model", "m"])
    cli_args.resolve_model(args, args.parser)
    assert args.model == "m"
    err = _usage_error(["generate", "a", "--model", "b", "--prompt", "x"], capsys)
    assert err.startswith("vllm-rlt generate: error: the model is given twice")
    assert "MODEL 'a' and --model 'b'" in err


def test_settings_the_engine_cannot_run_with_are_one_line(tmp_path):
    run = ["generate", "--prompt", "def f():", "--device", "cpu", "--num-kv-blocks", "64"]
    assert "max_loops must be in [1, 4]" in _setting_error([*run, "--max-loops", "7"])
    long = _setting_error([*run, "--max-model-len", "8", "--max-tokens", "8"])
    assert "exceeds max_model_len (8)" in long
    missing = str(tmp_path / "nope")
    assert f"model directory {missing} does not exist" in _setting_error([*run, "--model", missing])
    assert "does not exist" in _setting_error(["inspect", missing])
    assert "prompt '' encodes to no tokens" in _setting_error(["inspect", "--prompt", ""])
    empty = _setting_error(["bench", "latency", "--batch-size", "0", "--device", "cpu"])
    assert "batch_size must be > 0, got 0" in empty


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_console_reports_cuda_without_a_gpu_in_one_line_without_traceback():
    argv = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "--device", "cuda"]
    result = subprocess.run([*argv, "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "error: device='cuda' but no CUDA GPU is available; use device='cpu'\n"


def test_ctrl_c_ends_a_command_in_one_line(monkeypatch, capsys):
    from vllm_rlt.entrypoints import generate_cmd

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_cmd, "run", interrupted)
    assert main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "vllm-rlt: interrupted\n"


@pytest.mark.parametrize("argv", [["--version"], ["serve", "--help"], ["bench", "serve", "--help"]])
def test_version_and_help_load_no_torch(argv):
    """`--version` and every `--help` answer at once: torch (and Triton) stay unimported."""
    code = (
        "import sys; sys.modules['torch'] = sys.modules['triton'] = None\n"
        "from vllm_rlt.entrypoints.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as done:\n    sys.exit(done.code)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
