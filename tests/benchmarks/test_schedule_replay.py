"""The scheduler-only replay of a matrix cell (`benchmarks/schedule_replay.py`)."""

from __future__ import annotations

import json

from benchmarks import schedule_replay
from vllm_rlt.entrypoints.bench.workload import build_workload


def test_replay_counts_every_mode_running_the_same_rows(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--chunk", "32", "--inputs", "variable", "--num-requests", "6", "--output-len", "5"]
    result = schedule_replay.main([*argv, "--max-num-batched-tokens", "256", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    lens = [
        len(r.prompt_token_ids)
        for r in build_workload("concurrent", 6, [256, 512, 768], 1, 2).requests
    ]
    # every prompt position at 4 depths, then 4 loops for each of the 4 tokens after the first
    expected_rows = 4 * sum(lens) + 4 * 4 * 6
    modes = result["modes"]
    assert {m: r["rows"] for m, r in modes.items()} == dict.fromkeys(modes, expected_rows)
    assert "mixed_invocations" not in modes["atomic"]  # refill never mixes
    assert modes["wcpb"]["invocations"] < modes["split"]["invocations"]  # WCPB merges depths
    for r in modes.values():
        assert r["bucket_rows"] >= r["rows"]
        assert sum(r["invocations_by_kind_and_bucket"].values()) == r["invocations"]
        assert r["steps"] < r["invocations"]  # decode alone runs its 4 loops in one step (R1)
        steps = r["steps_by_kind_and_loops"]
        assert sum(steps.values()) == r["steps"]
        # every invocation counted: a step's loops (its tasks may drop out earlier, never later)
        loops = sum(int(k.split(" x")[1]) * n for k, n in steps.items() if not k.startswith("e"))
        assert loops >= r["invocations"]
    assert "mixed x1" not in modes["atomic"]["steps_by_kind_and_loops"]
    # the engine's graphs hold every invocation of these schedules (no eager fallback)
    buckets = [k for r in modes.values() for k in r["invocations_by_kind_and_bucket"]]
    assert not [k for k in buckets if "eager" in k]


def test_replay_counts_invocations_no_graph_holds(monkeypatch):
    # graphs sized for one segment: WCPB's invocations of decode rows beside several pieces run
    # eagerly (variable prompts: requests end their prefill apart, so such invocations occur)
    specs = schedule_replay.graph_specs
    monkeypatch.setattr(
        schedule_replay, "graph_specs", lambda s, b, segments, rows: specs(s, b, 1, rows)
    )
    argv = ["--chunk", "32", "--inputs", "variable", "--num-requests", "4", "--output-len", "2"]
    result = schedule_replay.main([*argv, "--max-num-batched-tokens", "256", "--modes", "wcpb"])
    r = result["modes"]["wcpb"]
    eager = {k: n for k, n in r["invocations_by_kind_and_bucket"].items() if "eager" in k}
    assert eager and sum(r["invocations_by_kind_and_bucket"].values()) == r["invocations"]


def test_async_replay_frees_a_finished_request_without_a_step_more():
    """With one request at a time, each request's slot goes to the next one in the step after its
    last token was sampled, as with synchronous scheduling: with async scheduling that plan,
    which nothing can fill before the token is read back (the only seat is taken), reads it back
    first. The same rows and invocations, and one step more in all: the last, which reads the
    last request's final token."""
    argv = ["--chunk", "32", "--inputs", "fixed", "--num-requests", "3", "--output-len", "3"]
    argv += ["--max-num-seqs", "1", "--modes", "split", "wcpb"]
    sync = schedule_replay.main([*argv, "--no-async-scheduling"])["modes"]
    lagged = schedule_replay.main([*argv, "--async-scheduling"])["modes"]
    for mode in ("split", "wcpb"):
        a, b = sync[mode], lagged[mode]
        assert (b["rows"], b["invocations"]) == (a["rows"], a["invocations"])
        empty_a = a["steps_by_kind_and_loops"]["empty x1"]
        assert b["steps_by_kind_and_loops"]["empty x1"] == empty_a + 1
        assert b["steps"] == a["steps"] + 1
