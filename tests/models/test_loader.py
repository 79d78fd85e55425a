"""Loading real HF-format directories: single file and shards reproduce the reference logits;
missing, unexpected and mis-shaped tensors and unsupported configs fail naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import rel_err
from vllm_rlt.models.loader import CheckpointError, load_model, read_config
from vllm_rlt.models.reference import DenseOuroReference
from vllm_rlt.models.registry import UnsupportedConfigError
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.plan_driver import PlanDriver


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("tiny"), seed=11)


def reference_logits(model, ids):
    return DenseOuroReference.from_model(model).run(ids).logits


@pytest.mark.parametrize("num_shards", [1, 3])
def test_single_file_and_shards_reproduce_the_reference(tmp_path, tiny_dir, num_shards):
    path = write_tiny_ouro(tmp_path / "m", seed=11, num_shards=num_shards)
    files = sorted(p.name for p in path.iterdir())
    assert ("model.safetensors.index.json" in files) == (num_shards > 1)
    loaded = load_model(path, device="cpu")
    original = load_model(tiny_dir, device="cpu")
    ids = loaded.tokenizer.encode("import os\nprint(os.getcwd())").ids
    assert loaded.tokenizer.decode(ids) == "import os\nprint(os.getcwd())"
    expected = reference_logits(original.model, ids)
    states, _ = PlanDriver(loaded.model, 32, 4).prefill_all_depths("a", ids)
    assert rel_err(loaded.model.coda(states), expected) < 1e-5
    assert loaded.model.lm_head.weight.dtype == torch.float32  # auto = fp32 on CPU


def test_dtype_override_and_dummy_weights(tiny_dir):
    bf16 = load_model(tiny_dir, device="cpu", dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    a = load_model(tiny_dir, device="cpu", load_format="dummy", seed=1)
    b = load_model(tiny_dir, device="cpu", load_format="dummy", seed=1)
    real = load_model(tiny_dir, device="cpu")
    wa, wb = a.model.lm_head.weight, b.model.lm_head.weight
    assert torch.equal(wa, wb) and not torch.equal(wa, real.model.lm_head.weight)
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_dir, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="load_format"):
        load_model(tiny_dir, device="cpu", load_format="pickle")


def _rewrite(src, dst, edit):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, tiny_dir):
    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
        t["model.norm.weight"] = torch.ones(31)

    _rewrite(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path / "bad", device="cpu")
    message = str(info.value)
    assert "missing tensors: ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected tensors: ['model.layers.0.self_attn.q_norm.weight']" in message
    assert "model.norm.weight has shape [31], expected [32]" in message


def test_missing_files_are_reported(tmp_path, tiny_dir):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path, device="cpu")
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        load_model(tmp_path, device="cpu")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_fail_naming_the_setting(tmp_path, tiny_dir, change, needle):
    raw = json.loads((tiny_dir / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedConfigError, match=needle):
        read_config(tmp_path)


def test_config_fields_follow_the_checkpoint(tiny_dir):
    config = read_config(tiny_dir)
    assert (config.num_loops, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    raw = json.loads((tiny_dir / "config.json").read_text())
    del raw["head_dim"]
    (tiny_dir.parent / "nohd").mkdir(exist_ok=True)
    (tiny_dir.parent / "nohd" / "config.json").write_text(json.dumps(raw))
    assert read_config(tiny_dir.parent / "nohd").head_dim == 32 // 4
