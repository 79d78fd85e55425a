"""tools/train_tiny_ouro.py and tools/looped_lm.py: the training forward against the dense
reference, the exit distribution and objectives against hand-computed numbers, and a tiny
end-to-end CPU run whose export the engine loads and generates from."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import GQA, rel_err, tiny_config
from tools import looped_lm as L
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.loader import init_random_weights, load_model
from vllm_rlt.models.reference import DenseOuroReference
from vllm_rlt.sampling_params import SamplingParams

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_tiny_ouro.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tiny_ouro", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


T = _load_script()


@pytest.mark.parametrize("heads", [GQA, {"num_attention_heads": 4, "num_key_value_heads": 4}])
def test_training_forward_matches_dense_reference(heads):
    config = tiny_config(**heads)
    model = L.TrainOuro(config)
    init_random_weights(model, seed=3)  # random norms and gate bias, not the training init
    names = {n for n, _ in model.named_parameters()}
    assert "model.early_exit_gate.bias" in names and "lm_head.weight" in names
    ref = DenseOuroReference(config, {k: v.detach() for k, v in model.state_dict().items()})
    ids = torch.randint(3, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, gates = model(ids)
    assert logits.shape == (4, 2, 11, config.vocab_size) and gates.dtype == torch.float32
    for b in range(2):
        expected = ref.run(ids[b].tolist())
        assert rel_err(logits[:, b], expected.logits) <= 1e-5
        assert rel_err(gates[:, b], expected.gate_logits) <= 1e-5
    assert rel_err(logits[0], logits[3]) > 1e-2  # the loops really differ


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_exit_distribution_and_losses_by_hand():
    lam = [0.5, 0.2, 0.5, 0.9]  # λ_4 is never used
    gates = torch.tensor([_logit(x) for x in lam])[:, None]  # [D=4, 1 token]
    p = L.log_exit_distribution(gates).exp()[:, 0]
    # p1 = .5; p2 = .5 * .2; p3 = .5 * .8 * .5; p4 = the remaining .5 * .8 * .5
    assert torch.allclose(p, torch.tensor([0.5, 0.1, 0.2, 0.2]), atol=1e-6)
    losses = torch.tensor([4.0, 3.0, 2.0, 1.0])[:, None]
    entropy = -(0.5 * math.log(0.5) + 0.1 * math.log(0.1) + 2 * 0.2 * math.log(0.2))
    loss, ent = L.stage1_loss(losses, gates, beta=0.05)
    assert ent.item() == pytest.approx(entropy, abs=1e-6)
    assert loss.item() == pytest.approx(2.9 - 0.05 * entropy, abs=1e-6)  # .5*4+.1*3+.2*2+.2*1
    # CDF = .5, .6, .8, 1.0: the first loop reaching q, 0-based
    depths = {q: L.exit_steps(gates, q).item() for q in (0.3, 0.5, 0.55, 0.7, 0.9, 1.0)}
    assert depths == {0.3: 0, 0.5: 0, 0.55: 1, 0.7: 2, 0.9: 3, 1.0: 3}
    # stage 2: improvements 1, 0, 1 with margin .5 -> exit targets ~0, ~1, ~0
    flat = torch.tensor([3.0, 2.0, 2.0, 1.0])[:, None]
    target = torch.tensor([0.0, 1.0, 0.0])[:, None]
    expected = torch.nn.functional.binary_cross_entropy_with_logits(gates[:-1], target)
    got = L.stage2_loss(flat, gates, margin=0.5)
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)


def test_tiny_end_to_end_run(tmp_path):
    out = tmp_path / "model"
    report = T.main(
        [
            *("--out", str(out), "--steps", "30", "--gate-steps", "5", "--device", "cpu"),
            *("--hidden-size", "32", "--layers", "2", "--heads", "4", "--vocab-size", "384"),
            *("--batch-size", "8", "--seq-len", "64", "--max-train-files", "4"),
            *("--eval-tokens", "2048", "--lr", "3e-3", "--log-every", "10"),
            *("--eval-every", "10", "--valid-tokens", "1024"),
        ]
    )
    stage1 = [h for h in report["history"] if h["stage"] == 1 and "loss" in h]
    assert stage1[-1]["loss"] < stage1[0]["loss"] - 0.3
    checked = {h["step"]: h["valid_loss"] for h in stage1 if "valid_loss" in h}
    assert sorted(checked) == [9, 19, 29]
    (selected,) = [h for h in report["history"] if "selected_step" in h]
    assert checked[selected["selected_step"]] == min(checked.values()) == selected["valid_loss"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "eval.json"):
        assert (out / name).is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["total_ut_steps"] == 4 and config["torch_dtype"] == "bfloat16"
    assert config["early_exit_threshold"] in (*T.THRESHOLDS, 1.0)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    ev = json.loads((out / "eval.json").read_text())["eval"]
    assert len(ev["ppl_per_loop"]) == 4
    assert set(ev["thresholds"]) == {str(q) for q in (*T.THRESHOLDS, 1.0)}
    for row in ev["thresholds"].values():
        assert sum(row["depth_histogram"]) == pytest.approx(1.0, abs=1e-3)
        assert 1.0 <= row["mean_depth"] <= 4.0

    loaded = load_model(out, device="cpu")
    assert loaded.tokenizer.token_to_id("<|im_start|>") == 1
    lm_head = loaded.model.lm_head.weight
    assert lm_head.dtype == torch.float32 and lm_head.shape == (384, 32)
    llm = LLM(str(out), device="cpu", num_kv_blocks=256, block_size=4, max_num_seqs=2)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate(["def f(x):", "import os"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
