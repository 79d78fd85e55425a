"""Where the time of runs with lanes goes (docs/benchmarks/speculative.md §5): the packaged
model at its default exit threshold, concurrency 1, speculation off against d = 1, K = 4, two
warm-up rounds, then one round of each under the CUDA activity recorder: wall time, GPU busy
time, engine counters and GPU time per kernel name. With `--host`, the round runs under cProfile
instead: wall time per step and the functions with the most own and cumulative time (cProfile
slows Python code down, so compare the two settings, not absolute times).

    python -m benchmarks.probes.lanes_profile > lanes-profile.txt
    python -m benchmarks.probes.lanes_profile --host > lanes-host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks.speculative import make_engines, stdlib_prompts, timed_run
from vllm_rlt.entrypoints.bench.metrics import device_time_by_name, gpu_busy_seconds
from vllm_rlt.models.tiny import default_model_dir

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 2, 512, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", action="store_true", help="cProfile instead of the CUDA recorder")
    host = p.parse_args().host
    args = types.SimpleNamespace(dtype="bfloat16", exit_threshold=0.6, kv_cache_gb=8.0,
                                 async_scheduling=True, draft_loops=[1], drafts=[4])  # fmt: skip
    engines = make_engines(args, str(default_model_dir()), "auto", 1)
    tokenizer = next(iter(engines.values())).tokenizer
    for seed in range(2):  # compiles and captures
        prompts = stdlib_prompts(tokenizer, REQUESTS, PROMPT_LEN, seed=seed)
        for engine in engines.values():
            timed_run(engine, prompts, OUTPUT_LEN)
    prompts = stdlib_prompts(tokenizer, REQUESTS, PROMPT_LEN, seed=9)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for key, engine in engines.items():
        if host:
            host_profile(key, engine, prompts)
            continue
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            start = time.perf_counter()
            result = timed_run(engine, prompts, OUTPUT_LEN)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        counters = {k: result["engine"][k] for k in ("steps", "invocations", "generated_tokens")}
        print("== (d, K)", key, "wall", round(wall, 4), "busy", round(gpu_busy_seconds(events), 4),
              "tok/s", round(result["summary"]["output_token_throughput"]), counters)  # fmt: skip
        for name, us, count in device_time_by_name(events)[:22]:
            print(f"{us:9.0f} {count:6d} {name}")


def host_profile(key, engine, prompts) -> None:
    """One round under cProfile: wall time per step, then the engine's functions by own time
    and by cumulative time."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    prof.enable()
    result = timed_run(engine, prompts, OUTPUT_LEN)
    torch.cuda.synchronize()
    prof.disable()
    wall, steps = time.perf_counter() - start, result["engine"]["steps"]
    print("== (d, K)", key, "wall", round(wall, 4), "steps", steps, "invocations",
          result["engine"]["invocations"], "ms per step", round(wall / steps * 1e3, 3))  # fmt: skip
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(30)
        print(out.getvalue().split("filename:lineno(function)")[-1].rstrip())


if __name__ == "__main__":
    main()
