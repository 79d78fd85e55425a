"""Where a device run's time goes (docs/design/runner.md §7): the Ouro-1.4B shape with dummy
weights, c requests at once with gate exits (threshold 0.6) or trace exits, warmed up, then one
round under the CUDA activity recorder: wall time, GPU busy fraction, idle time in gaps longer
than 100 us (the host between launches), GPU time of torch's own kernels (the runs' bookkeeping)
and per kernel name. With `--phases`, the host's phases (the plan, the queueing, the wait for a
run's read-back, applying and emitting its tokens) are timed and marked in the trace, the GPU's
idle gaps are attributed to the innermost phase the host was in meanwhile, and the runs are counted:
alone, carried, beside prefill. With `--decode-only`, c requests (one per seat) run their prompts
unprofiled and only their decode is profiled, so that fixed depth (`--threshold 1`) and exits
compare in GPU time per invocation and per token, with no prefill or admission in the round.

    python -m benchmarks.probes.device_runs --concurrency 1 8 --out device-runs-profile.json
  python -m benchmarks.probes.device_runs --decode-only --threshold 1 --concurrency 32 --out f.json
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.model_shapes import write_shape
from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import (
    device_events,
    device_time_by_name,
    engine_counters,
    gpu_busy_seconds,
)
from vllm_rlt.entrypoints.bench.throughput import run_requests
from vllm_rlt.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--exit-mode", choices=("ouro", "trace"), default="ouro")
    p.add_argument("--device-loops", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.6)
    p.add_argument("--min-loops", type=int, default=None)
    p.add_argument("--phases", action="store_true", help="also time the host's phases")
    p.add_argument("--decode-only", action="store_true", help="profile c requests' decode alone")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--trace-dir", help="keep each concurrency's Chrome trace (gzipped) here")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = {str(c): profile(args, c) for c in args.concurrency}
    Path(args.out).write_text(json.dumps({"args": vars(args), "by_concurrency": results}, indent=2))


def profile(args, c: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(EngineConfig.from_kwargs(
            model=str(write_shape("ouro-1.4b", tmp)), load_format="dummy", dtype="bfloat16",
            max_num_seqs=c, max_num_batched_tokens=2048, prefill_chunk_size=512,
            kv_cache_memory_gb=16.0, device_decode_loops=args.device_loops,
            exit_mode=args.exit_mode, trace_seed=0 if args.exit_mode == "trace" else None,
        ))  # fmt: skip
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    params = {"exit_threshold": args.threshold, "min_loops": args.min_loops}
    if args.exit_mode == "trace":
        params = {}
    for _ in range(3):  # every row count's graphs captured
        prompts = [rng.integers(0, vocab, 512).tolist() for _ in range(2 * c)]
        run_requests(engine, prompts, args.output_len, **params)
    num = c if args.decode_only else 2 * c
    prompts = [rng.integers(0, vocab, 512).tolist() for _ in range(num)]
    if args.decode_only:
        submit_and_prefill(engine, prompts, args.output_len, params)
    before = engine.stats_dict()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    steps = engine.stats.steps
    torch.cuda.synchronize()
    phased = phases(engine) if args.phases else {}
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        if args.decode_only:
            while engine.has_unfinished_requests():
                engine.step()
            wall = time.perf_counter() - start
        else:
            _, wall = run_requests(engine, prompts, args.output_len, **params)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    prof.export_chrome_trace(str(trace))
    if args.trace_dir:
        Path(args.trace_dir, f"trace-c{c}.json.gz").write_bytes(gzip.compress(trace.read_bytes()))
    events = json.loads(trace.read_text())["traceEvents"]
    steps = engine.stats.steps - steps
    by_name = device_time_by_name(events)
    counters = engine_counters(before, engine.stats_dict(), len(prompts))
    busy = gpu_busy_seconds(events)
    tokens = counters["generated_tokens"]
    result = {
        "wall_s": total,
        "output_tok_s": tokens / wall,
        "steps": steps,
        "invocations": counters["invocations"],
        "rows_per_invocation": counters["rows_per_invocation"],
        "loops_per_token": counters["loops_per_token"],
        "gpu_busy_fraction": busy / total,
        "gpu_us_per_invocation": busy * 1e6 / max(counters["invocations"], 1),
        "gpu_us_per_token": busy * 1e6 / max(tokens, 1),
        "host_gap_s": idle_seconds(events, 100.0),
        "torch_kernel_s": sum(us for name, us, _ in by_name if " at::" in name) / 1e6,
        "torch_kernel_launches": sum(n for name, _, n in by_name if " at::" in name),
        "gpu_us_by_name": [(name, round(us, 1), count) for name, us, count in by_name[:25]],
    }
    if args.phases:
        result["phases"] = {**phased, "gap_s_by_phase": gaps_by_phase(events, 20.0)}
    print(c, {k: v for k, v in result.items() if k != "gpu_us_by_name"})
    for row in result["gpu_us_by_name"]:
        print(row)
    return result


def submit_and_prefill(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                       params: dict) -> None:  # fmt: skip
    """Submit `prompts` and step until every one has its first token (its prompt run)."""
    sampling = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, **params)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"decode-only-{time.perf_counter_ns()}-{i}", prompt, sampling)
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}


def phases(engine: LLMEngine) -> dict:
    """Wraps the engine's collaborators to time the host's phases (seconds, filled in as the
    round runs) and mark them in the trace (`rlt.<phase>`), and counts the runs planned by
    kind."""
    spent: dict[str, float] = {}
    runs = {"alone": 0, "carried": 0, "beside_prefill": 0}

    def timed(label: str, fn, after=None):
        def wrapper(*a, **k):
            start = time.perf_counter()
            with torch.profiler.record_function(f"rlt.{label}"):
                out = fn(*a, **k)
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
            if after is not None:
                after(out)
            return out

        return wrapper

    def count(batch) -> None:
        run = None if batch is None else batch.decode_run
        if run is not None:
            kind = "carried" if run.carried else "alone"
            runs["beside_prefill" if len(batch.requests) > len(run.rows) else kind] += 1

    def wait_timed(launched) -> None:
        if launched.read_run is not None:
            object.__setattr__(launched, "read_run", timed("run_read_back", launched.read_run))

    s, e = engine.scheduler, engine
    s.schedule = timed("schedule", s.schedule, count)
    e.runner.execute = timed("execute", e.runner.execute, wait_timed)
    r = e.runner
    r._sync_mirrors = timed("execute.mirrors", r._sync_mirrors)
    r._invoke = timed("execute.invoke", r._invoke)
    r.runs.state.load = timed("execute.run_load", r.runs.state.load)
    r.runs._sample = timed("execute.run_sample", r.runs._sample)
    s._apply_run = timed("apply_run", s._apply_run)
    s._apply_tokens = timed("apply_tokens", s._apply_tokens)
    e._emit = timed("emit", e._emit)
    e.step = timed("step", e.step)
    return {"host_s": spent, "runs": runs}


def gaps_by_phase(events: list[dict], longer_than_us: float) -> dict[str, float]:
    """Seconds of the GPU's idle gaps longer than `longer_than_us`, by the innermost host phase
    marked by `phases` at each moment of them (sampled every 10 us)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in device_events(events))
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start - end > longer_than_us:
            gaps.append((end, start))
        end = max(end, stop)
    marks = sorted(
        (e for e in events if e.get("name", "").startswith("rlt.") and "dur" in e),
        key=lambda e: e["ts"],
    )
    starts = [m["ts"] for m in marks]
    out: dict[str, float] = {}
    for g0, g1 in gaps:
        n = max(1, int((g1 - g0) // 10))
        for k in range(n):
            t = g0 + (k + 0.5) * (g1 - g0) / n
            around = marks[
                max(0, bisect.bisect_right(starts, t) - 64) : bisect.bisect_right(starts, t)
            ]
            inside = [m for m in around if m["ts"] + m["dur"] > t]
            name = min(inside, key=lambda m: m["dur"])["name"][4:] if inside else "none"
            out[name] = out.get(name, 0.0) + (g1 - g0) / n / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def idle_seconds(events: list[dict], longer_than_us: float) -> float:
    """GPU idle time in gaps longer than `longer_than_us` between activities."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in device_events(events))
    idle, end = 0.0, spans[0][1]
    for start, stop in spans[1:]:
        if start - end > longer_than_us:
            idle += start - end
        end = max(end, stop)
    return idle / 1e6


if __name__ == "__main__":
    main()
