"""Compute and memory floors of the WCPB matrix's runs, beside the measured durations.

For every run of a matrix `results.json` (benchmarks/wcpb_matrix.py) the workload is rebuilt from
its seed, and the engine counters of the run give the recurrent-core rows and invocations:

- compute: 2 x (shared-layer parameters) FLOPs per core row, attention 4 x heads x head_dim FLOPs
  per visible key per layer, the coda (2 x hidden x vocab) per output token; over the measured
  bf16 matmul rate;
- memory: the shared-layer weights once per invocation, each row's K/V write, and the K/V reads:
  a decode row reads its whole context, a prefill tile (`--tile-rows` rows of one chunk) reads
  up to its last position once; over the measured copy bandwidth;
- arrival: the last request's arrival time (an arrival run cannot end earlier).

The floor is the largest of the three; measured / floor says how far a mode is from it.

With `--offline`, the results are the offline benchmark's (benchmarks/offline_throughput.py: per
concurrency c, 2c requests submitted together, max_num_seqs = c, fixed depth). Its work is
rebuilt from the arguments: requests in waves of c, each wave's prompts in invocations full to
the token budget and its decode rows in lockstep (the fewest invocations max_num_seqs allows).
Two floors: the phases' floors added (each the larger of its compute and memory), for a schedule
whose prefill and decode run in separate invocations, and the larger of the whole run's compute
and memory, for one that hides either completely under the other.

    python -m benchmarks.roofline benchmarks/results/wcpb-matrix/arrival/results.json
    python -m benchmarks.roofline --offline benchmarks/results/offline-throughput/run1.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.model_shapes import SHAPES
from benchmarks.wcpb_matrix import INPUTS, MODES, PROFILES
from vllm_rlt.entrypoints.bench.workload import build_workload

# Measured on the H200 (docs/benchmarks/README.md §4)
COPY_GBPS = 4245.8
MATMUL_TFLOPS = 796.0


def seconds(flops: float, nbytes: float) -> tuple[float, float]:
    """Compute and memory floors: FLOPs over the matmul rate, bytes over the copy bandwidth."""
    return flops / (MATMUL_TFLOPS * 1e12), nbytes / (COPY_GBPS * 1e9)


def layer_params(shape: dict) -> int:
    """Parameters of the shared layers (the recurrent core's GEMM weights)."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q = shape["num_attention_heads"] * d
    kv = shape["num_key_value_heads"] * d
    return shape["num_hidden_layers"] * (h * q + 2 * h * kv + q * h + 3 * h * i)


def request_work(shape: dict, prompt: int, output: int, chunk: int, tile_rows: int) -> dict:
    """Attention FLOPs and K/V bytes of one request through every loop (positions 0-based), in
    all and split into its "prefill" and "decode" rows."""
    layers, loops = shape["num_hidden_layers"], shape["total_ut_steps"]
    flops_per_key = loops * 4 * shape["num_attention_heads"] * shape["head_dim"] * layers
    kv_row = loops * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2 * layers  # bf16
    fed = prompt + output - 1  # positions that pass the core (the last output is not fed back)
    prompt_keys = prompt * (prompt + 1) // 2  # keys seen by the prompt: position p sees p + 1
    decode_keys = fed * (fed + 1) // 2 - prompt_keys
    tile_ends = 0  # keys read by the prefill tiles: a tile reads up to its last position
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        tile_ends += sum(min(t + tile_rows, end) for t in range(start, end, tile_rows))
    phases = {  # each row writes its K/V and reads its keys
        "prefill": {"attention_flops": flops_per_key * prompt_keys,
                    "kv_bytes": kv_row * (prompt + tile_ends)},
        "decode": {"attention_flops": flops_per_key * decode_keys,
                   "kv_bytes": kv_row * (fed - prompt + decode_keys)},
    }  # fmt: skip
    return {k: phases["prefill"][k] + phases["decode"][k] for k in phases["prefill"]} | phases


def run_floors(run: dict, call_args: dict, shape: dict, weight_bytes: float, tile_rows: int):
    p = PROFILES[run["profile"]]
    wl = build_workload(
        p["profile"], run["requests"], INPUTS[run["inputs"]], call_args["output_len"],
        shape["vocab_size"], concurrency=p["concurrency"], rate=p.get("rate", 2.0),
        seed=call_args["seed"] + run["repeat"],
    )  # fmt: skip
    eng = run["engine"]
    flops = 2.0 * layer_params(shape) * eng["rows"]
    flops += 2.0 * shape["hidden_size"] * shape["vocab_size"] * eng["generated_tokens"]
    kv = 0.0
    for spec in wl.requests:
        work = request_work(shape, len(spec.prompt_token_ids), spec.output_len, run["chunk"],
                            tile_rows)  # fmt: skip
        flops += work["attention_flops"]
        kv += work["kv_bytes"]
    compute_s, memory_s = seconds(flops, eng["invocations"] * weight_bytes + kv)
    return {
        "compute_s": compute_s,
        "memory_s": memory_s,
        "arrival_s": max(spec.arrival_s for spec in wl.requests),
    }


def mode_floors(results: dict, weight_bytes: float, tile_rows: int, shape_name: str) -> list:
    """Per cell and mode: median measured duration and median floors of the timed runs."""
    shape = SHAPES[shape_name]
    call_args = results["calls"][0]["args"]
    if any((c["args"]["seed"], c["args"]["output_len"]) != (call_args["seed"],
           call_args["output_len"]) for c in results["calls"]):  # fmt: skip
        raise ValueError("the calls of this matrix used different seeds or output lengths")
    out = []
    keys = sorted({(r["chunk"], r["profile"], r["inputs"]) for r in results["runs"]})
    for chunk, profile, inputs in keys:
        for mode in MODES:
            runs = [r for r in results["runs"] if not r.get("profiled") and
                    (r["chunk"], r["profile"], r["inputs"], r["mode"]) ==
                    (chunk, profile, inputs, mode)]  # fmt: skip
            if not runs:
                continue
            floors = [run_floors(r, call_args, shape, weight_bytes, tile_rows) for r in runs]
            med = {k: float(np.median([f[k] for f in floors])) for k in floors[0]}
            measured = float(np.median([r["summary"]["duration_s"] for r in runs]))
            cell = {"chunk": chunk, "profile": profile, "inputs": inputs, "mode": mode}
            out.append(cell | med | {"measured_s": measured, "floor_s": max(med.values())})
    return out


def offline_floors(results: dict, weight_bytes: float, tile_rows: int) -> list[dict]:
    """Per concurrency of an offline_throughput results file: the measured wall time and the
    floors of its work (module docstring)."""
    args = results["meta"]["args"]
    shape = SHAPES[args["shape"]]
    loops, prompt, output = shape["total_ut_steps"], args["prompt_len"], args["output_len"]
    work = request_work(shape, prompt, output, args["chunk_size"], tile_rows)
    row_flops = 2.0 * layer_params(shape)
    coda_flops = 2.0 * shape["hidden_size"] * shape["vocab_size"]  # per output token
    out = []
    for r in results["results"]:
        n, c = r["num_requests"], r["concurrency"]
        waves = -(-n // c)  # max_num_seqs = c: c requests at a time
        prefill_inv = loops * waves * -(-c * prompt // args["max_num_batched_tokens"])
        decode_inv = loops * (output - 1) * waves
        phases = {
            "prefill": (n * (prompt * loops * row_flops + work["prefill"]["attention_flops"]),
                        prefill_inv * weight_bytes + n * work["prefill"]["kv_bytes"]),
            "decode": (n * ((output - 1) * loops * row_flops + work["decode"]["attention_flops"]
                            + output * coda_flops),
                       decode_inv * weight_bytes + n * work["decode"]["kv_bytes"]),
        }  # fmt: skip
        secs = {k: seconds(*flops_bytes) for k, flops_bytes in phases.items()}
        compute, memory = (sum(v[i] for v in secs.values()) for i in (0, 1))
        out.append({
            "concurrency": c, "measured_s": r["wall_s"], "output_tokens": n * output,
            "prefill_s": max(secs["prefill"]), "decode_s": max(secs["decode"]),
            "separate_s": sum(max(v) for v in secs.values()), "overlapped_s": max(compute, memory),
        })  # fmt: skip
    return out


def offline_table(rows: list[dict]) -> str:
    lines = ["| c | measured s | output tok/s | prefill floor s | decode floor s | floor, phases "
             "apart s (tok/s) | floor, phases hidden s (tok/s) | measured / floor |",
             "|---" * 8 + "|"]  # fmt: skip
    for r in rows:
        m, apart, hidden, tokens = (r[k] for k in ("measured_s", "separate_s", "overlapped_s",
                                                   "output_tokens"))  # fmt: skip
        lines.append(
            f"| {r['concurrency']} | {m:.3f} | {tokens / m:.1f} | {r['prefill_s']:.3f} | "
            f"{r['decode_s']:.3f} | {apart:.3f} ({tokens / apart:.0f}) | {hidden:.3f} "
            f"({tokens / hidden:.0f}) | {m / apart:.2f} - {m / hidden:.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| chunk | profile | inputs | mode | measured s | compute floor s | memory floor s "
             "| last arrival s | measured / floor |", "|---" * 9 + "|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['chunk']} | {r['profile']} | {r['inputs']} | {r['mode']} | "
            f"{r['measured_s']:.3f} | {r['compute_s']:.3f} | {r['memory_s']:.3f} | "
            f"{r['arrival_s']:.3f} | {r['measured_s'] / r['floor_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--weight-bytes", type=float, default=2466643968.0,
                   help="shared-layer bytes read per invocation (layer-kernels.json)")  # fmt: skip
    p.add_argument("--tile-rows", type=int, default=64, help="prefill rows per attention tile")
    p.add_argument("--offline", action="store_true", help="an offline_throughput results file")
    args = p.parse_args(argv)
    results = json.loads(args.results.read_text())
    if args.offline:
        out = offline_table(offline_floors(results, args.weight_bytes, args.tile_rows))
    else:
        out = table(mode_floors(results, args.weight_bytes, args.tile_rows, args.shape))
    print(out)
    return out


if __name__ == "__main__":
    main()
