"""The roofline's work counts, against a real model's parameters and hand-counted small cases."""

from __future__ import annotations

import json

import pytest

from benchmarks.model_shapes import SHAPES, write_shape
from benchmarks.roofline import (
    COPY_GBPS,
    MATMUL_TFLOPS,
    layer_params,
    mode_floors,
    offline_floors,
    offline_table,
    request_work,
    table,
)
from vllm_rlt.models.loader import load_model


def test_layer_params_count_the_shared_layers_gemm_weights(tmp_path):
    shape = json.loads((write_shape("tiny", tmp_path / "m") / "config.json").read_text())
    model = load_model(tmp_path / "m", dtype="float32", load_format="dummy").model
    weights = [p for name, p in model.model.layers.named_parameters() if "norm" not in name]
    assert layer_params(shape) == sum(p.numel() for p in weights)


def test_request_work_counts_visible_keys_and_tile_reads():
    one = {
        "num_hidden_layers": 1, "total_ut_steps": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 2,
    }  # fmt: skip
    # prompt 3 + 2 outputs: positions 0..3 pass the core; position p sees p + 1 keys (10 in all),
    # the decode row (position 3) reads 4; K/V rows are 2 x 1 head x 2 dims x 2 bytes = 8 bytes.
    # chunk 2, one-row tiles: tiles end at 1, 2 | 3 -> 6 keys read by the prefill tiles
    work = request_work(one, prompt=3, output=2, chunk=2, tile_rows=1)
    assert (work["attention_flops"], work["kv_bytes"]) == (4 * 2 * 10, 8 * (4 + 4 + 6))
    # the prompt's rows (positions 0-2) see 6 keys, write 3 rows and read 6 through their tiles;
    # the decode row sees 4, writes 1 and reads 4
    assert work["prefill"] == {"attention_flops": 4 * 2 * 6, "kv_bytes": 8 * (3 + 6)}
    assert work["decode"] == {"attention_flops": 4 * 2 * 4, "kv_bytes": 8 * (1 + 4)}
    # one tile per chunk: tiles end at 2 | 3
    assert request_work(one, 3, 2, chunk=2, tile_rows=64)["kv_bytes"] == 8 * (4 + 4 + 5)
    # every loop repeats the work
    looped = request_work({**one, "total_ut_steps": 4}, 3, 2, chunk=2, tile_rows=64)
    assert (looped["attention_flops"], looped["kv_bytes"]) == (4 * 4 * 2 * 10, 4 * 8 * 13)


def test_offline_floors_count_full_prefill_invocations_and_decode_waves():
    def floors():
        args = {"shape": "ouro-1.4b", "prompt_len": 512, "output_len": 64,
                "max_num_batched_tokens": 2048, "chunk_size": 512}  # fmt: skip
        runs = [{"concurrency": c, "num_requests": 2 * c, "wall_s": 1.0} for c in (1, 8)]
        rows = offline_floors({"meta": {"args": args}, "results": runs}, 1e15, 64)
        return {r["concurrency"]: r for r in rows}

    per_read = 1e15 / (COPY_GBPS * 1e9)  # seconds per weight read, dominating everything else
    rows = floors()
    # c = 1: 2 waves of one request; a prompt's 512 rows take one invocation per loop, its 63
    # decode tokens one invocation per loop each (the K/V bytes add ~1e-6)
    assert rows[1]["prefill_s"] == pytest.approx(4 * 2 * per_read, rel=1e-5)
    assert rows[1]["decode_s"] == pytest.approx(4 * 63 * 2 * per_read, rel=1e-5)
    # c = 8: 2 waves of 8 prompts, whose 4096 rows fill 2 invocations of 2048 per loop
    assert rows[8]["prefill_s"] == pytest.approx(4 * 2 * 2 * per_read, rel=1e-5)
    assert rows[8]["decode_s"] == pytest.approx(4 * 63 * 2 * per_read, rel=1e-5)
    for r in rows.values():  # hiding one phase under the other can only lower the floor
        assert r["overlapped_s"] <= r["separate_s"] == r["prefill_s"] + r["decode_s"]
        assert r["output_tokens"] == 2 * r["concurrency"] * 64


def test_offline_floors_of_the_real_shape_put_prefill_at_its_compute():
    args = {"shape": "ouro-1.4b", "prompt_len": 512, "output_len": 64,
            "max_num_batched_tokens": 2048, "chunk_size": 512}  # fmt: skip
    runs = [{"concurrency": 32, "num_requests": 64, "wall_s": 1.8}]
    (row,) = offline_floors({"meta": {"args": args}, "results": runs}, 2.47e9, 64)
    rows_flops = 64 * 512 * 4 * 2.0 * layer_params(SHAPES["ouro-1.4b"])
    assert row["prefill_s"] > rows_flops / (MATMUL_TFLOPS * 1e12)  # plus attention
    assert row["prefill_s"] < 1.05 * rows_flops / (MATMUL_TFLOPS * 1e12)
    # each of the 2 x 63 x 4 decode invocations reads the weights and 32 rows' K/V at least
    assert row["decode_s"] > 504 * 2.47e9 / (COPY_GBPS * 1e9)
    assert "| 32 | 1.800 | 2275.6 |" in offline_table([row])


def test_table_puts_each_mode_against_its_floor():
    engine = {"rows": 4 * 575, "generated_tokens": 64, "invocations": 100}
    runs = [
        {"chunk": 32, "profile": "serial", "inputs": "fixed", "mode": mode, "repeat": 0,
         "requests": 1, "engine": engine, "summary": {"duration_s": seconds}}
        for mode, seconds in (("atomic", 1.0), ("split", 0.5), ("wcpb", 0.25))
    ]  # fmt: skip
    calls = [{"command": "x", "args": {"seed": 0, "output_len": 64}}]
    rows = mode_floors({"calls": calls, "runs": runs}, 2.5e9, 64, "ouro-1.4b")
    assert [r["mode"] for r in rows] == ["atomic", "split", "wcpb"]
    assert rows[0]["floor_s"] == rows[1]["floor_s"] == rows[2]["floor_s"]  # same work
    assert rows[0]["floor_s"] == rows[0]["memory_s"] > 100 * 2.5e9 / 4245.8e9  # >= the weights
    assert rows[0]["arrival_s"] == 0.0  # serial: every request is there at the start
    ratios = [line.split("|")[-2].strip() for line in table(rows).splitlines()[2:]]
    assert ratios == [f"{s / rows[0]['floor_s']:.2f}" for s in (1.0, 0.5, 0.25)]
