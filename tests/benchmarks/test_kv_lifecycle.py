"""The KV-lifecycle benchmark (`benchmarks/kv_lifecycle.py`), every scenario on the tiny model."""

from __future__ import annotations

import json

from benchmarks import kv_lifecycle

RUN_FIELDS = {
    "run", "settings", "device_free_gib_at_start", "num_requests", "completed", "wall_s",
    "request_throughput", "output_tok_s", "ttft_s", "tpot_s", "num_kv_blocks", "preemptions",
    "prefix_queries", "prefix_hits", "running_per_step", "peak_blocks_per_plane", "steps",
}  # fmt: skip


def test_every_scenario_reports_its_runs(tmp_path, capsys):
    out = tmp_path / "kv.json"
    result = kv_lifecycle.main(["--smoke", "--out", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == result
    assert {"commit", "engine_sha256", "gpu", "torch", "command"} <= set(result["meta"])
    scenarios = result["scenarios"]
    assert list(scenarios) == ["defaults", "early_stop", "prefix", "pressure"]
    for name, res in scenarios.items():
        sizes = kv_lifecycle.SIZES["smoke"][name]
        assert res["sizes"] == sizes and res["method"]
        for run in res["runs"]:
            assert set(run) == RUN_FIELDS
            assert run["num_requests"] == run["completed"] == sizes["requests"]
            assert set(run["ttft_s"]) == set(run["tpot_s"]) == {"p50", "p90", "p99", "mean"}
            assert run["request_throughput"] > 0 and run["steps"] > 0
        assert f"### {name}" in printed  # its Markdown table

    defaults = scenarios["defaults"]
    default_kv, fixed_kv = defaults["runs"]
    assert default_kv["settings"]["kv_cache_memory_gb"] is None
    assert default_kv["num_kv_blocks"] != fixed_kv["num_kv_blocks"]
    assert set(defaults["ratios_default_over_fixed"]["max_num_seqs=4"]) == {
        "request_throughput", "output_tok_s", "ttft_p50", "tpot_p50"
    }  # fmt: skip

    early = scenarios["early_stop"]
    on_demand, reservation = early["runs"]
    assert on_demand["num_kv_blocks"] == reservation["num_kv_blocks"] == early["num_kv_blocks"]
    # one request's prompt + max_tokens - 1 positions fill the whole cache: one at a time
    assert reservation["running_per_step"]["max"] == early["reservation_max_running"] == 1
    assert on_demand["running_per_step"]["max"] > 1
    assert on_demand["preemptions"] == 0

    prefix = scenarios["prefix"]
    on, off = prefix["runs"]
    sizes = kv_lifecycle.SIZES["smoke"]["prefix"]
    # the first request fills the cache; every later one finds the whole system prompt there
    assert on["prefix_hits"] == (sizes["requests"] - 1) * sizes["system"]
    assert on["prefix_queries"] == sizes["requests"] * (sizes["system"] + sizes["suffix"] - 1)
    assert off["prefix_queries"] == off["prefix_hits"] == 0

    pressure = scenarios["pressure"]
    pressured, unpressured = pressure["runs"]
    assert pressure["all_completed"]
    assert pressured["num_kv_blocks"] == pressure["working_set_blocks"] // 4
    assert pressured["preemptions"] > 0 and unpressured["preemptions"] == 0
    assert max(pressured["peak_blocks_per_plane"]) <= pressured["num_kv_blocks"]
