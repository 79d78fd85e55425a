"""The trained tiny Ouro shipped as package data: its files and card, and the engine on it (CPU,
fp32): greedy output equals the dense reference, the three prefill modes agree exactly, and the
exit gate uses more than one depth."""

from __future__ import annotations

import json

import pytest

from tests.engine.harness import make_engine, reference_greedy
from tools import eval_tiny_ouro
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams

MAX_PACKAGE_BYTES = 25_000_000


def test_package_data_holds_the_model_and_its_card():
    model_dir = default_model_dir()
    names = {p.name for p in model_dir.iterdir()}
    want = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert want | {"README.md", "eval.json"} <= names
    assert sum(p.stat().st_size for p in model_dir.iterdir()) <= MAX_PACKAGE_BYTES
    report = json.loads((model_dir / "eval.json").read_text())
    ppl = report["eval"]["ppl_per_loop"]
    assert len(ppl) == 4 and all(a > b for a, b in zip(ppl, ppl[1:], strict=False)), ppl
    config = json.loads((model_dir / "config.json").read_text())
    assert config["early_exit_threshold"] == report["eval"]["recommended_threshold"]
    card = (model_dir / "README.md").read_text()
    assert "| ppl | " + " | ".join(f"{v:.2f}" for v in ppl) in card
    assert "## Engine evaluation" in card


@pytest.fixture(scope="module")
def llms():
    """One fp32 CPU engine per prefill mode on the packaged model (small chunks)."""
    return {
        name: LLM(
            device="cpu",
            dtype="float32",
            max_num_seqs=8,
            prefill_chunk_size=8,
            max_num_batched_tokens=48,
            **settings,
        )
        for name, settings in eval_tiny_ouro.MODES.items()
    }


def test_llm_without_a_model_loads_the_packaged_one(llms):
    engine = llms["split"].engine
    assert engine.config.model.model is None
    assert engine.model.config.early_exit_threshold == 0.6
    out = llms["split"].generate("def fibonacci(n):", SamplingParams(max_tokens=8), use_tqdm=False)
    assert out[0].outputs[0].text.strip()


def test_modes_agree_exactly_and_the_gate_uses_two_depths(llms):
    tokenizer = llms["atomic"].engine.tokenizer
    prompts = eval_tiny_ouro.held_out_prompts(tokenizer, 8)
    results = {
        name: eval_tiny_ouro.run_mode(llm, prompts, threshold=0.6, max_tokens=24)
        for name, llm in llms.items()
    }
    assert results["atomic"] == results["split"] == results["wavefront"]
    agreement = eval_tiny_ouro.compare(results["atomic"], results["wavefront"])
    assert agreement["identical_requests"] == len(prompts)
    histogram = eval_tiny_ouro.depth_histogram(results["wavefront"], 4)
    assert sum(share >= 0.1 for share in histogram) >= 2, histogram


@pytest.mark.parametrize("threshold", [0.6, 1.0])
def test_greedy_equals_dense_reference(threshold):
    engine = make_engine(default_model_dir(), prefill_chunk_size=5, max_num_batched_tokens=16)
    prompt = engine.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n").ids
    params = SamplingParams(max_tokens=12, temperature=0, exit_threshold=threshold, ignore_eos=True)
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = (tuple(out.outputs[0].token_ids), tuple(out.outputs[0].exit_depths))
    assert got == reference_greedy(engine.model, prompt, 12, threshold, "last_exited")
    if threshold < 1:
        assert len(set(got[1])) > 1, "the gate never varied the depth"
