"""Where the time of runs with lanes goes (docs/benchmarks/speculative.md §5): the packaged
model at its default exit threshold, concurrency 1, speculation off against d = 1, K = 4, two
warm-up rounds, then one round of each under the CUDA activity recorder: wall time, GPU busy
time, engine counters and GPU time per kernel name.

    python -m benchmarks.probes.lanes_profile > lanes-profile.txt
"""

from __future__ import annotations

import json
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


if __name__ == "__main__":
    main()
