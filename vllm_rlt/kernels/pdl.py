"""Programmatic dependent launch (Hopper and later): a kernel launched with `launch_pdl=True`
starts while the kernel before it still runs, does the work that does not depend on it, then
waits for it (`wait_for_primary`: the earlier kernel complete and its writes visible). The
earlier kernel lets it start by calling `release_dependents`; kernels after which nothing is
launched this way may call it too: it does nothing then.

The few-row GEMM (`skinny_gemm`) uses this to pull its weights (which no kernel writes) into the
L2 while the norm, activation or attention kernel that produces its input finishes; the RMSNorm
loads its weights, paged attention its tile's tables, and the split combine simply starts, before
they wait. The norm, attention and combine kernels let the next one start at once, the GEMM
once it has read its weights (at once, the next GEMM's programs would take SM slots while it
streams). A kernel launched early must wait, in every program, before it reads the previous
kernel's output or writes anything: then a kernel two launches back is complete once the
previous one is.
`VLLM_RLT_PDL=0` in the environment turns it off (for comparisons).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from vllm_rlt.kernels.device_info import INTERPRET

ENABLED = os.environ.get("VLLM_RLT_PDL", "1") != "0"


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` may use programmatic dependent launch."""
    cuda = device.type == "cuda" and ENABLED and not INTERPRET
    return cuda and _capability_major(device) >= 9


def launch_options(gdc: bool) -> dict:
    """Launch keywords of a kernel that waits for its primary (`wait_for_primary` on every path
    before it reads or writes what kernels before it use): an early launch when `gdc`."""
    return {"launch_pdl": True} if gdc else {}


@functools.cache
def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


@triton.jit
def release_dependents(GDC: tl.constexpr):
    """Let a kernel launched after this one with launch_pdl start (GDC: `pdl(device)`)."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_primary(GDC: tl.constexpr):
    """Wait until the kernel before this one completed and its writes are visible."""
    if GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Pull the 128-byte lines at `ptrs` into the L2 (no registers, no wait)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip
