"""Host time per engine step in one concurrent matrix cell, Split against WCPB.

The synchronous engine (`LLMEngine.step`) runs the cell's requests (all queued at once;
`max_num_seqs` admits 8 at a time, as the matrix's concurrency cap does) on the real model shape
with dummy weights. Every step's phases are timed: `schedule` (the scheduler's batch), `execute`
(the runner: metadata, uploads, graph replays or launches, the wait for gate logits an exit
decision needs), `advance` (the scheduler's loop bookkeeping) and `read` (the wait for sampled
tokens, the scheduler's stop checks and output processing: the previous step's tokens with async
scheduling, the engine's default; the first step reads none). A second run of each mode under
cProfile gives the time the host spent waiting for the GPU (`synchronize` calls) and the
functions with the most own time (cProfile slows Python code down, so its absolute times run
high).

    python -m benchmarks.probes.host_profile --chunk 128 --inputs fixed --out host.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.model_shapes import write_shape
from benchmarks.provenance import commit, engine_digest
from benchmarks.wcpb_matrix import (
    INPUTS,
    add_async_scheduling_flag,
    cell_config,
    release_device_memory,
)
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.workload import build_workload
from vllm_rlt.models.loader import load_model
from vllm_rlt.sampling_params import SamplingParams

PHASES = {"schedule": ("scheduler", "schedule"), "execute": ("runner", "execute"),
          "advance": ("scheduler", "_advance"), "read": ("scheduler", "_read_tokens")}  # fmt: skip


def _timed(fn, times: list[float]):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    return wrapper


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(loaded, args, mode: str, profiled: bool) -> dict:
    engine = LLMEngine(cell_config(args, args.chunk, mode), loaded)
    vocab = loaded.config.vocab_size
    wl = build_workload("concurrent", args.num_requests, INPUTS[args.inputs], 64, vocab, seed=0)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    with torch.inference_mode():
        engine.add_request("warm-up", wl.requests[0].prompt_token_ids[: args.chunk + 3], warm)
        engine.generate_all()
        _sync()
        for name, (owner, method) in PHASES.items():
            obj = engine if owner is None else getattr(engine, owner)
            setattr(obj, method, _timed(getattr(obj, method), times[name]))
        for i, spec in enumerate(wl.requests):
            engine.add_request(str(i), spec.prompt_token_ids, params)
        profile = cProfile.Profile() if profiled else None
        start = time.perf_counter()
        if profile:
            profile.enable()
        engine.generate_all()
        if profile:
            profile.disable()
        _sync()
        wall = time.perf_counter() - start
    out = {"mode": mode, "profiled": profiled, "wall_s": wall, "steps": len(times["execute"])}
    for name, values in times.items():
        v = np.asarray(values)
        out[name] = {"sum_s": float(v.sum()), "mean_ms": 1e3 * float(v.mean()),
                     "p50_ms": 1e3 * float(np.median(v))}  # fmt: skip
    if profile:
        stats = pstats.Stats(profile).stats
        own = sorted(
            ((v[2], f"{k[0]}:{k[1]}({k[2]})", v[1]) for k, v in stats.items()), reverse=True
        )
        out["gpu_wait_s"] = sum(v[2] for k, v in stats.items() if "synchronize" in k[2])
        out["top_own_time"] = [{"function": f, "calls": n, "own_s": t} for t, f, n in own[:25]]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--inputs", choices=list(INPUTS), default="fixed")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--modes", nargs="+", default=["split", "wcpb"])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--wcpb-cap", type=int, default=256, help="prefill rows beside decode rows")
    p.add_argument("--kv-cache-gb", type=float, default=40.0)
    add_async_scheduling_flag(p)
    args = p.parse_args(argv)
    path = write_shape(args.shape, tempfile.mkdtemp())
    loaded = load_model(path, dtype="bfloat16", load_format="dummy")
    runs = []
    for profiled in (False, True):
        for mode in args.modes:
            runs.append(run_mode(loaded, args, mode, profiled))
            release_device_memory()  # the timing wrappers tie the engine into a reference cycle
            brief = {k: runs[-1][k] for k in ("wall_s", "steps", "gpu_wait_s") if k in runs[-1]}
            print(mode, "profiled" if profiled else "timed", brief, flush=True)
    provenance = {"commit": commit(), "engine_sha256": engine_digest()}
    res = {"command": sys.argv, "args": vars(args), **provenance, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
