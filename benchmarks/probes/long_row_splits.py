"""GPU probe behind balanced decode splits (`attention_splits.decode_balance`): decode attention
over rows of uneven contexts (one long row among short ones) and even ones, timed as CUDA-graph
replay in a grid sized for 65,536 positions as the engine captures it, per call, three ways:
the balanced pieces (the default), the fine policy's even split count without balancing, and
fixed even split counts.

    python -m benchmarks.probes.long_row_splits --out splits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from benchmarks.probes.attention_bench import Bench, _env
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels import paged_attention as pa
from vllm_rlt.kernels.attention_splits import choose_num_splits, split_policy

GRAPH_MAX_CONTEXT = 65536
MIXES = {  # contexts of the decode rows
    "1x10240 + 7x600": [10240] + [600] * 7,
    "1x10240 + 5x600": [10240] + [600] * 5,
    "1x10240 + 1x600": [10240, 600],
    "1x10240 + 7x2048": [10240] + [2048] * 7,
    "1x10240": [10240],
    "4x600": [600] * 4,
    "8x600": [600] * 8,
    "8x2048": [2048] * 8,
    "8x8192": [8192] * 8,
    "16x600": [600] * 16,
    "32x600": [600] * 32,
    "1x10240 + 31x600": [10240] + [600] * 31,
}
FIXED = (2, 3, 4, 8, 16)


def _unbalanced(num_programs, num_kv_heads, max_context, num_sms, decode_only):
    policy = split_policy(num_programs, decode_only, num_sms)
    return policy, choose_num_splits(num_programs, max_context, num_sms, policy), 0


def _fixed(splits: int):
    return lambda num_programs, num_kv_heads, max_context, num_sms, decode_only: (
        split_policy(num_programs, decode_only, num_sms),
        splits,
        0,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--rep", type=int, default=30, help="do_bench repetition time (ms)")
    args = p.parse_args()
    bench = Bench(args.rep)
    balanced = pa.launch_splits
    ways = {"balanced": balanced, "unbalanced": _unbalanced}
    ways.update({f"even {s}": _fixed(s) for s in FIXED})
    rows = []
    try:
        for name, contexts in MIXES.items():
            sets = [
                (replace(meta, max_context=GRAPH_MAX_CONTEXT), *rest)
                for meta, *rest in bench.cases([(c - 1, 1) for c in contexts], max_sets=8)
            ]
            for way, fn in ways.items():
                pa.launch_splits = fn
                us = bench.attention(sets, False)["graph_us"]
                rows.append({"mix": name, "splits": way, "attention_us": us})
                print(f"{name:20s} {way:11s} {us:7.1f} us", flush=True)
    finally:
        pa.launch_splits = balanced
    meta = {"command": " ".join(sys.argv), "commit": commit(), "engine_sha256": engine_digest()}
    with open(args.out, "w") as f:
        json.dump({"meta": {**meta, **_env()}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
