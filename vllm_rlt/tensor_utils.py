"""Tensor helpers every layer may use (a leaf: imports torch and numpy only): the accumulation
dtype, and copies between host and device that do not stall the host longer than needed.

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


def read_back(*tensors: torch.Tensor | None) -> Callable[[], tuple[torch.Tensor | None, ...]]:
    """Start copying `tensors` (None entries pass through) to the host; the returned function
    waits for those copies alone and gives the host tensors."""
    if all(t is None or t.device.type != "cuda" for t in tensors):
        return lambda: tensors
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
