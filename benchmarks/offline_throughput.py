"""Offline throughput of the engine on a real model shape with dummy weights.

For each concurrency c: 2c requests of `--prompt-len` random token ids and `--output-len`
forced outputs (ignore EOS, fixed depth) are submitted at once to an engine with
max_num_seqs = c. Reports request/token throughput, TTFT/TPOT percentiles, and - from a profiled
window of decode steps of c more requests, once their prompts are done - host time vs GPU time
per step, the GPU busy fraction and GPU time per kernel name. (`vllm-rlt bench throughput` is
the installed package's offline throughput on any model, without the profiled window.)

    python -m benchmarks.offline_throughput --concurrency 1 8 32 --out results.json
    python -m benchmarks.offline_throughput --concurrency 1 8 32 --enforce-eager --out eager.json
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
from benchmarks.provenance import run_meta
from benchmarks.wcpb_matrix import add_async_scheduling_flag
from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import device_time_by_name, gpu_busy_seconds, summarize
from vllm_rlt.entrypoints.bench.throughput import run_requests
from vllm_rlt.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(args, concurrency: int, model_dir: Path) -> dict:
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            load_format="dummy",
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            layer_kernels=args.layer_kernels,
            max_num_seqs=concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=args.chunk_size,
            scheduling_mode=args.scheduling_mode,
            exit_threshold=1.0,
            kv_cache_memory_gb=args.kv_cache_gb,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
        )
    )
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    make = lambda n: [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(n)]  # noqa: E731
    # warm-up: the timed workload once, so that every kernel specialisation it meets (Triton
    # compiles one per row count class) is compiled before the clock starts
    run_requests(engine, make(2 * concurrency), args.output_len)
    _sync()
    prompts = make(2 * concurrency)
    records, wall = run_requests(engine, prompts, args.output_len)
    summary = summarize(records, wall)
    steps_before = engine.stats.steps
    # profiled window: `--profile-steps` decode steps of `concurrency` fresh requests, from
    # their first token on (prefill done); host time per step vs GPU time
    step_times: list[float] = []
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(make(concurrency)):
        engine.add_request(f"prof-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < concurrency:
        started.update(o.request_id for o in engine.step())
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        _sync()
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                t0 = time.perf_counter()
                engine.step()
                step_times.append(time.perf_counter() - t0)
            _sync()
            prof_wall = time.perf_counter() - start
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        gpu = gpu_busy_seconds(events)
    for i in range(concurrency):
        engine.abort_request(f"prof-{i}")
    n_out = len(prompts) * args.output_len
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "wall_s": wall,
        "request_throughput": len(prompts) / wall,
        "output_tok_s": n_out / wall,
        "total_tok_s": len(prompts) * (args.prompt_len + args.output_len) / wall,
        "ttft_s": summary["ttft_s"],
        "tpot_s": summary["tpot_s"],
        "decode_tok_s_per_request": 1.0 / summary["tpot_s"]["p50"],
        "profiled": {
            "wall_s": prof_wall,
            "steps": len(step_times),
            "host_ms_per_step": 1e3 * float(np.mean(step_times)),
            "gpu_ms_per_step": 1e3 * gpu / len(step_times),
            "gpu_busy_fraction": gpu / prof_wall,
            "gpu_us_per_step_by_name": [
                (name, round(us / len(step_times), 1), count / len(step_times))
                for name, us, count in device_time_by_name(events)[:15]
            ],
        },
        "engine_stats": {**engine.stats.as_dict(), "steps_timed_run": steps_before},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--layer-kernels", default="auto", help="the model's LayerKernels strategy")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--scheduling-mode", default="mixed")
    p.add_argument("--kv-cache-gb", type=float, default=40.0)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    p.add_argument("--profile-steps", type=int, default=40)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the eager runner)")
    add_async_scheduling_flag(p)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape(args.shape, tmp)
        results = [bench(args, c, model_dir) for c in args.concurrency]
    meta = run_meta(args)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    for r in results:
        prof = r["profiled"]
        print(
            f"c={r['concurrency']:>3} out tok/s {r['output_tok_s']:9.1f}  req/s "
            f"{r['request_throughput']:.3f}  TTFT p50 {r['ttft_s']['p50'] * 1e3:8.1f} ms  TPOT p50 "
            f"{r['tpot_s']['p50'] * 1e3:7.2f} ms  host/step {prof['host_ms_per_step']:.2f} ms  "
            f"gpu/step {prof['gpu_ms_per_step']:.2f} ms  busy {prof['gpu_busy_fraction']:.2f}"
        )


if __name__ == "__main__":
    main()
