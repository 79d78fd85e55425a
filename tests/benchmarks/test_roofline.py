"""The roofline's work counts, against a real model's parameters and hand-counted small cases."""

from __future__ import annotations

import json

from benchmarks.model_shapes import write_shape
from benchmarks.roofline import layer_params, mode_floors, request_work, table
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
    assert work == {"attention_flops": 4 * 2 * 10, "kv_bytes": 8 * (4 + 4 + 6)}
    # one tile per chunk: tiles end at 2 | 3
    assert request_work(one, 3, 2, chunk=2, tile_rows=64)["kv_bytes"] == 8 * (4 + 4 + 5)
    # every loop repeats the work
    looped = request_work({**one, "total_ut_steps": 4}, 3, 2, chunk=2, tile_rows=64)
    assert looped == {"attention_flops": 4 * 4 * 2 * 10, "kv_bytes": 4 * 8 * 13}


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
