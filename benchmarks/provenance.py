"""Which engine a benchmark ran: the git commit, and a digest of the engine's sources.

The device machine runs a copy of the working tree whose `.git` may be older than the files, so
the commit alone can be wrong there; the digest (SHA-256 over every `vllm_rlt/**/*.py`, path and
content, in path order) identifies the code itself. `python -m benchmarks.provenance` prints the
digest of the current tree, to compare with a result's.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
from pathlib import Path

import torch

import vllm_rlt

PACKAGE = Path(vllm_rlt.__file__).parent


def commit() -> str:
    """HEAD, with "+changes" when the tree differs from it (a copied tree may carry an old HEAD)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    if not head.stdout.strip():
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def engine_digest() -> str:
    """SHA-256 (hex, first 16 digits) of the engine's Python sources."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_meta(args: argparse.Namespace) -> dict:
    """A result's provenance: its arguments, the commit and engine digest, the GPU and the
    versions of torch, Triton and Python."""
    return {
        "args": vars(args),
        "commit": commit(),
        "engine_sha256": engine_digest(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    print(engine_digest())
