"""Host-to-device copies that do not stall the host.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the
stream, so the host waits for every kernel queued before it and cannot prepare the next step
while the GPU works. `to_device` stages the values in pinned memory (torch's caching host
allocator keeps the block alive until the copy has run) and copies asynchronously. On the CPU it
returns the host tensor itself.
"""

from __future__ import annotations

import numpy as np
import torch


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
