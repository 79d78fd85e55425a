"""The host-time profile of a matrix cell (`benchmarks/probes/host_profile.py`), tiny model."""

from __future__ import annotations

import json

from benchmarks.probes import host_profile


def test_every_step_is_timed_once_per_phase(tmp_path):
    out = tmp_path / "h.json"
    argv = ["--shape", "tiny", "--kv-cache-gb", "0.05", "--num-requests", "2", "--chunk", "32"]
    result = host_profile.main([*argv, "--modes", "split", "wcpb", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    runs = result["runs"]
    assert [(r["mode"], r["profiled"]) for r in runs] == [
        ("split", False), ("wcpb", False), ("split", True), ("wcpb", True)
    ]  # fmt: skip
    for r in runs:
        # two 512-token prompts in 32-token chunks, 64 outputs each: many steps, all timed
        assert r["steps"] > 64
        phases = sum(r[name]["sum_s"] for name in host_profile.PHASES)
        assert 0 < phases <= r["wall_s"]
    for r in runs[2:]:
        assert r["gpu_wait_s"] == 0  # the CPU has nothing to wait for
        assert len(r["top_own_time"]) == 25 and r["top_own_time"][0]["own_s"] > 0
    # the same schedules timed and profiled
    assert runs[0]["steps"] == runs[2]["steps"] and runs[1]["steps"] == runs[3]["steps"]
