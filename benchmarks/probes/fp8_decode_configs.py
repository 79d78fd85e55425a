"""GPU time of decode attention over a bf16 and an FP8 KV cache, per decode launch config.

Decode rows of Ouro-1.4B's heads (16 x 128, MHA) at one context each (`--contexts`) and
`--rows` rows, each case on 8 sets of blocks that a CUDA graph cycles through (sized for the
model's longest context, so the split count is the engine's), timed as graph replay
(`attention_bench.graph_us`): the tree's default config (`decode_config_for`) and every config
of `CONFIGS` (block_n, warps, stages, dot), with `--native` the native decode attention
(`kernels/native.py`; Hopper), with the KV bytes over the time. An FP8 cache holds
the bf16 cache's values rounded to e4m3 (scale 1). The data behind `FP8_DECODE_CONFIG` and
`FP8_FINE_DECODE_CONFIG` (docs/benchmarks/fp8-kv.md §3). Another tree's kernels: run this
file from that tree's root with `PYTHONPATH=.` (it names the kernels it timed).

    python -m benchmarks.probes.fp8_decode_configs --out fp8-decode-configs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import replace

from benchmarks.model_shapes import OURO_1_4B
from benchmarks.probes.attention_bench import Bench, _env, _kv_bytes, graph_us
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels import native
from vllm_rlt.kernels import paged_attention as pa
from vllm_rlt.kernels.kv_format import FP8, KVLayer

GRAPH_MAX_CONTEXT = OURO_1_4B["max_position_embeddings"]
CONFIGS = [
    (64, 4, 2, True),
    (64, 2, 2, False),
    (64, 4, 2, False),
    (32, 2, 2, False),
    (32, 4, 2, False),
    (128, 4, 3, False),
    (128, 8, 2, False),
    (64, 8, 2, False),
]


def sweep(
    contexts: list[int], rows_list: list[int], caches: list[str], rep: int, with_native: bool
) -> list[dict]:
    bench, out = Bench(rep), []
    layers = {
        "bf16": KVLayer(bench.k_cache, bench.v_cache),
        "fp8": KVLayer(bench.k_cache.to(FP8), bench.v_cache.to(FP8)),
    }
    for ctx, rows in itertools.product(contexts, rows_list):
        segs = [(ctx - 1, 1)] * rows
        sets = [(replace(m, max_context=GRAPH_MAX_CONTEXT), q) for m, q, _, _ in
                bench.cases(segs, max_sets=8)]  # fmt: skip
        for name in caches:
            line = []
            for cfg in [None, *(["native"] if with_native else []), *CONFIGS]:
                native.MODE = "1" if cfg == "native" else "0"
                kw = {} if cfg in (None, "native") else {"decode_config": pa.LaunchConfig(*cfg)}
                calls = [lambda m=m, q=q, kw=kw, c=layers[name]: pa.paged_attention(q, c, m, **kw)
                         for m, q in sets]  # fmt: skip
                us = graph_us(calls, rep)
                gbps = _kv_bytes(segs) // (2 if name == "fp8" else 1) / us / 1e3
                out.append({"context": ctx, "rows": rows, "cache": name,
                            "config": cfg or "default", "us": us, "GBps": gbps})  # fmt: skip
                line.append(f"{cfg or 'default'} {us:.1f}")
            print(f"ctx {ctx} rows {rows} {name}: " + " | ".join(line), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[576, 2048])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--caches", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--rep", type=int, default=20, help="do_bench repetition time (ms)")
    p.add_argument("--native", action="store_true", help="also the native decode attention")
    args = p.parse_args(argv)
    res = {"env": _env(), "command": sys.argv, "commit": commit(), "engine_sha256": engine_digest(),
           "kernels": os.path.dirname(pa.__file__)}  # fmt: skip
    res["results"] = sweep(args.contexts, args.rows, args.caches, args.rep, args.native)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
