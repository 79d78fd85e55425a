"""`vllm-rlt calibrate-kv-scales`: scales measured on text land in a copy of the checkpoint
(single file or sharded), the loader reads them, and an FP8 cache at those scales stores the
calibration text's largest |K| and |V| at exactly 448 / headroom; clear one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.helpers import write_tiny_huginn
from vllm_rlt.entrypoints import calibrate_cmd
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.loader import checkpoint_files
from vllm_rlt.models.tiny import write_tiny_ouro

TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 6
ENGINE = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 256}


def calibrate(model, text_file, out, *extra):
    argv = ["calibrate-kv-scales", str(model), "--text", str(text_file), "--out", str(out),
            "--window", "48", "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256",
            *extra]  # fmt: skip
    return main(argv)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "calibration.txt"
    path.write_text(TEXT)
    return path


@pytest.mark.parametrize("num_shards", [1, 2])
def test_scales_are_written_read_and_fit_the_text(tmp_path, text_file, capsys, num_shards):
    model = write_tiny_ouro(tmp_path / "m", vocab_size=256, seed=2, num_shards=num_shards)
    out = tmp_path / "calibrated"
    assert calibrate(model, text_file, out, "--headroom", "2") == 0
    assert "model.layers.1.self_attn.v_scale" in capsys.readouterr().out
    names = [
        name for pair in LLM(str(model), **ENGINE).engine.model.kv_scale_names() for name in pair
    ]
    assert set(names) <= set(checkpoint_files(out))
    if num_shards > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert {index["weight_map"][n] for n in names} == {calibrate_cmd.SCALES_SHARD}
    llm = LLM(str(out), kv_cache_dtype="fp8", **ENGINE)
    scales = llm.engine.runner.kv_cache.scales
    assert all(0 < s < 1 for pair in scales for s in pair)  # the tiny model's K, V are small
    # the calibration text again, stored in FP8: each layer's largest |K|, |V| is 448 / 2
    calibrate_cmd.measure(llm, [TEXT], 48, 1.0)
    assert llm.engine.runner.kv_cache.amax() == [(224.0, 224.0)] * len(scales)


def test_a_second_calibration_replaces_the_scales(tmp_path, text_file):
    model = write_tiny_ouro(tmp_path / "m", vocab_size=256, seed=2)
    assert calibrate(model, text_file, tmp_path / "a") == 0
    assert calibrate(tmp_path / "a", text_file, tmp_path / "b", "--headroom", "4") == 0
    first, second = (
        LLM(str(tmp_path / d), kv_cache_dtype="fp8", **ENGINE).engine.runner.kv_cache.scales
        for d in ("a", "b")
    )
    doubled = [s * 2 for pair in first for s in pair]
    assert [s for pair in second for s in pair] == pytest.approx(doubled, rel=1e-6)


@pytest.mark.parametrize(
    "case,match",
    [
        ("huginn", "HuginnForCausalLM reads no KV scales"),
        ("out_exists", "exists: give a new directory"),
        ("empty_text", "has no two tokens"),
        ("headroom", "--headroom must be at least 1"),
    ],
)
def test_errors_are_one_line(tmp_path, text_file, case, match):
    model = write_tiny_ouro(tmp_path / "m", vocab_size=256, seed=2)
    out, extra = tmp_path / "out", []
    if case == "huginn":
        model = write_tiny_huginn(tmp_path / "h", seed=1)
    elif case == "out_exists":
        out.mkdir()
    elif case == "empty_text":
        text_file.write_text("")
    else:
        extra = ["--headroom", "0.5"]
    with pytest.raises(SystemExit, match=match) as err:
        calibrate(model, text_file, out, *extra)
    assert "\n" not in str(err.value)
    assert case == "out_exists" or not out.exists()
