"""Every kernel family compiles for an sm_90 GPU (Hopper, early launch on) from the launches
its wrappers make, on this machine without a GPU (`sm90_compile.py`, in a process without the
Triton interpreter): a GPU-only compile error shows here, not in scarce device time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

KERNELS = {
    "_rms_norm_kernel", "_silu_mul_kernel", "_gate_kernel", "_rope_kernel", "_write_kv_kernel",
    "_bias_rope_kernel", "_skinny_gemm_kernel", "_invariant_gemm_kernel",
    "_paged_attention_kernel", "_combine_kernel", "_enter_kernel", "_exit_kernel", "_fill_kernel",
    "_take_kernel", "_take_lanes_kernel",
}  # fmt: skip


def test_kernels_compile_for_sm90():
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sm90_compile.py"))],
        cwd=root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = [line.split() for line in run.stdout.splitlines()]
    assert {name for name, *_ in compiled} == KERNELS
    # early launch compiled in where the kernels use it (launch_dependents and wait)
    assert all(int(n) == 2 for name, _, n in compiled if name == "_skinny_gemm_kernel")
