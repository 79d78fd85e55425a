"""Facts about where the kernels run, looked up once."""

from __future__ import annotations

import functools
import os

import torch

# Triton runs kernels on CPU tensors in its interpreter when TRITON_INTERPRET is set (before the
# kernel modules are imported); some kernels work around the interpreter's numerics then.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter's grid)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_sm_count(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
