"""The per-depth diagnostic of batch invariance: one prompt's hidden states at every position and
depth, and its logits at every position, in atomic / split / WCPB prefill, alone and beside
another request, with and without `batch_invariant`.

    python -m benchmarks.probes.invariance --out invariance.json        # H200, ~1 minute

Ouro-1.4B shape, bf16, dummy weights; a 303-token prompt, chunk 64, budget 128 (the shape of the
original WCPB pull request's diagnostic). Each figure is the largest absolute difference from
atomic-alone at one depth (and for the logits); with batch_invariant every one must be 0
(tests/engine/test_wcpb.py asserts it on the GPU). Runs eagerly: the recorder hooks the eager
recurrent core.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from benchmarks.model_shapes import write_shape
from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.sampling_params import SamplingParams

MODES = {
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wcpb": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
}


class StateRecorder:
    """Records the output state of every (request, position, depth) row the runner computes."""

    def __init__(self, eng: LLMEngine):
        self.states: dict[tuple[str, int, int], torch.Tensor] = {}
        self.num_loops = eng.model.num_loops
        runner, model = eng.runner, eng.runner.model
        invoke, core = runner._invoke, model.recurrent_core

        def recording_invoke(batch, i):
            live = batch.live(i, model.num_loops)

            def recording_core(hidden, meta, kv):
                out, gate = core(hidden, meta, kv)
                row = 0
                for t, depth in live:
                    for j in range(t.num_tokens):
                        self.states[(t.request_id, t.token_start + j, depth)] = out[row + j]
                    row += t.num_tokens
                return out, gate

            model.recurrent_core = recording_core
            try:
                return invoke(batch, i)
            finally:
                del model.recurrent_core

        runner._invoke = recording_invoke

    def prompt_states(self, req_id: str, length: int) -> torch.Tensor:
        """[depth, position, hidden] of a prompt's rows."""
        return torch.stack([
            torch.stack([self.states[(req_id, p, d)] for p in range(length)])
            for d in range(self.num_loops)
        ])  # fmt: skip


def prompt_states(model_dir, prompt, other, mode, beside, batch_invariant, **kw):
    """(per-depth states [D, P, H], logits [P, V]) of `prompt` run in `mode`, alone or beside a
    request for `other`, after every loop."""
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=str(model_dir), load_format="dummy", enforce_eager=True,
        batch_invariant=batch_invariant, **MODES[mode], **kw,
    ))  # fmt: skip
    rec = StateRecorder(eng)
    eng.add_request("a", prompt, SamplingParams(max_tokens=1))
    if beside:
        eng.add_request("b", other, SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    states = rec.prompt_states("a", len(prompt))
    logits = eng.model.coda(states[-1])
    del eng
    return states, logits


CASES = tuple((mode, beside) for mode in MODES for beside in (False, True))


def diagnostic(
    model_dir, batch_invariant: bool, prompt, other, cases=CASES, **kw
) -> dict[str, list[float]]:
    """Largest |difference| from atomic-alone per depth, then for the logits, per (mode, beside)
    of `cases`."""
    base = prompt_states(model_dir, prompt, other, "atomic", False, batch_invariant, **kw)
    out = {}
    for mode, beside in cases:
        states, logits = prompt_states(model_dir, prompt, other, mode, beside,
                                       batch_invariant, **kw)  # fmt: skip
        diffs = [(s - b).abs().max().item() for s, b in zip(states, base[0], strict=True)]
        out[f"{mode}{' beside' if beside else ''}"] = diffs + [
            (logits - base[1]).abs().max().item()
        ]
    return out


def gpu_case() -> tuple[list[int], list[int], dict]:
    """The diagnostic's prompt, the other request's and the engine settings on the GPU."""
    rng = random.Random(303)
    prompt = rng.choices(range(1000, 40000), k=303)
    other = rng.choices(range(1000, 40000), k=150)
    settings = {
        "dtype": "bfloat16", "device": "cuda", "attention_backend": "auto",
        "prefill_chunk_size": 64, "max_num_batched_tokens": 128, "kv_cache_memory_gb": 4.0,
    }  # fmt: skip
    return prompt, other, settings


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape("ouro-1.4b", Path(tmp) / "ouro")
        prompt, other, settings = gpu_case()
        report = {
            "batch_invariant": diagnostic(model_dir, True, prompt, other, **settings),
            "default": diagnostic(model_dir, False, prompt, other, **settings),
        }
    for setting, rows in report.items():
        print(f"{setting}: max |diff| from atomic alone at depths 1-4, logits")
        for name, diffs in rows.items():
            print(f"  {name:14s} " + " ".join(f"{d:.4g}" for d in diffs))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
