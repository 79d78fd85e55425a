"""The timed scheduler replay of matrix cells (`benchmarks/timed_replay.py`)."""

from __future__ import annotations

import json

import pytest

from benchmarks import timed_replay
from benchmarks.schedule_replay import DEPTH


def test_cost_model_reproduces_the_measured_invocations():
    ms = timed_replay.invocation_ms
    assert ms(8, 0) == pytest.approx(1.56, abs=0.02)  # decode-only, 8 rows
    assert ms(0, 512) == pytest.approx(3.02, abs=0.05)  # prefill-only
    assert ms(0, 1024) == pytest.approx(5.03, abs=0.05)
    assert ms(7, 512) == pytest.approx(4.2, abs=0.1)  # mixed: 4.15-4.46 measured
    assert ms(7, 256, "additive") > ms(0, 256) > ms(1, 0)


def _ridden(shape: str) -> int:
    """Prefill rows a tail gap's token rode (bracketed invocations it only waited for)."""
    return sum(int(p) for p in shape.split("+") if p.isdigit())


def test_arrival_cell_replay_shows_where_each_mode_puts_prefill(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--cells", "10", "--num-requests", "8", "--modes", "split", "wcpb-noride", "wcpb"]
    runs = timed_replay.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["runs"] == runs
    split, wcpb, ride = (runs[f"cell 10 seed 0 {m}"] for m in ("split", "wcpb-noride", "wcpb"))
    decode_token = DEPTH * timed_replay.invocation_ms(1, 0) + timed_replay.SAMPLE_MS
    for r in (split, wcpb, ride):  # most tokens: one request decoding alone, D loops per step
        assert r["ITL p50 ms"] == pytest.approx(decode_token)
        assert r["req/s"] == pytest.approx(wcpb["req/s"], rel=0.01)  # arrival-bound
    assert wcpb["TTFT p50 ms"] < split["TTFT p50 ms"] / 2
    # Split's tail tokens ride a 128-row chunk at each of their D loops; without its ride limit
    # WCPB's ride a whole 512-token prompt (4 chunks at each depth) in one gap, if any reach the
    # p99; with it (the default) a token rides at most 512 prefill rows, so more gaps wait, each
    # for less
    assert max(_ridden(s) for s in split["tail shapes"]) <= 2 * DEPTH * 128
    assert max(_ridden(s) for s in wcpb["tail shapes"]) == DEPTH * 512
    assert {_ridden(s) for s in ride["tail shapes"]} == {512}
    waiting = "gaps waiting for prefill"
    assert wcpb[waiting] < ride[waiting] and wcpb[waiting] < split[waiting]
    assert ride["ITL p99 ms"] < split["ITL p99 ms"]
