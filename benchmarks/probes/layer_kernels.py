"""GPU time and kernel count of one recurrent-core invocation under each layer-kernel strategy.

The Ouro-1.4B shape (24 layers, hidden 2048, 16 x 128 heads, MLP 5632) with dummy bf16 weights and
the Triton attention backend (over a bf16 or, with `--kv-cache-dtype fp8`, an FP8 KV cache) runs
one loop over R decode rows (R in --rows), each row its own sequence at position --context - 1
with that much KV (block size 16, fragmented block tables);
with --chunk C, R / C sequences each run a prefill chunk of C rows ending at that position.
For each layer path in --paths (`torch`: one op per arithmetic step, 3 + 2 projection GEMMs;
`fused`: fused [q;k;v] and [gate;up] GEMMs and Triton kernels, `vllm_rlt.kernels.fused_ops`;
`skinny`: `fused` with the projections of up to 16 rows on `vllm_rlt.kernels.skinny_gemm`;
`native`: `skinny` with the native kernels on, as `VLLM_RLT_NATIVE=1` turns them on:
`vllm_rlt.kernels.native`) it reports:

- eager_ms: CUDA events around back-to-back calls after warm-up (host launch cost included);
- graph_ms: the same invocation captured in a CUDA graph and replayed (GPU time alone);
- kernels and kernel_ms from torch.profiler over one eager call (kernels, copies and memsets), the
  most frequent kernel names, GPU time and count per kernel name, and kernels per layer from the
  difference between the full model and the model cut to half its layers;
- for `fused` and `skinny`, the relative distance of their outputs to the torch path's (same
  inputs).

The weight floor is the bytes of the shared layers over the device-to-device copy bandwidth
measured in the same run.

With --ablate, each case also replays the skinny invocation with pieces taken out (`ablated_ms`,
best of 5): `no_norms` (every norm and sandwich step returns its input), `no_attention` (the
attention call returns q; the K/V write stays), `unsplit_attention` (one KV split, no combine)
and `gemms_only` (no norms, no attention). The differences to `all` are what each piece adds to
the invocation's GPU time with its neighbours overlapping it (early launch); the outputs of the
ablated invocations mean nothing. --splits S ... replays it with attention at S KV splits
(`splits_S`), as a mixed CUDA graph fixed to S splits would run it. --timeline profiles one
replay of the skinny invocation's CUDA graph and reports, per pair of consecutive kernel names,
the second one's mean duration and the mean gap after the first ends (negative where early
launch overlaps them): which kernel boundaries cost what. --gemm-rows and --rope-rows
set the skinny path's row limits (the few-row GEMM's, and its RoPE and KV-write epilogue's), to
measure other limits than the engine's.

    python -m benchmarks.probes.layer_kernels --out layer-kernels.json
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from pathlib import Path

import torch
import triton

from benchmarks.model_shapes import write_shape
from vllm_rlt.attention import triton_backend
from vllm_rlt.attention.metadata import TILE_ROWS, build_attention_metadata
from vllm_rlt.entrypoints.bench.metrics import device_events, device_time_by_name
from vllm_rlt.kernels import native
from vllm_rlt.kernels.kv_format import FP8, KVLayer
from vllm_rlt.models import layer_kernels as strategies
from vllm_rlt.models.loader import load_model

BLOCK_SIZE = 16
PATHS = ("torch", "fused", "skinny", "native")


class LayerKV:
    """K and V of every layer: [num_layers, 2, num_blocks, block_size, Hkv, d], random values
    stored in `dtype` (bf16, or FP8 at scale 1)."""

    def __init__(self, config, num_blocks: int, dtype: torch.dtype = torch.bfloat16):
        shape = (config.num_hidden_layers, 2, num_blocks, BLOCK_SIZE)
        shape += (config.num_key_value_heads, config.head_dim)
        self.kv = torch.randn(shape, device="cuda").to(dtype)

    def layer(self, index: int) -> KVLayer:
        return KVLayer(self.kv[index, 0], self.kv[index, 1])


def make_case(model, rows: int, context: int, kv: LayerKV, seed: int, chunk: int = 1):
    """(hidden [rows, H], metadata) for rows // chunk sequences, each a segment of `chunk` rows
    at positions context - chunk .. context - 1 (chunk 1: decode rows; more: prefill chunks,
    tiled as the engine tiles them)."""
    if rows % chunk or chunk > context:
        raise ValueError(f"{rows} rows do not split into chunks of {chunk} within {context}")
    gen = torch.Generator().manual_seed(seed)
    blocks = triton.cdiv(context, BLOCK_SIZE)
    seqs = rows // chunk
    perm = torch.randperm(kv.kv.shape[2], generator=gen)[: seqs * blocks].tolist()
    tables = [perm[r * blocks : (r + 1) * blocks] for r in range(seqs)]
    starts, counts = [context - chunk] * seqs, [chunk] * seqs
    meta = build_attention_metadata(starts, counts, tables, BLOCK_SIZE, "cuda", TILE_ROWS)
    hidden = torch.randn(rows, model.config.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    return hidden, meta


def time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def trace_events(fn) -> list[dict]:
    """The Chrome-trace events of one call of fn under torch.profiler (CPU and CUDA)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
        return json.loads(trace.read_text())["traceEvents"]


def profile_kernels(fn) -> tuple[int, float, list[tuple[str, float, int]]]:
    """(device events, their summed GPU ms, (name, GPU us, count) per name) of one call of fn."""
    by_name = device_time_by_name(trace_events(fn))
    return sum(n for *_, n in by_name), sum(us for _, us, _ in by_name) / 1e3, by_name


def boundaries(events: list[dict]) -> dict:
    """Where a sequence of GPU activities spends its time: the span from the first start to
    the last end, the activities' summed durations, and per (activity before, activity) pair of
    names (cut to 24 characters) its count, mean duration of the second and mean gap from the
    end of the first to the start of the second (negative: early launch overlaps them)."""
    events = sorted(device_events(events), key=lambda e: e["ts"])
    if not events:
        return {"span_us": 0.0, "busy_us": 0.0, "pairs": {}}
    pairs: dict[str, list[float]] = {}
    for before, e in zip(events, events[1:], strict=False):
        key = f"{before['name'][:24]} -> {e['name'][:24]}"
        count, dur, gap = pairs.get(key, [0, 0.0, 0.0])
        pairs[key] = [count + 1, dur + e["dur"], gap + e["ts"] - before["ts"] - before["dur"]]
    return {
        "span_us": max(e["ts"] + e["dur"] for e in events) - events[0]["ts"],
        "busy_us": sum(e["dur"] for e in events),
        "pairs": {
            k: {"count": n, "mean_dur_us": round(d / n, 2), "mean_gap_us": round(g / n, 2)}
            for k, (n, d, g) in pairs.items()
        },  # fmt: skip
    }


def captured(core) -> torch.cuda.CUDAGraph:
    """`core` warmed up and captured in a CUDA graph."""
    for _ in range(3):
        core()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        core()
    return graph


def graph_ms(core, iters: int, repeats: int = 5) -> float:
    """Best of `repeats` timings of `core` captured in a CUDA graph."""
    graph = captured(core)
    return min(time_ms(graph.replay, iters) for _ in range(repeats))


def measure(model, hidden, meta, kv, iters: int) -> dict:
    def core():
        return model.recurrent_core(hidden, meta, kv)

    graph = graph_ms(core, iters, repeats=1)  # compiles and warms up too
    eager = time_ms(core, iters)
    count, kernel_ms, by_name = profile_kernels(core)
    layers = model.model.layers
    model.model.layers = layers[: len(layers) // 2]
    try:
        half_count, *_ = profile_kernels(core)
    finally:
        model.model.layers = layers
    return {
        "eager_ms": eager,
        "graph_ms": graph,
        "kernels": count,
        "kernel_ms": kernel_ms,
        "kernels_per_layer": (count - half_count) / (len(layers) - len(layers) // 2),
        "top_kernels": sorted(((n, c) for n, _, c in by_name), key=lambda x: -x[1])[:12],
        "kernel_us_by_name": by_name,
    }


ABLATIONS = ("all", "no_norms", "no_attention", "unsplit_attention", "gemms_only")


def ablated_ms(model, hidden, meta, kv, iters: int, names=ABLATIONS) -> dict[str, float]:
    """The skinny invocation's graph time with pieces taken out (module docstring), or with
    attention at a fixed number of KV splits S (`splits_S`; `unsplit_attention` is S = 1)."""
    skinny, attention = strategies.SkinnyLayerKernels, triton_backend.paged_attention
    norm, add_norm = skinny.norm, skinny.add_norm
    times = {}
    for name in names:
        if name in ("no_norms", "gemms_only"):
            skinny.norm = lambda self, x, n: x
            skinny.add_norm = lambda self, h, y, a, b: (h, y)
        if name in ("no_attention", "gemms_only"):
            triton_backend.paged_attention = lambda q, *args, **kw: q
        if name == "unsplit_attention" or name.startswith("splits_"):
            count = 1 if name == "unsplit_attention" else int(name.removeprefix("splits_"))
            triton_backend.paged_attention = lambda *a, _s=count, **kw: attention(
                *a, **{**kw, "num_splits": _s}
            )
        try:
            times[name] = graph_ms(lambda: model.recurrent_core(hidden, meta, kv), iters)
        finally:
            skinny.norm, skinny.add_norm = norm, add_norm
            triton_backend.paged_attention = attention
    return times


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def copy_gbps() -> float:
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = time_ms(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 2 / ms / 1e6


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=512, help="KV positions per row")
    parser.add_argument("--chunk", type=int, default=1, help="rows per sequence (1: decode)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    parser.add_argument("--ablate", action="store_true", help="skinny without norms, attention")
    parser.add_argument("--timeline", action="store_true",
                        help="profile a skinny graph replay: gaps between its kernels")  # fmt: skip
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also replay skinny with attention at these KV splits")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the JSON results here")
    skinny = strategies.SkinnyLayerKernels
    parser.add_argument("--gemm-rows", type=int, default=skinny.max_rows,
                        help="most rows the skinny path gives the few-row GEMM")  # fmt: skip
    parser.add_argument("--rope-rows", type=int, default=skinny.rope_max_rows,
                        help="most rows whose RoPE and KV write the q/k/v GEMM does")  # fmt: skip
    args = parser.parse_args(argv)
    skinny.max_rows, skinny.rope_max_rows = args.gemm_rows, args.rope_rows

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(
            write_shape("ouro-1.4b", tmp),
            dtype="bfloat16",
            device="cuda",
            load_format="dummy",
            attention_backend="triton",
        )
    model = loaded.model
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    bandwidth = copy_gbps()
    num_blocks = max(args.rows) // args.chunk * triton.cdiv(args.context, BLOCK_SIZE) + 64
    kv = LayerKV(loaded.config, num_blocks, FP8 if args.kv_cache_dtype == "fp8" else torch.bfloat16)
    results = []
    for rows in args.rows:
        hidden, meta = make_case(model, rows, args.context, kv, rows, args.chunk)
        case = {"rows": rows, "context": args.context, "chunk": args.chunk}
        outputs = {}
        for path in args.paths:
            model.layer_kernels = "skinny" if path == "native" else path
            native.MODE = "1" if path == "native" else "0"
            case[path] = measure(model, hidden, meta, kv, args.iters)
            outputs[path] = model.recurrent_core(hidden, meta, kv)
            print(
                f"rows {rows:4d} chunk {args.chunk}: {path} graph {case[path]['graph_ms']:.3f} "
                f"ms, eager {case[path]['eager_ms']:.2f} ms, {case[path]['kernels']} kernels "
                f"({case[path]['kernels_per_layer']:.1f} per layer)",
                flush=True,
            )
        if "torch" in outputs:
            h_torch, g_torch = outputs["torch"]
            for path in outputs.keys() - {"torch"}:
                h, g = outputs[path]
                case[path]["hidden_rel_err_vs_torch"] = rel_err(h, h_torch)
                case[path]["gate_rel_err_vs_torch"] = rel_err(g, g_torch)
        if {"torch", "fused"} <= outputs.keys():
            case["graph_speedup"] = case["torch"]["graph_ms"] / case["fused"]["graph_ms"]
        if args.ablate or args.splits:
            model.layer_kernels, native.MODE = "skinny", "0"
            names = (ABLATIONS if args.ablate else ("all",)) + tuple(
                f"splits_{n}" for n in args.splits
            )
            case["ablated_ms"] = ablated_ms(model, hidden, meta, kv, args.iters, names)
            print(f"rows {rows:4d}: skinny ablated (ms) {case['ablated_ms']}", flush=True)
        if args.timeline:
            model.layer_kernels, native.MODE = "skinny", "0"
            graph = captured(functools.partial(model.recurrent_core, hidden, meta, kv))
            t = case["timeline"] = boundaries(trace_events(graph.replay))
            print(f"rows {rows:4d}: skinny replay span {t['span_us']:.0f} us, kernels "
                  f"{t['busy_us']:.0f} us", flush=True)  # fmt: skip
            for pair, v in t["pairs"].items():
                print(f"    {pair}: {v}", flush=True)
        if {"fused", "skinny"} <= outputs.keys():
            case["skinny_vs_fused"] = case["fused"]["graph_ms"] / case["skinny"]["graph_ms"]
        if {"skinny", "native"} <= outputs.keys():
            case["native_vs_skinny"] = case["skinny"]["graph_ms"] / case["native"]["graph_ms"]
        results.append(case)
    report = {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "model": "ouro-1.4b shape, dummy weights, bf16, triton attention",
        "kv_cache_dtype": args.kv_cache_dtype,
        "gemm_rows": args.gemm_rows,
        "rope_rows": args.rope_rows,
        "layer_weight_bytes": layer_bytes,
        "copy_GBps": bandwidth,
        "weight_floor_ms": layer_bytes / bandwidth / 1e6,
        "cases": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
