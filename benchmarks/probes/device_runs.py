"""Where a device run's time goes (docs/design/runner.md §7): the Ouro-1.4B shape with dummy
weights, c requests at once with gate exits (threshold 0.6) or trace exits, warmed up, then one
round under the CUDA activity recorder: wall time, GPU busy fraction, idle time in gaps longer
than 100 us (the host between launches), GPU time of torch's own kernels (the runs' bookkeeping)
and per kernel name.

    python -m benchmarks.probes.device_runs --concurrency 1 8 --out device-runs-profile.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.model_shapes import write_shape
from vllm_rlt.benchmarks.metrics import device_events, device_time_by_name, gpu_busy_seconds
from vllm_rlt.benchmarks.throughput import run_requests
from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8])
    p.add_argument("--exit-mode", choices=("ouro", "trace"), default="ouro")
    p.add_argument("--device-loops", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.6)
    p.add_argument("--min-loops", type=int, default=None)
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
        run_requests(engine, prompts, 64, **params)
    prompts = [rng.integers(0, vocab, 512).tolist() for _ in range(2 * c)]
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    steps = engine.stats.steps
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        start = time.perf_counter()
        _, wall = run_requests(engine, prompts, 64, **params)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    steps = engine.stats.steps - steps
    by_name = device_time_by_name(events)
    result = {
        "wall_s": total,
        "output_tok_s": len(prompts) * 64 / wall,
        "steps": steps,
        "gpu_busy_fraction": gpu_busy_seconds(events) / total,
        "host_gap_s": idle_seconds(events, 100.0),
        "torch_kernel_s": sum(us for name, us, _ in by_name if " at::" in name) / 1e6,
        "torch_kernel_launches": sum(n for name, _, n in by_name if " at::" in name),
        "gpu_us_by_name": [(name, round(us, 1), count) for name, us, count in by_name[:25]],
    }
    print(c, {k: v for k, v in result.items() if k != "gpu_us_by_name"})
    for row in result["gpu_us_by_name"]:
        print(row)
    return result


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
