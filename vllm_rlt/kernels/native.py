"""Native CUDA kernels (`vllm_rlt/csrc/`), where Triton cannot express what a kernel needs.

Today one kernel: paged decode attention whose KV splits merge in a thread-block cluster through
distributed shared memory (`csrc/decode_attention.cu`), in one launch where the Triton path
takes an attention launch and a combine launch (`paged_attention.py`). It needs Hopper or later.

`VLLM_RLT_NATIVE=1` in the environment turns the native kernels on (default `0`: Triton only). On a
CUDA device of compute capability 9.0 or later with a CUDA toolkit (`nvcc` under the `CUDA_HOME`
that `torch.utils.cpp_extension` finds), the first use compiles the sources for the device's
architecture into a shared library cached under `$VLLM_RLT_CACHE_DIR` (default
`~/.cache/vllm_rlt`), keyed by the sources, the architecture and the compiler, and loads it through
ctypes (its entry points take raw pointers and the stream: no torch headers, a build of about 20 s
of one core). Anywhere else, or if the build fails, nothing is compiled and the Triton kernels run;
`report` says which runs and why (the engine's start log line carries it). The C entry points
return a `cudaError_t`; a launch they refuse turns them off for the process (logged, and `report`
says why): the Triton kernels run instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_rlt.kernels.kv_format import FP8, KVLayer
from vllm_rlt.kernels.pdl import pdl

if TYPE_CHECKING:
    from vllm_rlt.attention.metadata import AttentionMetadata

SOURCES = Path(__file__).resolve().parent.parent / "csrc"
LIBRARY = "libvllm_rlt_native.so"
MODE = os.environ.get("VLLM_RLT_NATIVE", "0")  # "1": build and use the native kernels
MIN_CAPABILITY = (9, 0)  # thread-block clusters, early launch
# decode attention: shapes with a compiled instance, and pieces per (row, KV head)
HEAD_DIMS, GROUPS, MAX_PIECES = (64, 96, 128), (1, 2, 4), 8
PIECES_PER_SM = 2  # split the rows' contexts until the grid holds about this many blocks per SM
MIN_PIECE = 64  # positions of the shortest piece a launch plans for
MAX_TILES = 65535  # rows of one launch (the grid's z dimension)
_LOG2E = 1.4426950408889634
logger = logging.getLogger(__name__)
# why the native kernels stopped in this process (a launch failed), if they did
_stopped: str | None = None
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}


@dataclass(frozen=True)
class Native:
    """The native library of a device, or why there is none."""

    library: ctypes.CDLL | None
    reason: str


def report(device: torch.device) -> str:
    """Whether native kernels run on `device` and which, or why not (the start log line)."""
    found = native(device)
    if found.library is None:
        return f"native kernels off ({found.reason})"
    return f"native kernels: {found.reason}"


def native(device: torch.device) -> Native:
    """The device's native library (built and loaded at the first call), or why not."""
    if device.type != "cuda":
        return Native(None, "no CUDA device")
    if MODE != "1":
        return Native(None, "VLLM_RLT_NATIVE=1 builds them")
    if _stopped is not None:
        return Native(None, _stopped)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _load(torch.cuda.get_device_capability(index))


@functools.cache
def _load(capability: tuple[int, int]) -> Native:
    if capability < MIN_CAPABILITY:
        need, have = (".".join(map(str, c)) for c in (MIN_CAPABILITY, capability))
        return Native(None, f"compute capability {have}, they need {need}")
    nvcc = nvcc_path()
    if not nvcc.exists():
        return Native(None, f"no CUDA toolkit to build them: no nvcc at {nvcc}")
    arch = f"{capability[0]}{capability[1]}"
    try:
        path = build(nvcc, arch)
    except RuntimeError as err:
        return Native(None, str(err))
    return Native(declare(ctypes.CDLL(str(path))), f"decode attention, sm_{arch}")


def nvcc_path() -> Path:
    """nvcc under the CUDA_HOME that torch.utils.cpp_extension finds (it may not exist)."""
    from torch.utils.cpp_extension import CUDA_HOME  # imports setuptools: only when needed

    return Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """The C entry points' signatures (csrc/decode_attention.cu)."""
    pointers, longs, ints = [ctypes.c_void_p] * 10, [ctypes.c_int64] * 8, [ctypes.c_int] * 6
    fn = library.vrlt_decode_attention
    fn.argtypes = [*pointers, *longs, *ints, ctypes.c_float, ctypes.c_float,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
    fn.restype = ctypes.c_int
    library.vrlt_error_string.argtypes = [ctypes.c_int]
    library.vrlt_error_string.restype = ctypes.c_char_p
    return library


def build(nvcc: Path, arch: str, sources: list[Path] | None = None, name: str = LIBRARY) -> Path:
    """`sources` (default: the csrc/ tree) compiled for sm_`arch` into the shared library
    `name`, cached: built once per sources, arch and compiler."""
    sources = sorted(SOURCES.glob("*.cu")) if sources is None else sources
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(version.encode() + arch.encode())
    for src in sources:
        key.update(src.read_bytes())
    root = Path(os.environ.get("VLLM_RLT_CACHE_DIR", Path.home() / ".cache" / "vllm_rlt"))
    out = root / "native" / key.hexdigest()[:16] / name
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{name}.{os.getpid()}")  # concurrent builders publish whole files
    cmd = [str(nvcc), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(partial),
           *map(str, sources)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        log = out.with_name("build.log")
        log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
        raise RuntimeError(f"their build failed, log: {log}")
    os.replace(partial, out)
    return out


def decode_pieces(programs: int, max_context: int, num_sms: int) -> int:
    """Pieces (a power of two, one cluster) each row's context is cut into, for a launch of
    `programs` (rows x KV heads) whose rows see at most `max_context` positions: enough for
    PIECES_PER_SM blocks per SM, at most MAX_PIECES, pieces of at least MIN_PIECE positions."""
    by_fill, pieces = -(-PIECES_PER_SM * num_sms // programs), 1
    while pieces < min(by_fill, MAX_PIECES):
        pieces *= 2
    while pieces > 1 and pieces * MIN_PIECE > max_context:
        pieces //= 2
    return pieces


def decode_attention(
    q: torch.Tensor, cache: KVLayer, meta: AttentionMetadata, out: torch.Tensor, num_sms: int
) -> bool:
    """Paged attention of a decode-only launch into `out` by the native kernel; False (nothing
    done) where it is not available (checked first: the off switch costs nothing), or has no
    instance for the shapes, dtypes or alignment."""
    found = native(q.device)
    if found.library is None:
        return False
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = cache.k.shape[2], meta.block_size
    group, num_tiles = num_heads // num_kv_heads, meta.tile_seg.shape[0]
    fits = (
        0 < num_tiles <= MAX_TILES
        and q.dtype in _DTYPE_CODE
        and cache.k.dtype in (q.dtype, FP8)
        and head_dim in HEAD_DIMS
        and group in GROUPS
        and block_size & (block_size - 1) == 0
        and meta.positions.dtype == torch.int64
        and meta.block_tables.dtype == meta.tile_order.dtype == torch.int32
        and all(t.data_ptr() % 16 == 0 for t in (q, out, cache.k, cache.v))
        and all(s % 8 == 0 for s in (*q.stride()[:2], *out.stride()[:2], *cache.k.stride()[1:3]))
    )
    if not fits:
        return False
    pieces = decode_pieces(num_tiles * num_kv_heads, meta.max_context, num_sms)
    stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None
    args = launch_args(q, cache, meta, out, pieces, pdl(q.device), stream)
    err = found.library.vrlt_decode_attention(*args)
    if err:  # refused at launch (nothing ran): Triton from now on
        stop(f"decode attention's launch failed: {found.library.vrlt_error_string(err).decode()}")
        return False
    return True


def stop(reason: str) -> None:
    """No native kernel runs in this process from now on (`report` gives `reason`)."""
    global _stopped
    _stopped = reason
    logger.warning("native kernels off, the Triton kernels run instead: %s", reason)


def launch_args(
    q: torch.Tensor,
    cache: KVLayer,
    meta: AttentionMetadata,
    out: torch.Tensor,
    pieces: int,
    early: bool,
    stream: int | None,
) -> tuple:
    """The arguments of `vrlt_decode_attention` for a decode-only launch in `pieces` pieces
    (`early`: launched with programmatic dependent launch)."""
    _, num_heads, head_dim = q.shape
    num_kv_heads = cache.k.shape[2]
    qk_scale = head_dim**-0.5 * _LOG2E * (cache.k_scale if cache.fp8 else 1.0)
    tables = (meta.tile_order, meta.tile_seg, meta.tile_row_start, meta.tile_num_rows,
              meta.block_tables, meta.positions)  # fmt: skip
    return (
        out.data_ptr(), q.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
        *(t.data_ptr() for t in tables),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache.k.stride()[:3],
        meta.block_tables.stride(0), meta.tile_seg.shape[0], num_kv_heads, head_dim,
        num_heads // num_kv_heads, meta.block_size.bit_length() - 1, pieces, qk_scale,
        cache.v_scale if cache.fp8 else 1.0, _DTYPE_CODE[q.dtype], int(cache.fp8), int(early),
        stream,
    )  # fmt: skip
