"""The speculative-decoding benchmark (`benchmarks/speculative.py`) at smoke sizes on the CPU,
and its cost model."""

from __future__ import annotations

import json

import pytest

from benchmarks import speculative

SMOKE = ["--dtype", "float32", "--prompt-len", "16", "--output-len", "8", "--repeats", "1",
         "--drafts", "2", "--draft-loops", "1", "--kv-cache-gb", "0.1"]  # fmt: skip


def test_packaged_mode(tmp_path):
    out = tmp_path / "packaged.json"
    result = speculative.main(["packaged", "--concurrency", "1", *SMOKE, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    off, on = result["results"]
    assert (off["drafts"], on["drafts"], off["speedup"]) == (0, 2, 1.0)
    assert 0 <= on["acceptance_rate"] <= 1 and 1 <= on["mean_accepted_length"] <= 3


def test_cost_mode(tmp_path):
    args = ["cost", "--shape", "tiny", "--concurrency", "2", *SMOKE, "--acceptance", "0.8"]
    result = speculative.main([*args, "--out", str(tmp_path / "cost.json")])["results"]
    assert result["costs_ms"][2] and [r["drafts"] for r in result["adaptive"]] == [0, 2]
    assert [(r["acceptance"], r["drafts"]) for r in result["model"]] == [(0.8, 2)]


def test_cost_mode_stops_when_the_kv_cache_cannot_hold_every_request(tmp_path):
    """Requests admitted as others finish would never verify in lockstep: no cost to time."""
    smoke = [a if a != "0.1" else "0.0005" for a in SMOKE]  # about 500 positions
    args = ["cost", "--shape", "tiny", "--concurrency", "32", *smoke, "--acceptance", "0.8"]
    with pytest.raises(SystemExit, match="raise --kv-cache-gb"):
        speculative.main([*args, "--out", str(tmp_path / "cost.json")])


def test_cost_model():
    """The issue's example: d = 1, K = 4, a = 0.9, D = 4, weight-bound (equal costs): ~2x."""
    assert speculative.modeled_speedup(0.9, 4, 1, 4, 1.0, 1.0) == pytest.approx(2.05, abs=0.01)
    assert speculative.modeled_speedup(0.0, 2, 1, 4, 1.0, 3.0) < 1  # nothing accepted: a loss
