"""Startup validation: every setting or model file the engine cannot start with fails at
`LLM(...)` with one ConfigError naming the setting or the file (and the numbers), before any KV
memory is allocated; `vllm-rlt generate` / `serve` print it as one line, without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_rlt.config import ConfigError
from vllm_rlt.engine.kv_sizing import GIB, free_memory_bytes
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.entrypoints.openai.chat_template import ChatRenderer
from vllm_rlt.kernels import device_info
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams

# the packaged model: 1 layer, 8 KV heads of 48, fp32 on the CPU -> 49152 bytes per 16-position
# block; max_position_embeddings 2048; 4 loops, so 4 KV planes (last_exited)
SMALL = {"device": "cpu", "num_kv_blocks": 64}  # 64 // 4 planes * 16 = 256 positions a request


@pytest.fixture
def model(tmp_path):
    """A copy of the packaged model directory that a test may break."""
    return shutil.copytree(default_model_dir(), tmp_path / "model")


def _fails(model, needle: str, **engine_args) -> str:
    with pytest.raises(ConfigError, match=needle) as info:
        LLM(str(model), **{**SMALL, **engine_args})
    return str(info.value)


# ---- KV memory and size ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting", [{"num_kv_blocks": 10**9}, {"num_kv_blocks": None, "kv_cache_memory_gb": 1e6}]
)
def test_a_kv_cache_larger_than_free_memory_fails_before_allocating(model, setting):
    name = [k for k, v in setting.items() if v is not None][0]
    message = _fails(model, f"{name}=", **setting)
    assert "GiB of cpu memory is free" in message and f"lower {name}" in message


def test_free_host_memory_is_measured():
    free = free_memory_bytes(torch.device("cpu"))
    assert free > 0 and free / GIB < 1e5  # less than 100 TiB: a measurement, not a constant


def test_fewer_kv_blocks_than_one_request_needs(model):
    message = _fails(model, "num_kv_blocks=3", num_kv_blocks=3)
    assert "kv_layout='last_exited'" in message and "4 planes" in message
    LLM(str(model), **{**SMALL, "num_kv_blocks": 1, "kv_layout": "shared"})  # one plane: enough


def test_an_explicit_max_model_len_the_kv_cache_cannot_hold_names_both_numbers(model):
    message = _fails(model, "max_model_len=1000", max_model_len=1000)
    assert "999 KV positions" in message and "holds at most 256 per request" in message
    assert "num_kv_blocks=64" in message
    needle = "max_model_len=4096 exceeds the model's max_position_embeddings=2048"
    _fails(model, needle, num_kv_blocks=10_000, max_model_len=4096)


def test_max_model_len_defaults_to_what_the_kv_cache_holds_and_bounds_requests(model):
    llm = LLM(str(model), **SMALL)
    assert llm.engine.max_model_len == 257  # 256 KV positions; the last token is never fed
    with pytest.raises(ValueError, match=r"= 258 exceeds max_model_len \(257\)"):
        llm.generate([list(range(1, 9))], SamplingParams(max_tokens=250), use_tqdm=False)
    explicit = LLM(str(model), **SMALL, max_model_len=40)
    assert explicit.engine.max_model_len == 40
    with pytest.raises(ValueError, match=r"= 41 exceeds max_model_len \(40\)"):
        explicit.generate([[5]], SamplingParams(max_tokens=40), use_tqdm=False)
    fits = SamplingParams(max_tokens=39, ignore_eos=True)
    (out,) = explicit.generate([[5]], fits, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 39
    big = LLM(model, device="cpu", num_kv_blocks=10_000)  # a Path names a model too
    assert big.engine.max_model_len == 2048  # the model's max_position_embeddings


# ---- model files -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(p.read_bytes()[:1000]),  # cut inside the header
        lambda p: p.write_bytes(p.read_bytes()[:-100]),  # header whole, the last tensor cut
        lambda p: p.write_bytes(b"PK\x03\x04 a zip archive, not a checkpoint" * 10),
    ],
    ids=["empty", "truncated-header", "truncated-data", "foreign"],
)
def test_a_bad_model_safetensors_is_named(model, damage):
    damage(model / "model.safetensors")
    message = _fails(model, "model.safetensors is not a valid safetensors file")
    assert str(model / "model.safetensors") in message


def test_invalid_config_json_names_the_file_line_and_column(model):
    (model / "config.json").write_text('{\n  "model_type": "ouro",\n  "vocab_size": ,\n}')
    message = _fails(model, "config.json is not valid JSON")
    assert "line 3, column 17" in message
    (model / "config.json").write_text("[1, 2]")
    _fails(model, "config.json must hold a JSON object, got list")


def test_a_wrong_type_in_config_json_is_named(model):
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "num_attention_heads": "8"}))
    message = _fails(model, "num_attention_heads must be int, got '8'")
    assert str(model / "config.json") in message


def test_an_invalid_tokenizer_json_is_named(model):
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    _fails(model, "tokenizer.json is not a valid tokenizer")


def test_an_invalid_tokenizer_config_json_is_named(model):
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ x }}",}')
    with pytest.raises(ConfigError, match="tokenizer_config.json is not valid JSON"):
        ChatRenderer(model)
    (model / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')
    with pytest.raises(ConfigError, match="tokenizer_config.json: chat_template is not a valid"):
        ChatRenderer(model)


# ---- engine settings -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,needle",
    [
        ({"max_num_seqs": "4"}, r"max_num_seqs must be int, got '4' \(str\)"),
        ({"enforce_eager": "no"}, "enforce_eager must be bool"),
        ({"block_size": 16.0}, "block_size must be int"),
        ({"exit_threshold": "0.5"}, "exit_threshold must be float or null"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
    ],
)
def test_wrong_types_in_engine_settings_are_named(args, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(model):
    _fails(model, "device='cuda' but no CUDA GPU is available", device="cuda")


def test_unknown_devices(model):
    _fails(model, "device 'tpu0' is not a device name", device="tpu0")
    _fails(model, "device 'meta' is not supported", device="meta")


@pytest.mark.parametrize(
    "setting", [{"attention_backend": "triton"}, {"layer_kernels": "fused"}], ids=str
)
def test_triton_on_the_cpu_needs_the_interpreter(model, monkeypatch, setting):
    monkeypatch.setattr(device_info, "INTERPRET", False)
    ((name, value),) = setting.items()
    message = _fails(model, f"{name}='{value}' runs Triton kernels", **setting)
    assert "TRITON_INTERPRET=1" in message


# ---- the CLI: one line on stderr, no traceback ------------------------------------------------
def _cli(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def _one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_generate_cli_reports_a_broken_config_json_in_one_line(model):
    (model / "config.json").write_text('{"model_type": "ouro",')
    proc = _cli("generate", str(model), "--prompt", "x", "--device", "cpu", "--num-kv-blocks", "64")
    _one_line_error(proc, "config.json is not valid JSON")


def test_serve_cli_reports_a_broken_tokenizer_config_in_one_line(model):
    (model / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}')
    proc = _cli("serve", str(model), "--device", "cpu", "--num-kv-blocks", "64", "--port", "1")
    _one_line_error(proc, "tokenizer_config.json: chat_template is not a valid Jinja template")


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--max-model-len", "5000"], "max_model_len=5000 exceeds the model's"),
        (["--num-kv-blocks", "2"], "num_kv_blocks=2 gives 2 KV blocks"),
        (["--max-tokens", "300"], "exceeds max_model_len (257)"),
        (["--device", "cuda:7"], "device='cuda:7'"),
    ],
)
def test_generate_cli_turns_startup_errors_into_one_line(model, flags, needle):
    argv = ["generate", str(model), "--prompt", "x", "--device", "cpu", "--num-kv-blocks", "64"]
    with pytest.raises(SystemExit) as info:
        main(argv + flags)
    message = str(info.value.code)
    assert message.startswith("error: ") and needle in message and "\n" not in message
