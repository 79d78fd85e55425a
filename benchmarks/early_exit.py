"""Early exit at full speed: offline throughput of a model shape with dummy weights (default
Ouro-1.4B) under each exit configuration, with decode rows deciding their exits on the host
after every loop (`device_decode_loops` 0) and in device runs (docs/design/runner.md §7).

For each concurrency c: 2c requests of `--prompt-len` random token ids and `--output-len`
forced outputs submitted at once to an engine of max_num_seqs = c (budget 2,048, chunk
`--chunk-size` (512), mixed scheduling (`--wavefront-chunked-prefill`: WCPB), CUDA graphs, async
scheduling, no prefix caching: the configurations that share an engine run the same prompts).
Exit configurations (`--configs`; fixed depth always runs, on the host path):

- `fixed`: exit threshold 1 (every token runs every loop; device runs never start);
- `gate-full`: threshold `--threshold` and min_loops = the depth: every gate is read, every
  token still runs every loop;
- `gate`: threshold `--threshold` (dummy weights: random gates);
- `trace`: exit_mode trace, each token's loops drawn in [1, depth] from `--trace-seed`.

Engines (one per exit mode and path, sharing the weights, warmed up on the timed workload
first) run every configuration in turn, `--repeats` interleaved rounds; reports the median
output tokens/s, loops per token and exit efficiency E = (tok/s / fixed tok/s) / (depth /
loops per token); and, from a round of the same prompts with one output token each (their
prefill alone), decode tok/s (the tokens after the first over the wall time beyond that
round's) and its E.

    python -m benchmarks.early_exit --concurrency 1 8 32 --out early-exit.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.model_shapes import write_shape
from benchmarks.provenance import run_meta
from benchmarks.wcpb_matrix import release_device_memory
from vllm_rlt.config import EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import engine_counters
from vllm_rlt.entrypoints.bench.throughput import run_requests
from vllm_rlt.models.loader import load_model

# configuration -> (exit mode, per-request sampling settings given the threshold and depth)
CONFIGS = {
    "fixed": ("ouro", lambda t, d: {"exit_threshold": 1.0}),
    "gate-full": ("ouro", lambda t, d: {"exit_threshold": t, "min_loops": d}),
    "gate": ("ouro", lambda t, d: {"exit_threshold": t}),
    "trace": ("trace", lambda t, d: {}),
}
PATHS = {"host": 0, "device": None}  # device_decode_loops (None: --device-loops)


def cells(args) -> list[tuple[str, str]]:
    """(configuration, path) of the runs: `--configs` x `--paths`, and fixed depth on the host
    path, the yardstick (its device path is the same engine work: no run starts)."""
    chosen = [(name, path) for name in args.configs for path in args.paths]
    return [("fixed", "host")] + [c for c in chosen if c[0] != "fixed"]


def make_engines(args, model_dir: Path, concurrency: int) -> dict[tuple[str, str], LLMEngine]:
    """(exit mode, path) -> an engine for each of the runs' (and fixed depth's), all on one
    set of weights."""
    loaded = load_model(model_dir, dtype=args.dtype, load_format="dummy")
    engines = {}
    for mode, path in dict.fromkeys((CONFIGS[name][0], path) for name, path in cells(args)):
        loops = PATHS[path]
        config = EngineConfig.from_kwargs(
            model=str(model_dir), load_format="dummy", dtype=args.dtype,
            max_num_seqs=concurrency, max_num_batched_tokens=2048,
            prefill_chunk_size=args.chunk_size,
            wavefront_chunked_prefill=args.wavefront_chunked_prefill,
            kv_cache_memory_gb=args.kv_cache_gb, exit_mode=mode, trace_seed=args.trace_seed,
            enable_prefix_caching=False,  # configurations sharing an engine share prompts
            device_decode_loops=args.device_loops if loops is None else loops,
        )  # fmt: skip
        engines[mode, path] = LLMEngine(config, loaded)
    return engines


def bench(args, model_dir: Path, concurrency: int) -> list[dict]:
    engines = make_engines(args, model_dir, concurrency)
    depth = next(iter(engines.values())).num_loops
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = np.random.default_rng(0)
    runs: dict[tuple[str, str], list[dict]] = {cell: [] for cell in cells(args)}
    prefill_walls = []  # the prompts alone: fixed depth, one output token each
    for rep in range(args.repeats + 1):  # round 0 warms up (compiles, captures)
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(2 * concurrency)]
        _, wall = run_requests(engines["ouro", "host"], prompts, 1, exit_threshold=1.0)
        prefill_walls += [wall] if rep else []
        for name, path in runs:
            mode, params = CONFIGS[name]
            engine = engines[mode, path]
            before = engine.stats_dict()
            records, wall = run_requests(
                engine, prompts, args.output_len, **params(args.threshold, depth)
            )
            counters = engine_counters(before, engine.stats_dict(), len(prompts))
            tok_s = len(prompts) * args.output_len / wall
            print(
                f"c={concurrency} round {rep} {name:9} {path:6} {tok_s:9.1f} tok/s  loops/token "
                f"{counters['loops_per_token']:.2f}  steps {counters['steps']}",
                flush=True,
            )
            if rep:
                runs[name, path].append({"output_tok_s": tok_s, "wall_s": wall, "engine": counters})
    del engines
    release_device_memory()
    fixed = statistics.median(r["output_tok_s"] for r in runs["fixed", "host"])
    prefill = statistics.median(prefill_walls)
    # decode tok/s: the tokens after the first over the wall time beyond the prompts' own
    decode = {
        cell: statistics.median(
            len(prompts) * (args.output_len - 1) / (r["wall_s"] - prefill) for r in rs
        )
        for cell, rs in runs.items()
    }
    out = []
    for (name, path), rs in runs.items():
        tok_s = statistics.median(r["output_tok_s"] for r in rs)
        loops = statistics.median(r["engine"]["loops_per_token"] for r in rs)
        dec = decode[name, path] / decode["fixed", "host"]
        row = {
            "concurrency": concurrency, "config": name, "path": path, "output_tok_s": tok_s,
            "vs_fixed": tok_s / fixed, "loops_per_token": loops,
            "exit_efficiency": tok_s / fixed / (depth / loops), "prefill_wall_s": prefill,
            "decode_tok_s": decode[name, path], "decode_exit_efficiency": dec / (depth / loops),
            "runs": rs,
        }  # fmt: skip
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if k != "runs"})  # fmt: skip
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threshold", type=float, default=0.6, help="exit threshold of gate configs")
    p.add_argument("--trace-seed", type=int, default=1)
    p.add_argument("--device-loops", type=int, default=16, help="device_decode_loops of runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gb", type=float, default=16.0, help="per engine (4 engines)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--wavefront-chunked-prefill", action="store_true", help="WCPB (mixed)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    meta = run_meta(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape(args.shape, tmp)
        for c in args.concurrency:  # (written after each concurrency)
            results += bench(args, model_dir, c)
            Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
