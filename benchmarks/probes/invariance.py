"""The per-depth diagnostic of batch invariance: one prompt's hidden states at every position and
depth, and its logits at every position, in atomic / split / WCPB prefill, alone and beside
another request, with and without `batch_invariant`.

    python -m benchmarks.probes.invariance --out invariance.json        # H200, ~1 minute

Ouro-1.4B shape, bf16, dummy weights; a 303-token prompt, chunk 64, budget 128 (the shape of the
original WCPB pull request's diagnostic). Each figure is the largest absolute difference from
atomic-alone at one depth (and for the logits); with batch_invariant every one must be 0
(tests/engine/test_wcpb.py asserts it on the GPU). Runs eagerly.

    python -m benchmarks.probes.invariance --generation 303 2000 --out generation.json

Generation instead, with batch_invariant and CUDA graphs: 16 prompts of each length (`--prompts`),
16 greedy tokens (`--max-tokens`; `--exit-threshold` for gate exits), 8 requests at once in
atomic / split / WCPB (`--shape huginn-0125`: atomic and split) against one at a time; per mode
the requests whose tokens are identical, and for the others the first row (position, depth,
prompt or decode) whose state differs. The recorder sees every row through
`ModelRunner.observer`.

    python -m benchmarks.probes.invariance --generation 303 --features prefix_hits preemption \
        speculation --out features.json

With `--features`, each feature runs instead of the modes, 8 requests at once in split prefill
against one at a time without it: `prefix_hits` (the prompts run once before, so that every full
block of each is a prefix-cache hit), `preemption` (KV blocks for 3 of the prompts and one block
more, so that their output tokens preempt and recompute), `speculation` (2 drafts per window
after 1 loop, every window drafting: dummy weights' drafts are all rejected, which would turn
speculation off). Each reports the counter that shows it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
from pathlib import Path

import torch

from benchmarks.model_shapes import write_shape
from benchmarks.wcpb_matrix import release_device_memory
from vllm_rlt.config import EngineConfig
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.models import registry
from vllm_rlt.models.loader import read_config
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams

MODES = {
    "atomic": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wcpb": {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True},
}


class StateRecorder:
    """Records the output state of every (request, position, depth) row the runner computes,
    eager or replayed from a CUDA graph (through `ModelRunner.observer`), except the rows of
    device runs (decode rows whose depth per invocation the device decides)."""

    def __init__(self, eng: LLMEngine):
        self.states: dict[tuple[str, int, int], torch.Tensor] = {}
        self.num_loops = eng.model.num_loops
        runner = eng.runner
        invoke = runner._invoke

        def recording_invoke(batch, i, *args):
            live = batch.live(i, self.num_loops)
            # a device run's rows ride at the head (its `num_rows`, where the runner starts the
            # others), at depths only the device knows: not recorded
            run = args[0] if args else None
            riders = len(batch.decode_run.rows) if run is not None else 0
            first = run.num_rows if run is not None else 0

            def observe(out, gate):
                out, row = out.clone(), first  # a graph's outputs: overwritten by its next replay
                for t, depth in live[riders:]:
                    for j in range(t.num_tokens):
                        self.states[(t.request_id, t.token_start + j, depth)] = out[row + j]
                    row += t.num_tokens

            runner.observer = observe
            try:
                return invoke(batch, i, *args)
            finally:
                runner.observer = None

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
        model=str(model_dir), enforce_eager=True,
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
    """The diagnostic's prompt, the other request's and the engine settings on the GPU (dummy
    weights)."""
    rng = random.Random(303)
    prompt = rng.choices(range(1000, 40000), k=303)
    other = rng.choices(range(1000, 40000), k=150)
    settings = {
        "dtype": "bfloat16", "device": "cuda", "attention_backend": "auto", "load_format": "dummy",
        "prefill_chunk_size": 64, "max_num_batched_tokens": 128, "kv_cache_memory_gb": 4.0,
    }  # fmt: skip
    return prompt, other, settings


def generate(model_dir, prompts, mode, concurrency, max_tokens, threshold=None, feature=None,
             **kw):  # fmt: skip
    """(tokens per request, the recorder, the feature's counter or None) of greedy generation of
    `prompts` in `mode`, at most `concurrency` at once (CUDA graphs as configured), at exit
    threshold `threshold` (None: the model's), with `feature` (FEATURES) on."""
    settings, warm, counter = FEATURES[feature] if feature else (lambda *_: {}, False, None)
    if threshold is not None:  # the engine's too: speculation with the gate runs lanes
        kw = {**kw, "exit_threshold": threshold}
    kw = {**kw, **settings(model_dir, prompts, max_tokens, kw.get("block_size", 16))}
    config = EngineConfig.from_kwargs(
        model=str(model_dir), batch_invariant=True,
        max_num_seqs=concurrency, **MODES[mode], **kw,
    )  # fmt: skip
    with _every_window_drafts(feature == "speculation"):
        eng = LLMEngine(config)
        rec = StateRecorder(eng)
        tokens = {}
        for prefix in ("w", "r") if warm else ("r",):
            for i, prompt in enumerate(prompts):
                # the seed: Huginn's initial state (the same in every mode)
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                        exit_threshold=threshold, seed=i)  # fmt: skip
                eng.add_request(f"{prefix}{i}", prompt, params)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
    shown = counter(eng) if counter else None
    del eng
    release_device_memory()  # the recorder's hook ties the engine in a cycle
    return tokens, rec, shown


def _kv_for_three(model_dir, prompts, max_tokens, block_size: int) -> dict:
    """KV blocks (in every plane) for the longest prompt 3 times and one block more: 3 such
    requests are admitted, and their output tokens preempt one (when they need a block more
    each)."""
    config = read_config(model_dir)
    with torch.device("meta"):  # (the model's shape, no weights)
        model = registry.resolve(config.model_type)[1](config)
    planes = model.num_loops + model.num_edge_planes
    blocks = -(-max(map(len, prompts)) // block_size)
    return {"num_kv_blocks": planes * (3 * blocks + 1)}


# each feature: (its engine settings from the model, the prompts, max_tokens and the block size,
# whether the prompts run once before, the counter that shows it ran)
FEATURES = {
    "prefix_hits": (lambda *_: {}, True, lambda e: e.scheduler.prefix_hits),
    "preemption": (_kv_for_three, False, lambda e: e.scheduler.num_preemptions),
    "speculation": (
        lambda *_: {"num_speculative_tokens": 2, "speculative_draft_loops": 1,
                    "speculative_fallback": False},
        False, lambda e: e.stats_dict()["spec_draft_tokens"],
    ),
}  # fmt: skip


@contextlib.contextmanager
def _every_window_drafts(on: bool):
    """Speculation's planner takes every draft to be accepted while `on`."""
    if not on:
        yield
        return
    acceptance = SpecPlanner.acceptance
    SpecPlanner.acceptance = lambda self: 1.0
    try:
        yield
    finally:
        SpecPlanner.acceptance = acceptance


def first_difference(rec, base, req_id: str, num_prompt: int) -> dict | None:
    """The first (position, depth) row of `req_id` whose state differs from `base`'s, with the
    row's kind and the largest |difference| there (None: every row the two share is the same)."""
    keys = sorted(k for k in rec.states if k[0] == req_id and k in base.states)
    ours = torch.stack([rec.states[k] for k in keys]).float()
    theirs = torch.stack([base.states[k] for k in keys]).float()
    diffs = (ours - theirs).abs().amax(-1)
    differing = diffs.nonzero()
    if not len(differing):
        return None
    i = int(differing[0])
    kind = "prompt" if keys[i][1] < num_prompt else "decode"
    return {
        "position": keys[i][1],
        "depth": keys[i][2],
        "kind": kind,
        "max_abs_diff": diffs[i].item(),
        "differing_rows": len(differing),
        "rows": len(keys),
    }


def generation_diagnostic(
    model_dir, prompts, concurrency: int, max_tokens: int, threshold=None, modes=tuple(MODES),
    features=(), **kw,
) -> dict:  # fmt: skip
    """Greedy generation with `batch_invariant`, `concurrency` requests at once in each of
    `modes` (and in split prefill with each of `features`) against one at a time (atomic):
    identical requests, and where each differing request's rows first differ."""
    base_tokens, base, _ = generate(model_dir, prompts, "atomic", 1, max_tokens, threshold, **kw)
    report = {}
    runs = [(mode, mode, None) for mode in modes] + [(f, "split", f) for f in features]
    for name, mode, feature in runs:
        tokens, rec, shown = generate(
            model_dir, prompts, mode, concurrency, max_tokens, threshold, feature, **kw
        )
        ids = [f"r{i}" for i in range(len(prompts))]
        same = [r for r in ids if tokens[r] == base_tokens[r]]
        report[name] = {
            "identical_requests": len(same),
            "requests": len(ids),
            "first_differences": {
                r: first_difference(rec, base, r, len(prompts[int(r[1:])])) for r in ids
            },
        }
        if feature:
            report[name]["exercised"] = shown
    return report


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--generation", type=int, nargs="*", metavar="LEN",
                   help="instead: greedy generation of prompts of each length (8 at once "
                   "against one at a time) with batch_invariant")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16, help="generation: tokens per request")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="generation: the requests' exit threshold (default: the shape's, 1.0: "
                   "fixed depth)")  # fmt: skip
    p.add_argument("--shape", default="ouro-1.4b", choices=["ouro-1.4b", "huginn-0125", "packaged"],
                   help="generation: the model shape with dummy weights (Huginn: atomic and "
                   "split modes, whose prefill is atomic), or the packaged model")  # fmt: skip
    p.add_argument("--prompts", type=int, default=16, help="generation: prompts per length")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's (fp8: e4m3)")
    p.add_argument("--features", nargs="*", default=[], choices=list(FEATURES),
                   help="generation: run these features instead of the modes")  # fmt: skip
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        packaged = args.shape == "packaged"
        model_dir = default_model_dir() if packaged else write_shape(args.shape, Path(tmp) / "m")
        prompt, other, settings = gpu_case()
        settings["kv_cache_dtype"] = args.kv_cache_dtype
        if packaged:  # its own weights
            settings["load_format"] = "auto"
        if args.generation:
            return _report_generation(model_dir, args, settings)
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


def _report_generation(model_dir, args, settings) -> dict:
    report = {}
    for length in args.generation:
        rng = random.Random(length)
        vocab = min(40000, read_config(model_dir).vocab_size)
        prompts = [rng.choices(range(1000, vocab), k=length) for _ in range(args.prompts)]
        # 8 requests of up to 2,016 positions x 4 planes
        kw = {**settings, "kv_cache_memory_gb": 16.0}
        modes = ("atomic", "split") if args.shape.startswith("huginn") else tuple(MODES)
        report[str(length)] = generation_diagnostic(
            model_dir, prompts, 8, args.max_tokens, args.exit_threshold,
            () if args.features else modes, args.features, **kw,
        )  # fmt: skip
        for mode, r in report[str(length)].items():
            firsts = [f for f in r["first_differences"].values() if f]
            print(f"{length} tokens, {mode}: {r['identical_requests']}/{r['requests']} identical;"
                  f" first differing rows: {firsts[:4]}; ran: {r.get('exercised')}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
