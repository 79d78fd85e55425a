"""Tensor helpers every layer may use (a leaf: imports torch and numpy only): the accumulation
dtype, counter-based random numbers (`counter_uniform`), and copies between host and device
that do not stall the host longer than needed.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the
stream, so the host waits for every kernel queued before it and cannot prepare the next step
while the GPU works. `to_device` stages the values in pinned memory (torch's caching host
allocator keeps the block alive until the copy has run) and copies asynchronously. On the CPU it
returns the host tensor itself.

The other way, `.tolist()` on a device tensor waits for everything queued on the stream, also
work queued after the tensor was computed. `read_back` starts the copies into pinned memory at
once and marks them with an event: waiting on it waits for the copies only, so the kernels queued
afterwards (a step's recurrent-core invocations) keep running while the host goes on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype for statistics and accumulations: fp32, or the input's own if wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


_MASK31 = (1 << 31) - 1
# Odd 31-bit multipliers: a 31-bit state times one stays below 2**62, inside int64.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995
_SALT = 0x2545F491  # starting state, so seed 0 / counter 0 do not start from zero


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor, ids: torch.Tensor):
    """[N, K] float32 uniform in (0, 1), a pure function of (seeds[i], counters[i], ids[k]):
    the same values whatever else is in the batch, on any device.

    seeds, counters: [N] int64; ids: [K] int64 (>= 0, < 2**31).
    """
    key = torch.full_like(seeds, _SALT)
    for value in (seeds, counters):  # absorb both 64-bit values, 31 + 31 + 2 bits at a time
        for shift in (0, 31, 62):
            key = _mix(key ^ ((value >> shift) & _MASK31))
    # Two keys, so rows whose first keys differ only in low bits still get unrelated values.
    key2 = _mix(key ^ _SALT)
    bits = _mix(_mix(key[:, None] ^ ids[None, :]) ^ key2[:, None])  # bijective in the id
    # fp32 keeps full relative precision near 0; the clamp keeps the value below 1 after rounding
    return ((bits.float() + 0.5) * 2.0**-31).clamp_(max=1.0 - 2.0**-24)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 31-bit int64 values (multiply mod 2**31 and xor-shift rounds)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK31
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK31
    return x ^ (x >> 16)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values (a list, tuple, numpy array or CPU tensor) -> a tensor of `dtype` on `device`,
    without a host synchronisation on CUDA."""
    if isinstance(values, torch.Tensor):
        host = values
    elif isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    else:
        host = torch.tensor(values)
    host = host.to(dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`arrays` on `device` through one host buffer and, on CUDA, one copy (a pinned
    allocation and a copy cost the host more than a small array's bytes): views of it, in
    order, each of its array's dtype and shape."""
    sizes = [-(-a.nbytes // 8) * 8 for a in arrays]  # (each view 8-byte aligned)
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw, at = host.numpy(), 0
    for a, size in zip(arrays, sizes, strict=True):
        raw[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        at += size
    packed = host.to(device, non_blocking=True)
    views, at = [], 0
    for a, size in zip(arrays, sizes, strict=True):
        dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype
        views.append(packed[at : at + a.nbytes].view(dtype).view(a.shape))
        at += size
    return views


def read_back(*tensors: torch.Tensor | None) -> Callable[[], tuple[torch.Tensor | None, ...]]:
    """Start copying `tensors` (None entries pass through) to the host; the returned function
    waits for those copies alone and gives the host tensors."""
    if all(t is None or t.device.type != "cuda" for t in tensors):  # copies of them now
        hosts = tuple(None if t is None else t.clone() for t in tensors)
        return lambda: hosts
    hosts = tuple(
        None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors
    )
    for host, t in zip(hosts, tensors, strict=True):
        if t is not None:
            host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> tuple[torch.Tensor | None, ...]:
        copied.synchronize()
        return hosts

    return wait
