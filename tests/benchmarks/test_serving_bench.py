"""The serving benchmark's workloads, in-process driver and metrics on the tiny model, and the
WCPB matrix built on them."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.entrypoints.bench.drivers import run_inprocess
from vllm_rlt.entrypoints.bench.metrics import RequestRecord, gpu_busy_seconds, summarize
from vllm_rlt.entrypoints.bench.workload import build_workload
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.models.tiny import write_tiny_ouro


def test_workload_profiles():
    serial = build_workload("serial", 50, [8], 4, 100, concurrency=8)
    assert serial.concurrency == 1 and all(r.arrival_s == 0 for r in serial.requests)
    mixed = build_workload("concurrent", 300, [256, 512, 768], 4, 100, seed=1)
    lens = {len(r.prompt_token_ids) for r in mixed.requests}
    assert lens == {256, 512, 768}
    arrival = build_workload("arrival", 2000, [8], 4, 100, rate=4.0, seed=2)
    gaps = np.diff([0.0] + [r.arrival_s for r in arrival.requests])
    assert abs(gaps.mean() - 0.25) < 0.02  # exponential gaps at 4 req/s
    assert build_workload("arrival", 5, [8], 4, 100, seed=3) == build_workload(
        "arrival", 5, [8], 4, 100, seed=3
    )
    with pytest.raises(ValueError, match="profile"):
        build_workload("burst", 5, [8], 4, 100)


def test_metrics_follow_the_definitions():
    a = RequestRecord(send_s=0.0, prompt_tokens=10, chunk_s=[0.5, 0.7, 1.0], output_tokens=3)
    b = RequestRecord(send_s=1.0, prompt_tokens=10, chunk_s=[1.2], output_tokens=1)
    s = summarize([a, b, RequestRecord(2.0, 10, ok=False)], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2) / 2)
    assert s["tpot_s"]["mean"] == pytest.approx((1.0 - 0.5) / 2)  # only requests with > 1 token
    assert s["itl_s"]["p50"] == pytest.approx(0.25)  # gaps 0.2 and 0.3, pooled
    assert s["e2e_s"]["mean"] == pytest.approx((1.0 + 0.2) / 2)
    assert s["output_token_throughput"] == pytest.approx(4 / 2.0)


def test_inprocess_driver_records_every_token(tmp_path):
    model = write_tiny_ouro(tmp_path / "m")
    engine = AsyncLLMEngine.from_kwargs(
        str(model), device="cpu", num_kv_blocks=256, block_size=4, max_num_seqs=3
    )
    wl = build_workload("arrival", 6, [5, 17], 4, 256, concurrency=2, rate=50.0, seed=4)

    async def go():
        try:
            return await run_inprocess(engine, wl)
        finally:
            await engine.shutdown()

    records, duration = asyncio.run(go())
    assert all(r.ok and r.output_tokens == 4 and len(r.chunk_s) == 4 for r in records)
    assert all(r.send_s <= r.chunk_s[0] <= r.chunk_s[-1] for r in records)
    summary = summarize(records, duration)
    assert summary["completed"] == 6 and summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]


def test_cli_writes_results_with_engine_counters(tmp_path):
    model = write_tiny_ouro(tmp_path / "m")
    out = tmp_path / "r.json"
    argv = ["bench", "serve", str(model), "--profile", "concurrent", "--num-requests", "4",
            "--input-lens", "9", "--output-len", "3", "--concurrency", "2", "--device", "cpu",
            "--num-kv-blocks", "128", "--block-size", "4", "--wavefront-chunked-prefill",
            "--prefill-chunk-size", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4
    engine = result["engine"]
    assert engine["generated_tokens"] == 4 * 3  # warm-up excluded
    assert engine["prefill_rows"] == 4 * 9 * 4  # every prompt position at every depth
    assert engine["rows_per_invocation"] > 1


def test_wcpb_matrix_smoke_interleaves_modes_and_reports_the_bound(tmp_path):
    from benchmarks.wcpb_matrix import main as matrix

    argv = [
        "--smoke",
        "--out-dir",
        str(tmp_path),
        "--chunks",
        "32",
        "--cells",
        "2",
        "--repeats",
        "2",
    ]
    summary = matrix(argv)
    assert [(c["chunk"], c["profile"], c["inputs"]) for c in summary] == [
        (32, "concurrent", "fixed")
    ]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["atomic", "split", "wcpb"] * 2  # interleaved repeats
    ratios = summary[0]["wcpb_over_split"]
    assert ratios["invocation bound"] > 1  # WCPB needs fewer invocations per request
    assert ratios["prefill rows/prefill inv"] > 1
    assert (tmp_path / "README.md").read_text().startswith("# WCPB matrix")

    # A second call with another cell keeps the first call's runs; rerunning a cell replaces it.
    again = ["--smoke", "--out-dir", str(tmp_path), "--chunks", "32", "--repeats", "1"]
    matrix(again + ["--cells", "0"])
    summary = matrix(again + ["--cells", "2"])
    assert [(c["profile"], c["inputs"]) for c in summary] == [
        ("concurrent", "fixed"),
        ("serial", "fixed"),
    ]
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["calls"]) == 3
    assert len(results["runs"]) == 3 + 3  # one repeat of each cell, three modes each


def test_wcpb_matrix_keeps_the_runs_of_a_call_cut_off_mid_cell(tmp_path, monkeypatch):
    import benchmarks.wcpb_matrix as wcpb_matrix

    real_run_one = wcpb_matrix.run_one
    done = []

    def cut_off_at_the_third_run(*args):
        if len(done) == 2:
            raise TimeoutError("the call's time limit")  # as `timeout` ends a GPU call
        done.append(real_run_one(*args))
        return done[-1]

    monkeypatch.setattr(wcpb_matrix, "run_one", cut_off_at_the_third_run)
    argv = ["--smoke", "--out-dir", str(tmp_path), "--chunks", "32", "--cells", "0"]
    with pytest.raises(TimeoutError):
        wcpb_matrix.main(argv + ["--repeats", "2", "--modes", "split", "wcpb"])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["mode"], r["repeat"]) for r in runs] == [("split", 0), ("wcpb", 0)]
    assert [r["summary"] for r in runs] == [r["summary"] for r in done]
    (cell,) = json.loads((tmp_path / "summary.json").read_text())
    assert cell["modes"]["wcpb"]["repeats"] == 1


def test_gpu_busy_merges_overlapping_device_activity():
    events = [
        {"cat": "kernel", "ts": 0.0, "dur": 10.0},
        {"cat": "kernel", "ts": 5.0, "dur": 10.0},  # overlaps the first: 0-15
        {"cat": "gpu_memcpy", "ts": 12.0, "dur": 1.0},  # inside
        {"cat": "gpu_memset", "ts": 20.0, "dur": 5.0},  # 20-25
        {"cat": "cpu_op", "ts": 30.0, "dur": 100.0},  # host work does not count
        {"cat": "kernel", "ts": 40.0},  # an instant event without duration
    ]
    assert gpu_busy_seconds(events) == pytest.approx(20e-6)
    assert gpu_busy_seconds([]) == 0.0


def test_wcpb_matrix_keeps_profiled_rounds_out_of_the_timed_medians():
    from benchmarks.wcpb_matrix import markdown, summarize_matrix

    def run(mode, repeat, rps, profiled=False, busy=None):
        engine = {"rows_per_invocation": 4.0, "prefill_rows_per_prefill_invocation": 8.0}
        engine["invocations_per_request"] = 10.0 if mode == "split" else 5.0
        pct = {"p50": 0.1, "p99": 0.2}
        summary = {"request_throughput": rps, "output_token_throughput": 10 * rps}
        summary |= {"ttft_s": pct, "tpot_s": pct, "itl_s": pct, "e2e_s": pct}
        cell = {"chunk": 32, "profile": "serial", "inputs": "fixed", "mode": mode}
        out = {**cell, "repeat": repeat, "profiled": profiled, "summary": summary}
        return out | {"engine": engine} | ({"gpu_busy_fraction": busy} if profiled else {})

    runs = [run("split", 0, 1.0), run("wcpb", 0, 2.0), run("split", 1, 3.0), run("wcpb", 1, 4.0)]
    runs += [run("split", 2, 100.0, True, 0.5), run("wcpb", 2, 100.0, True, 0.75)]
    (cell,) = summarize_matrix(runs)
    split, wcpb = cell["modes"]["split"], cell["modes"]["wcpb"]
    assert (split["repeats"], split["req/s"]["median"], split["req/s"]["max"]) == (2, 2.0, 3.0)
    assert (wcpb["GPU busy"]["median"], split["GPU busy"]["median"]) == (0.75, 0.5)
    assert cell["wcpb_over_split"]["req/s"] == pytest.approx(1.5)
    assert cell["wcpb_over_split"]["invocation bound"] == pytest.approx(2.0)
    # saved after every run: the table must also render between the two modes' profiled rounds
    table = markdown(summarize_matrix(runs[:-1]), calls=[]).splitlines()
    rows = {line.split(" | ")[0]: line for line in table if line.startswith("| ")}
    assert rows["| wcpb"].endswith(" | - |")
    assert rows["| split"].endswith(" | 0.5 (0.5-0.5) |")


def test_wcpb_matrix_runs_the_capped_wcpb_experiment(tmp_path):
    from benchmarks.wcpb_matrix import main as matrix

    argv = ["--smoke", "--out-dir", str(tmp_path), "--chunks", "32", "--cells", "2"]
    summary = matrix(argv + ["--repeats", "1", "--modes", "split", "wcpb-cap", "--wcpb-cap", "2"])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["split", "wcpb-cap"]
    assert "wcpb_over_split" not in summary[0]
    assert summary[0]["wcpb-cap_over_split"]["invocation bound"] > 1
    assert "WCPB with the cap / Split" in (tmp_path / "README.md").read_text()


def test_wcpb_matrix_long_prompt_mix_against_unchunked(tmp_path):
    """The long-prompt mix: every 10th prompt long (taken in order, not drawn); unchunked is
    refill scheduling with one chunk = the budget; WCPB's ratios over it are reported."""
    from benchmarks.wcpb_matrix import cell_config
    from benchmarks.wcpb_matrix import main as matrix

    wl = build_workload("concurrent", 20, [8192] + [512] * 9, 4, 100, cycle=True)
    assert [len(r.prompt_token_ids) for r in wl.requests][:11] == [8192] + [512] * 9 + [8192]
    args = argparse.Namespace(
        async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=1024, kv_cache_gb=1.0,
        wcpb_cap=256,
    )  # fmt: skip
    assert cell_config(args, 32, "unchunked").scheduler.chunk_size == 1024
    assert cell_config(args, 32, "unchunked").scheduler.scheduling_mode == "refill"
    argv = ["--smoke", "--out-dir", str(tmp_path), "--chunks", "8", "--repeats", "1"]
    argv += ["--inputs", "long", "--profiles", "concurrent", "--modes", "unchunked", "wcpb"]
    summary = matrix(argv)
    assert [(c["profile"], c["inputs"]) for c in summary] == [("concurrent", "long")]
    assert set(summary[0]["modes"]) == {"unchunked", "wcpb"}
    assert "req/s" in summary[0]["wcpb_over_unchunked"]
    assert "WCPB / unchunked" in (tmp_path / "README.md").read_text()
