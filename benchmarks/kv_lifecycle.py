"""The KV-cache lifecycle on a real model shape: issue #27's GPU acceptance items.

One loaded model (Ouro-1.4B shape, dummy bf16 weights) serves every engine: fixed depth 4
(exit_threshold 1.0), forced outputs (ignore EOS), WCPB chunk 32, budget 1024, async scheduling.
Each engine runs a warm-up (max_num_seqs requests of the scenario's shape, 16 outputs), then the
measured run, whose counters are its own. Prompts are seeded random token ids, the same for every
engine of a scenario. One run per engine (no repeats).

- defaults: 100 requests (512 in / 64 out) submitted at once, max_num_seqs 8 and 32, the KV
  cache sized by default (gpu_memory_utilization) vs kv_cache_memory_gb=40 (target: default /
  40 GB request throughput >= 0.95).
- early_stop: 64 requests (512 in, max_tokens 2048) that stop after 64 tokens, on-demand
  allocation (the engine) vs the old reservation scheme, emulated (see its "method").
- prefix: 64 requests sharing a 2,048-token system prompt, distinct 64-token suffixes, 64 out,
  max_num_seqs 8 and 32 with a client that keeps that many in flight, prefix caching on vs off
  (targets: TTFT p50 on/off <= 0.25, request throughput on/off >= 2).
- pressure: 64 requests (512 in / 256 out) at max_num_seqs 32 with a KV cache that holds a
  quarter of the working set vs kv_cache_memory_gb=40: every request completes; throughput
  ratio and preemptions.

    python -m benchmarks.kv_lifecycle --out kv-lifecycle.json [--scenarios prefix pressure]
    python -m benchmarks.kv_lifecycle --smoke --out smoke.json   # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.model_shapes import write_shape
from benchmarks.provenance import commit, engine_digest
from benchmarks.wcpb_matrix import release_device_memory
from vllm_rlt.config import CacheConfig, EngineConfig
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import percentiles
from vllm_rlt.models.loader import load_model
from vllm_rlt.sampling_params import SamplingParams

WARMUP_TOKENS = 16
GIB = 2**30
SIZES = {
    "full": {
        "defaults": dict(prompt=512, max_tokens=64, requests=100, seqs=[8, 32], kv_gb=40.0),
        "early_stop": dict(
            prompt=512, max_tokens=2048, stop_after=64, requests=64, seqs=32, reservation_seats=8
        ),
        "prefix": dict(
            system=2048,
            suffix=64,
            max_tokens=64,
            requests=64,
            seqs=[8, 32],
            kv_gb=40.0,
            closed_loop=True,
        ),
        "pressure": dict(
            prompt=512, max_tokens=256, requests=64, seqs=32, kv_fraction=0.25, kv_gb=40.0
        ),
    },
    "smoke": {  # the tiny model on the CPU: every code path in seconds
        "defaults": dict(prompt=48, max_tokens=6, requests=6, seqs=[4], kv_gb=0.05),
        "early_stop": dict(
            prompt=48, max_tokens=200, stop_after=6, requests=6, seqs=4, reservation_seats=1
        ),
        "prefix": dict(
            system=64, suffix=16, max_tokens=6, requests=6, seqs=[4], kv_gb=0.05, closed_loop=True
        ),
        "pressure": dict(
            prompt=48, max_tokens=24, requests=8, seqs=8, kv_fraction=0.25, kv_gb=0.05
        ),
    },
}
_ids = itertools.count()


def blocks_per_request(num_planes: int, positions: int) -> int:
    """KV blocks (all planes) that hold `positions` positions of one request."""
    return num_planes * -(-positions // CacheConfig.block_size)


def random_prompts(rng, vocab: int, n: int, length: int, prefix=()) -> list[list[int]]:
    return [list(prefix) + rng.integers(0, vocab, length).tolist() for _ in range(n)]


def one_wave(length: int):
    """A workload of `length`-token random prompts, submitted at once."""
    return lambda rng, vocab, n: [random_prompts(rng, vocab, n, length)]


def drive(
    engine: LLMEngine, waves, max_tokens: int, stop_after=None, concurrency: int | None = None
):
    """Run `waves` of prompts: the first at once, each next one once every request sent so far has
    its first token. `stop_after`: abort a request once it has that many tokens (an early stop).
    `concurrency`: a client that keeps at most that many requests in flight, sending the next
    prompt as one finishes. TTFT and E2E count from each request's own submission."""
    sched, pool = engine.scheduler, engine.kv_manager.pool
    before = (sched.num_preemptions, sched.prefix_queries, sched.prefix_hits)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    sent, first, done, n_out, running = {}, {}, {}, {}, []
    peak_planes = pool.plane_usage()
    waves, queued = list(waves), []
    start = time.perf_counter()
    while waves or queued or engine.has_unfinished_requests():
        if waves and len(first) == len(sent):
            queued += waves.pop(0)
        while queued and (concurrency is None or len(sent) - len(done) < concurrency):
            rid, now = f"r{next(_ids)}", time.perf_counter()
            engine.add_request(rid, queued.pop(0), params, arrival_time=now)
            sent[rid] = now
        outs = engine.step()
        now = time.perf_counter()
        running.append(len(sched.running))
        peak_planes = [max(a, b) for a, b in zip(peak_planes, pool.plane_usage(), strict=True)]
        for o in outs:
            rid, n = o.request_id, len(o.outputs[0].token_ids)
            if rid in done:
                continue
            first.setdefault(rid, now)
            if not o.finished and stop_after is not None and n >= stop_after:
                engine.abort_request(rid)  # frees its KV at once, as a stop token's finish does
            elif not o.finished:
                continue
            done[rid], n_out[rid] = now, n
    wall = time.perf_counter() - start
    ttft = np.array([first[r] - sent[r] for r in done])
    e2e = np.array([done[r] - sent[r] for r in done])
    toks = np.array([n_out[r] for r in done])
    after = (sched.num_preemptions, sched.prefix_queries, sched.prefix_hits)
    preempt, queries, hits = (a - b for a, b in zip(after, before, strict=True))
    return {
        "num_requests": len(done),
        "completed": int((toks >= (stop_after or max_tokens)).sum()),
        "wall_s": wall,
        "request_throughput": len(done) / wall,
        "output_tok_s": float(toks.sum()) / wall,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(((e2e - ttft) / np.maximum(toks - 1, 1))[toks > 1]),
        "num_kv_blocks": engine.kv_manager.num_total_blocks,
        "preemptions": preempt,
        "prefix_queries": queries,
        "prefix_hits": hits,
        "running_per_step": {"mean": float(np.mean(running)), "max": int(max(running))},
        "peak_blocks_per_plane": peak_planes,
        "steps": len(running),
    }


def run_engine(loaded, args, label: str, s: dict, make=None, **settings) -> dict:
    """Build an engine with `settings`, warm it up, measure the waves of `make(rng, vocab, n)`
    (default: `s["prompt"]`-token prompts at once) for the scenario's sizes `s`."""
    make = make or one_wave(s["prompt"])
    release_device_memory()  # the previous engine's KV cache and graphs
    free = torch.cuda.mem_get_info()[0] / GIB if torch.cuda.is_available() else None
    config = EngineConfig.from_kwargs(
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.chunk,
        wavefront_chunked_prefill=True,
        exit_threshold=1.0,
        **settings,
    )
    engine = LLMEngine(config, loaded=loaded)
    rng, vocab = np.random.default_rng(0), engine.model_config.vocab_size
    drive(engine, make(rng, vocab, settings["max_num_seqs"]), min(s["max_tokens"], WARMUP_TOKENS))
    waves, limit = make(rng, vocab, s["requests"]), settings["max_num_seqs"]
    concurrency = limit if s.get("closed_loop") else None
    result = drive(engine, waves, s["max_tokens"], s.get("stop_after"), concurrency)
    print(f"  {label}: {result['request_throughput']:.3f} req/s", flush=True)
    return {"run": label, "settings": settings, "device_free_gib_at_start": free, **result}


def ratio(a: dict, b: dict) -> dict[str, float]:
    """a / b of throughput and latency medians."""
    return {
        "request_throughput": a["request_throughput"] / b["request_throughput"],
        "output_tok_s": a["output_tok_s"] / b["output_tok_s"],
        "ttft_p50": a["ttft_s"]["p50"] / b["ttft_s"]["p50"],
        "tpot_p50": a["tpot_s"]["p50"] / b["tpot_s"]["p50"],
    }


def defaults(loaded, args, s: dict) -> dict:
    runs, ratios = [], {}
    for seqs in s["seqs"]:
        pair = [
            run_engine(loaded, args, f"seqs {seqs}, KV {name}", s, max_num_seqs=seqs,
                       kv_cache_memory_gb=gb)
            for name, gb in (("default", None), (f"{s['kv_gb']} GiB", s["kv_gb"]))
        ]  # fmt: skip
        runs += pair
        ratios[f"max_num_seqs={seqs}"] = ratio(*pair)
    return {
        "method": "all requests submitted at once; default KV sizing vs kv_cache_memory_gb",
        "runs": runs,
        "ratios_default_over_fixed": ratios,
        "target": "request_throughput ratio >= 0.95",
    }


def early_stop(loaded, args, s: dict) -> dict:
    per_request = blocks_per_request(loaded.model.num_loops, s["prompt"] + s["max_tokens"] - 1)
    seats = s["reservation_seats"]
    num_blocks = seats * per_request
    runs = [
        run_engine(loaded, args, label, s, max_num_seqs=seqs, num_kv_blocks=num_blocks)
        for label, seqs in (("on-demand", s["seqs"]), ("reservation", min(seats, s["seqs"])))
    ]
    return {
        "method": (
            f"max_tokens={s['max_tokens']}, each request aborted (engine.abort_request) as soon "
            f"as its {s['stop_after']}th token is read back: the scheduler frees its KV as it "
            "does for a stop token (dummy weights cannot be made to emit one). Reservation "
            "emulated: the old scheme reserved prompt + max_tokens - 1 positions on every plane "
            f"at admission ({per_request} blocks), so a KV cache of {num_blocks} blocks admitted "
            f"at most {seats} requests; the reservation run caps max_num_seqs there, same KV size"
        ),
        "num_kv_blocks": num_blocks,
        "reservation_blocks_per_request": per_request,
        "reservation_max_running": seats,
        "runs": runs,
        "ratios_on_demand_over_reservation": ratio(*runs),
    }


def prefix(loaded, args, s: dict) -> dict:
    def make(rng, vocab: int, n: int) -> list[list[list[int]]]:
        system = rng.integers(0, vocab, s["system"]).tolist()
        prompts = random_prompts(rng, vocab, n, s["suffix"], system)
        return [prompts[:1], prompts[1:]]

    runs, ratios = [], {}
    for seqs in s["seqs"]:
        pair = [
            run_engine(loaded, args, f"seqs {seqs}, caching {name}", s, make, max_num_seqs=seqs,
                       kv_cache_memory_gb=s["kv_gb"], enable_prefix_caching=on)
            for name, on in (("on", True), ("off", False))
        ]  # fmt: skip
        runs += pair
        ratios[f"max_num_seqs={seqs}"] = ratio(*pair)
    return {
        "method": (
            "one request first, alone; once it has its first token (its prompt is then cached: "
            "a system prompt in use) the rest through a client that keeps max_num_seqs requests "
            "in flight, each sent as one finishes (docs/benchmarks/README.md §2: a concurrency "
            "limit's wait is not part of TTFT). The warm-up uses another system prompt. "
            "Throughput counts from the first request's submission"
        ),
        "runs": runs,
        "ratios_on_over_off": ratios,
        "target": "ttft_p50 ratio <= 0.25, request_throughput ratio >= 2",
    }


def pressure(loaded, args, s: dict) -> dict:
    per_request = blocks_per_request(loaded.model.num_loops, s["prompt"] + s["max_tokens"] - 1)
    working_set = s["seqs"] * per_request
    num_blocks = int(s["kv_fraction"] * working_set)
    runs = [
        run_engine(loaded, args, label, s, max_num_seqs=s["seqs"], **kv)
        for label, kv in (
            (f"KV {s['kv_fraction']} of working set", {"num_kv_blocks": num_blocks}),
            (f"KV {s['kv_gb']} GiB", {"kv_cache_memory_gb": s["kv_gb"]}),
        )
    ]
    return {
        "method": "all requests submitted at once; working set = max_num_seqs x blocks of "
        "(prompt + output - 1) positions on every plane",
        "working_set_blocks": working_set,
        "num_kv_blocks": num_blocks,
        "all_completed": runs[0]["completed"] == runs[0]["num_requests"] == s["requests"],
        "runs": runs,
        "ratios_pressured_over_unpressured": ratio(*runs),
    }


SCENARIOS = {"defaults": defaults, "early_stop": early_stop, "prefix": prefix, "pressure": pressure}


def table(name: str, res: dict) -> str:
    ms = lambda d: "/".join(f"{d[q] * 1e3:.1f}" for q in ("p50", "p90", "p99"))  # noqa: E731
    lines = [
        f"### {name}",
        "",
        "| run | req/s | out tok/s | TTFT p50/90/99 ms | TPOT p50/90/99 ms | blocks | preempt | "
        "running mean/max | prefix hits/queries | done | free GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        free = r["device_free_gib_at_start"]
        lines.append(
            f"| {r['run']} | {r['request_throughput']:.3f} | {r['output_tok_s']:.1f} | "
            f"{ms(r['ttft_s'])} | {ms(r['tpot_s'])} | {r['num_kv_blocks']} | "
            f"{r['preemptions']} | {r['running_per_step']['mean']:.1f}/"
            f"{r['running_per_step']['max']} | {r['prefix_hits']}/{r['prefix_queries']} | "
            f"{r['completed']}/{r['num_requests']} | {'-' if free is None else f'{free:.1f}'} |"
        )
    for key, val in res.items():
        if key.startswith("ratios"):
            lines.append(f"\n{key}: {json.dumps(val)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk (WCPB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--smoke", action="store_true", help="tiny model, float32, tiny sizes (CPU)")
    args = p.parse_args(argv)
    shape, args.dtype = ("tiny", "float32") if args.smoke else ("ouro-1.4b", "bfloat16")
    sizes = SIZES["smoke" if args.smoke else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(write_shape(shape, tmp), dtype=args.dtype, load_format="dummy")
        results = {}
        for name in args.scenarios:
            print(f"{name}:", flush=True)
            results[name] = {"sizes": sizes[name], **SCENARIOS[name](loaded, args, sizes[name])}
    meta = {
        "command": "python -m benchmarks.kv_lifecycle " + " ".join(argv or sys.argv[1:]),
        "commit": commit(),
        "engine_sha256": engine_digest(),
        "args": vars(args),
        "shape": shape,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
    }
    out = {"meta": meta, "scenarios": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for name, res in results.items():
        print("\n" + table(name, res))
    return out


if __name__ == "__main__":
    main()
