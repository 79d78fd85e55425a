"""The layer-kernels probe's timeline summary (`benchmarks/probes/layer_kernels.boundaries`):
per pair of consecutive GPU activities, the second's mean duration and the mean gap after the
first ends, negative where they overlap; CPU events do not count."""

from __future__ import annotations

from benchmarks.probes.layer_kernels import boundaries


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_boundaries_report_gaps_and_overlaps_per_kernel_pair():
    events = [
        kernel("_norm", 15.0, 10.0),  # out of order: sorted by start
        kernel("_gemm", 0.0, 10.0),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 50.0},
        kernel("_norm", 40.0, 4.0),
        kernel("_gemm", 27.0, 11.0),
    ]
    got = boundaries(events)
    assert got["span_us"] == 44.0 and got["busy_us"] == 35.0
    assert got["pairs"] == {
        "_gemm -> _norm": {"count": 2, "mean_dur_us": 7.0, "mean_gap_us": 3.5},  # 5 and 2
        "_norm -> _gemm": {"count": 1, "mean_dur_us": 11.0, "mean_gap_us": 2.0},
    }
    early = boundaries([kernel("_gemm", 0.0, 10.0), kernel("_attention", 8.0, 3.0)])
    assert early["pairs"]["_gemm -> _attention"]["mean_gap_us"] == -2.0
    assert boundaries([]) == {"span_us": 0.0, "busy_us": 0.0, "pairs": {}}
