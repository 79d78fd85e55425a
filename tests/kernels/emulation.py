"""CUDA sources built for the CPU over the emulation in `cuda_emu.h` (see its header), for tests
of the native kernels and the CUDA probes; skips the test without g++ or the CUDA headers
(`$CUDA_HOME/include`)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

HEADERS = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
EMULATION = Path(__file__).with_name("cuda_emu.h")


def build_emulated(source: Path, out_dir: Path) -> ctypes.CDLL:
    """`source` compiled by g++ over the emulation into `out_dir`, loaded."""
    compiler = shutil.which("g++")
    if compiler is None or not (HEADERS / "cuda_bf16.h").exists():
        pytest.skip("needs g++ and the CUDA headers")
    lib = out_dir / f"lib{source.stem}.so"
    subprocess.run(
        [compiler, "-std=c++20", "-O1", "-shared", "-fPIC", "-x", "c++", f"-I{HEADERS}",
         "-DVRLT_EMULATE", "-include", str(EMULATION), str(source), "-o", str(lib), "-lpthread"],
        check=True,
    )  # fmt: skip
    return ctypes.CDLL(str(lib))
