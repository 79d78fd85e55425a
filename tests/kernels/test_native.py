"""The native kernels' switch, build cache and fallback (`vllm_rlt.kernels.native`). On the CPU
nothing is compiled: a stand-in nvcc (a shell script) shows what the build runs and caches."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import torch

from vllm_rlt.attention.metadata import build_attention_metadata
from vllm_rlt.kernels import native
from vllm_rlt.kernels.kv_format import KVLayer


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch):
    """An nvcc that counts its compiles in `calls` and writes its -o file (or fails when the
    file `fail` exists); built libraries go under tmp_path/cache."""
    script = tmp_path / "bin" / "nvcc"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "fake nvcc 1.0"; exit 0; fi\n'
        f'echo x >> "{tmp_path}/calls"\n'
        f'if [ -e "{tmp_path}/fail" ]; then echo "error: bad kernel" >&2; exit 1; fi\n'
        'while [ "$#" -gt 0 ]; do if [ "$1" = -o ]; then echo lib > "$2"; fi; shift; done\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("VLLM_RLT_CACHE_DIR", str(tmp_path / "cache"))
    return script


def _compiles(tmp_path) -> int:
    calls = tmp_path / "calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_off_on_the_cpu_and_by_default_and_nothing_is_built(monkeypatch):
    def no_build(*args):
        raise AssertionError("nothing may be built here")

    monkeypatch.setattr(native, "build", no_build)
    monkeypatch.setattr(native, "_load", no_build)
    for mode in ("0", "1"):
        monkeypatch.setattr(native, "MODE", mode)
        assert native.report(torch.device("cpu")) == "native kernels off (no CUDA device)"
    monkeypatch.setattr(native, "MODE", "0")
    assert native.native(torch.device("cuda")).reason == "VLLM_RLT_NATIVE=1 builds them"


def test_launches_only_what_it_has_an_instance_for(monkeypatch):
    """With a library at hand, `decode_attention` launches it for a shape it has an instance
    for and declines (leaving the launch to Triton) other head sizes, GQA groups and dtypes."""
    launched = []

    class Library:
        @staticmethod
        def vrlt_decode_attention(*args):
            launched.append(args)
            return 0

    monkeypatch.setattr(native, "native", lambda device: native.Native(Library, "sm_90"))

    def case(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        q = torch.zeros(2, heads, head_dim, dtype=dtype)
        k = torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype)
        meta = build_attention_metadata([5, 9], [1, 1], [[0], [1]], 16, "cpu")
        return q, KVLayer(k, k.clone()), meta, torch.empty_like(q)

    for heads, kv_heads, head_dim, dtype, takes in [
        (16, 16, 128, torch.bfloat16, True),
        (8, 8, 48, torch.bfloat16, False),  # head size 48
        (16, 2, 128, torch.bfloat16, False),  # a GQA group of 8
        (16, 16, 128, torch.float32, False),  # fp32
    ]:
        got = native.decode_attention(*case(heads, kv_heads, head_dim, dtype), num_sms=132)
        assert got is takes
    assert len(launched) == 1


def test_old_gpus_and_missing_toolkits_build_nothing(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp

    native._load.cache_clear()
    monkeypatch.setattr(cpp, "CUDA_HOME", str(tmp_path))
    try:
        assert native._load((8, 0)).reason == "compute capability 8.0, they need 9.0"
        found = native._load((9, 0))
        assert found.library is None and found.reason.startswith("no CUDA toolkit")
    finally:
        native._load.cache_clear()


def test_the_build_is_cached_by_sources_arch_and_compiler(tmp_path, fake_nvcc):
    first = native.build(fake_nvcc, "90")
    assert first.read_text() == "lib\n" and first.name == native.LIBRARY
    assert native.build(fake_nvcc, "90") == first and _compiles(tmp_path) == 1
    other = native.build(fake_nvcc, "100")
    assert other != first and _compiles(tmp_path) == 2
    assert not list(first.parent.glob(f"{native.LIBRARY}.*"))  # no partial file left


def test_a_failed_build_says_where_its_log_is(tmp_path, fake_nvcc):
    (tmp_path / "fail").touch()
    with pytest.raises(RuntimeError, match="their build failed, log: .*build.log") as err:
        native.build(fake_nvcc, "90")
    log = err.value.args[0].split("log: ")[1]
    assert "error: bad kernel" in Path(log).read_text()


@pytest.mark.parametrize(
    "programs, max_context, pieces",
    [
        (16, 512, 8),  # one row of 16 KV heads: ceil(2 x 132 / 16) = 17, capped at 8
        (128, 512, 4),  # 8 rows: ceil(264 / 128) = 3, rounded up to a power of two
        (256, 512, 2),  # 16 rows
        (512, 512, 1),  # 32 rows fill the GPU without pieces
        (16, 100, 1),  # pieces of at least 64 positions
        (16, 200, 2),  # the largest power of two up to 200 // 64 = 3
    ],
)
def test_decode_pieces_fill_the_gpu_within_a_cluster(programs, max_context, pieces):
    assert native.decode_pieces(programs, max_context, num_sms=132) == pieces


def test_a_refused_launch_turns_the_native_kernels_off(monkeypatch, caplog):
    """A launch the library refuses (a cudaError_t, nothing ran) leaves the launch to Triton,
    and every later one: the log and the start line say why."""
    real_native = native.native
    monkeypatch.setattr(native, "MODE", "1")
    monkeypatch.setattr(native, "_stopped", None)

    class Refusing:
        @staticmethod
        def vrlt_decode_attention(*args):
            return 1  # cudaErrorInvalidValue

        @staticmethod
        def vrlt_error_string(err):
            return b"invalid argument"

    monkeypatch.setattr(native, "native", lambda device: native.Native(Refusing, "sm_90"))
    q = torch.zeros(2, 16, 128, dtype=torch.bfloat16)
    k = torch.zeros(4, 16, 16, 128, dtype=torch.bfloat16)
    meta = build_attention_metadata([5, 9], [1, 1], [[0], [1]], 16, "cpu")
    with caplog.at_level("WARNING", logger=native.__name__):
        assert not native.decode_attention(q, KVLayer(k, k.clone()), meta, torch.empty_like(q), 132)
    reason = "decode attention's launch failed: invalid argument"
    assert reason in caplog.text
    assert real_native(torch.device("cuda")).reason == reason
