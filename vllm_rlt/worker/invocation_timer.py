"""Device time of recurrent-core invocations by shape, for benchmarks (`ModelRunner.timer`).

Per-kernel profiles cannot attribute a run's time to invocations when kernels launch early
(each kernel's recorded span then includes its wait for the one before, `kernels/pdl.py`), and
the invocation bound assumes that invocations cost the same. Timing each call by its shape shows
what they do cost. A shape is `kind bucket`: kind `prefill`, `mixed` or `decode` by the rows it
carries, bucket the CUDA graph's rows or `eager` (the keys of `benchmarks.schedule_replay`, so
that counted and timed invocations line up).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


def invocation_kind(decode_rows: int, rows: int) -> str:
    """`prefill`, `mixed` or `decode`: an invocation of `rows` rows, `decode_rows` of them
    decode rows."""
    return "mixed" if 0 < decode_rows < rows else "decode" if decode_rows else "prefill"


def invocation_shape(decode_rows: int, rows: int, bucket: int | None) -> str:
    """The shape of such an invocation replayed in the graph of `bucket` rows (None: run
    eagerly)."""
    return f"{invocation_kind(decode_rows, rows)} {'eager' if bucket is None else bucket}"


def detailed_shape(
    decode_rows: int, rows: int, bucket: int | None, prefill_end: int, decode_position: int
) -> str:
    """A finer key, for invocations whose cost depends on context: `b{bucket} d{decode rows}
    p{prefill rows, rounded up to 128} pc{the last prefill position, rounded up to 2K}K
    dc{the latest decode position, likewise}K` (a tile's KV stream grows with its context)."""
    up = lambda n, step: -(-n // step) * step  # noqa: E731
    return (
        f"b{'eager' if bucket is None else bucket} d{decode_rows} p{up(rows - decode_rows, 128)} "
        f"pc{up(prefill_end, 2048) // 1024}K dc{up(decode_position, 2048) // 1024}K"
    )


class InvocationTimer:
    """Collects the time of each call timed with `time(shape)`. On CUDA: events recorded
    around the call on the current stream, read only by `summary` (no host synchronisation
    while the engine runs); a span includes the graph launch if the GPU was waiting for it.
    Elsewhere the host's clock: CPU calls run synchronously."""

    def __init__(self, device: torch.device, by_context: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.by_context = by_context  # the runner keys calls by `detailed_shape`
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._ms: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def time(self, shape: str):
        if not self.cuda:
            start = time.perf_counter()
            yield
            self._ms[shape].append(1e3 * (time.perf_counter() - start))
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((shape, start, end))

    def summary(self) -> dict[str, dict[str, float]]:
        """{shape: {count, total_ms, mean_ms}} over every call timed so far, by total time
        (waits for the device)."""
        if self._events:
            self._events[-1][2].synchronize()
        for shape, start, end in self._events:
            self._ms[shape].append(start.elapsed_time(end))
        self._events.clear()
        stats = {
            shape: {"count": len(ms), "total_ms": sum(ms), "mean_ms": sum(ms) / len(ms)}
            for shape, ms in self._ms.items()
        }
        return dict(sorted(stats.items(), key=lambda kv: -kv[1]["total_ms"]))
