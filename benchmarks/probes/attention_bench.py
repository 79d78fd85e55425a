"""GPU microbenchmark of the Triton paged attention at Ouro-1.4B's head shape (16 x 128, MHA, bf16).

Times decode rows at 1K-8K context, prefill chunks at mixed depths and mixed batches, next to two
ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and a
bf16 8192^3 matmul. Each case is timed as CUDA-graph replay (GPU time, how the engine runs its
captured invocations; the graph cycles through up to 16 copies of the case on disjoint blocks, so
small cases miss the L2) and eagerly (host launch cost included), both with
triton.testing.do_bench (median; it clears the L2 before every call). Decode bandwidth is the KV
bytes the rows must read over the graph time. `--sweep` also times launch configs and split
counts (the data behind the defaults in vllm_rlt/kernels/paged_attention.py).

    python -m benchmarks.probes.attention_bench --out attention.json [--sweep]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from dataclasses import asdict

import torch
import triton
from triton.testing import do_bench

from vllm_rlt.attention.metadata import build_attention_metadata
from vllm_rlt.attention.triton_backend import TritonAttentionBackend
from vllm_rlt.kernels import attention_splits as attn_splits
from vllm_rlt.kernels import paged_attention as pa
from vllm_rlt.kernels.device_info import sm_count
from vllm_rlt.kernels.kv_format import KVLayer

HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 128, 16, torch.bfloat16
POOL_BLOCKS = 64 * 8192 // BLOCK_SIZE + 64  # enough for 64 rows at 8K
KV_BYTES_PER_POS = 2 * HEADS * HEAD_DIM * 2  # K and V, bf16


def _time_ms(fn, rep: int) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def graph_us(calls: list, rep: int) -> float:
    """Microseconds per call of a CUDA graph replaying `calls` back to back (GPU time, as the
    engine's captured invocations run), after one eager round (compilation)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    us = _time_ms(graph.replay, rep) * 1e3 / len(calls)
    del graph
    return us


class Bench:
    """A bf16 KV pool, fragmented block tables, and the two timers (eager and graph replay)."""

    def __init__(self, rep: int) -> None:
        self.rep = rep
        shape = (POOL_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.perm = torch.randperm(POOL_BLOCKS).tolist()  # fragmented block tables
        self.backend = TritonAttentionBackend()

    def cases(self, segments: list[tuple[int, int]], tile_rows: int = 16, max_sets: int = 16):
        """Up to max_sets (meta, q, k, v) for segments (first position, rows), each set on its own
        blocks, so that a graph cycling through the sets misses the L2 like a real model does."""
        blocks = [triton.cdiv(start + rows, BLOCK_SIZE) for start, rows in segments]
        num_sets = max(1, min(max_sets, POOL_BLOCKS // sum(blocks)))
        sets, used = [], 0
        for _ in range(num_sets):
            tables = []
            for n in blocks:
                tables.append(self.perm[used : used + n])
                used += n
            meta = build_attention_metadata(
                [s for s, _ in segments],
                [r for _, r in segments],
                tables,
                BLOCK_SIZE,
                "cuda",
                tile_rows=tile_rows,
            )
            qkv = torch.randn(3, meta.num_rows, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            sets.append((meta, qkv[0], qkv[1], qkv[2]))
        return sets

    def _time(self, calls: list, eager: bool = True) -> dict:
        """Median microseconds per call: eager (host launches included) and CUDA-graph replay of
        all calls (`graph_us`)."""
        replay_us = graph_us(calls, self.rep)
        eager_ms = _time_ms(calls[0], self.rep) if eager else float("nan")
        return {"graph_us": replay_us, "eager_us": eager_ms * 1e3, "sets": len(calls)}

    def attention(self, sets, eager: bool = True, **kw) -> dict:
        cache = KVLayer(self.k_cache, self.v_cache)
        calls = [lambda m=m, q=q: pa.paged_attention(q, cache, m, **kw) for m, q, _, _ in sets]
        return self._time(calls, eager)

    def forward(self, sets) -> dict:
        kc, vc, fwd = self.k_cache, self.v_cache, self.backend.forward
        return self._time(
            [lambda m=m, q=q, k=k, v=v: fwd(q, k, v, kc, vc, m) for m, q, k, v in sets]
        )


def _env() -> dict:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        smi = "unknown"
    return {
        "gpu": torch.cuda.get_device_name(),
        "nvidia_smi": smi,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def _copy_ms(num_bytes: int, rep: int) -> float:
    src = torch.randn(num_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _time_ms(lambda: dst.copy_(src), rep)


def _ceilings(rep: int) -> dict:
    n = 1 << 30  # 1 GiB buffers
    copy_ms = _copy_ms(n, rep)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b, rep)
    return {
        "copy_bytes": 2 * n,
        "copy_ms": copy_ms,
        "copy_GBps": 2 * n / copy_ms / 1e6,
        "matmul_ms": mm_ms,
        "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
    }


def _flops(segments: list[tuple[int, int]]) -> int:
    """Causal attention FLOPs (QK and PV): 4 * H * d per visible key per row."""
    keys = sum(rows * start + rows * (rows + 1) // 2 for start, rows in segments)
    return 4 * HEADS * HEAD_DIM * keys


def _kv_bytes(segments: list[tuple[int, int]]) -> int:
    """KV each segment must read once: its context."""
    return KV_BYTES_PER_POS * sum(start + rows for start, rows in segments)


def run_decode(bench: Bench, copy_gbps: float) -> list[dict]:
    results, num_sms = [], sm_count(torch.device("cuda"))
    for ctx in (1024, 2048, 4096, 8192):
        for rows in (1, 8, 32, 64):
            segs = [(ctx - 1, 1)] * rows
            sets = bench.cases(segs)
            attn, fwd = bench.attention(sets), bench.forward(sets)
            gbps = _kv_bytes(segs) / attn["graph_us"] / 1e3
            results.append(
                {
                    "context": ctx,
                    "rows": rows,
                    "num_splits": attn_splits.launch_splits(
                        rows * HEADS, HEADS, ctx, num_sms, decode_only=True
                    )[1],
                    "kv_bytes": _kv_bytes(segs),
                    "attention": attn,
                    "forward": fwd,
                    "GBps": gbps,
                    "frac_of_copy": gbps / copy_gbps,
                    "forward_frac_of_copy": _kv_bytes(segs) / fwd["graph_us"] / 1e3 / copy_gbps,
                    "eager_frac_of_copy": _kv_bytes(segs) / attn["eager_us"] / 1e3 / copy_gbps,
                }
            )
    return results


CHUNK_STARTS = [0, 1024, 2048, 3072, 4096, 5120, 6144, 7168]  # mixed depths, one plane each


def run_chunks(bench: Bench, mm_tflops: float) -> list[dict]:
    results = []
    for chunk in (32, 128):
        for num_segs in (1, 8):
            segs = [(s, chunk) for s in CHUNK_STARTS] if num_segs > 1 else [(4096, chunk)]
            for tile_rows in (16, 32, 64, 128):
                if tile_rows > chunk:
                    continue
                attn = bench.attention(bench.cases(segs, tile_rows=tile_rows))
                tflops = _flops(segs) / attn["graph_us"] / 1e6
                results.append(
                    {
                        "chunk": chunk,
                        "segments": segs,
                        "tile_rows": tile_rows,
                        "attention": attn,
                        "TFLOPs": tflops,
                        "frac_of_matmul": tflops / mm_tflops,
                        "GBps": _kv_bytes(segs) / attn["graph_us"] / 1e3,
                    }
                )
    return results


MIXED = {
    "32 decode @4K + 2 chunks of 128 @2K,6K": [(4095, 1)] * 32 + [(2048, 128), (6144, 128)],
    "64 decode @1K-8K + 1 chunk of 32 @7K": [(1023 + 112 * i, 1) for i in range(64)] + [(7168, 32)],
    "8 decode @8K + 4 chunks of 32 @0-3K": [(8191, 1)] * 8 + [(1024 * i, 32) for i in range(4)],
}


def run_mixed(bench: Bench, copy_gbps: float) -> list[dict]:
    results = []
    for name, segs in MIXED.items():
        for tile_rows in (16, 64):
            sets = bench.cases(segs, tile_rows=tile_rows)
            attn, fwd = bench.attention(sets), bench.forward(sets)
            results.append(
                {
                    "batch": name,
                    "tile_rows": tile_rows,
                    "attention": attn,
                    "forward": fwd,
                    "GBps": _kv_bytes(segs) / attn["graph_us"] / 1e3,
                    "TFLOPs": _flops(segs) / attn["graph_us"] / 1e6,
                    "frac_of_copy": _kv_bytes(segs) / attn["graph_us"] / 1e3 / copy_gbps,
                }
            )
    return results


DECODE_SWEEP = [
    pa.DECODE_CONFIG,
    pa.LaunchConfig(64, 4, 3, True),
    pa.LaunchConfig(64, 4, 3, False),
    pa.LaunchConfig(128, 8, 3, True),
]
CHUNK_SWEEP = [
    pa.LaunchConfig(128, 4, 2),
    pa.LaunchConfig(128, 4, 3),
    pa.LaunchConfig(64, 4, 3),
    pa.LaunchConfig(128, 8, 3),
    pa.LaunchConfig(64, 8, 3),
]


def run_sweep(bench: Bench, copy_gbps: float) -> dict:
    decode = []
    for ctx in (1024, 4096, 8192):
        for rows in (1, 8, 32, 64):
            segs = [(ctx - 1, 1)] * rows
            sets = bench.cases(segs, max_sets=8)
            for cfg in DECODE_SWEEP:
                for splits in (1, 2, 4, 8, 16, 32, 64):
                    if rows * HEADS * splits > 16384 or splits * 128 > ctx:
                        continue
                    t = bench.attention(sets, False, num_splits=splits, decode_config=cfg)
                    gbps = _kv_bytes(segs) / t["graph_us"] / 1e3
                    decode.append(
                        {
                            "context": ctx,
                            "rows": rows,
                            "config": asdict(cfg),
                            "num_splits": splits,
                            "attention_us": t["graph_us"],
                            "frac_of_copy": gbps / copy_gbps,
                        }
                    )
    chunk = []
    for chunk_len, tile_rows in ((32, 16), (32, 32), (128, 32), (128, 64), (128, 128)):
        segs = [(s, chunk_len) for s in CHUNK_STARTS]
        sets = bench.cases(segs, tile_rows=tile_rows, max_sets=8)
        for cfg in CHUNK_SWEEP:
            for splits in (1, None):
                t = bench.attention(sets, False, num_splits=splits, chunk_config=cfg)
                chunk.append(
                    {
                        "chunk": chunk_len,
                        "tile_rows": tile_rows,
                        "config": asdict(cfg),
                        "num_splits": splits or "auto",
                        "attention_us": t["graph_us"],
                        "TFLOPs": _flops(segs) / t["graph_us"] / 1e6,
                    }
                )
    return {"decode": decode, "chunk": chunk}


def _print_summary(res: dict) -> None:
    c = res["ceilings"]
    print(f"copy {c['copy_GBps']:.0f} GB/s, matmul {c['matmul_TFLOPs']:.0f} TFLOP/s")
    print("decode (graph replay; eager in brackets): ctx rows splits attn_us fwd_us GB/s frac_copy")
    for r in res["decode"]:
        a, f = r["attention"], r["forward"]
        print(
            f"  {r['context']:5d} {r['rows']:3d} {r['num_splits']:3d}"
            f" {a['graph_us']:8.1f} [{a['eager_us']:7.1f}]"
            f" {f['graph_us']:8.1f} [{f['eager_us']:7.1f}]"
            f" {r['GBps']:6.0f} {r['frac_of_copy']:.2f}"
        )
    print("chunks: chunk segs tile_rows us TFLOP/s")
    for r in res["chunks"]:
        print(
            f"  {r['chunk']:4d} {len(r['segments']):2d} {r['tile_rows']:4d}"
            f" {r['attention']['graph_us']:8.1f} {r['TFLOPs']:6.1f}"
        )
    print("mixed:")
    for r in res["mixed"]:
        print(
            f"  {r['batch']} tile_rows={r['tile_rows']}: {r['attention']['graph_us']:.1f} us"
            f" (fwd {r['forward']['graph_us']:.1f}), {r['GBps']:.0f} GB/s,"
            f" {r['TFLOPs']:.1f} TFLOP/s"
        )


def _print_sweep(res: dict) -> None:
    best: dict = {}
    for r in res["sweep"]["decode"]:
        key = (r["context"], r["rows"], tuple(r["config"].values()))
        if key not in best or r["attention_us"] < best[key]["attention_us"]:
            best[key] = r
    print("sweep decode, best split per config: ctx rows config splits us frac_copy")
    for (ctx, rows, cfg), r in sorted(best.items()):
        print(
            f"  {ctx} {rows:2d} {cfg} {r['num_splits']:2d} {r['attention_us']:7.1f}"
            f" {r['frac_of_copy']:.2f}"
        )
    print("sweep chunk: chunk tile_rows config splits TFLOP/s")
    for r in res["sweep"]["chunk"]:
        cfg = tuple(r["config"].values())
        print(f"  {r['chunk']} {r['tile_rows']} {cfg} {r['num_splits']}: {r['TFLOPs']:.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--rep", type=int, default=50, help="do_bench repetition time (ms)")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU")
    torch.manual_seed(0)
    shape = {"heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": "bfloat16"}
    res: dict = {"env": _env(), "shape": shape}
    res["ceilings"] = _ceilings(args.rep)
    bench = Bench(args.rep)
    copy_gbps, mm = res["ceilings"]["copy_GBps"], res["ceilings"]["matmul_TFLOPs"]
    res["defaults"] = {
        "decode": asdict(pa.DECODE_CONFIG),
        "chunk": asdict(pa.CHUNK_CONFIG),
        "chunk_large_m": asdict(pa.CHUNK_CONFIG_LARGE_M),
        "splits": asdict(attn_splits.SPLITS),
        "decode_splits": asdict(attn_splits.DECODE_SPLITS),
    }
    res["decode"] = run_decode(bench, copy_gbps)
    res["chunks"] = run_chunks(bench, mm)
    res["mixed"] = run_mixed(bench, copy_gbps)
    _write(args.out, res)
    _print_summary(res)
    if args.sweep:
        res["sweep"] = run_sweep(bench, copy_gbps)
        _write(args.out, res)
        _print_sweep(res)


def _write(path: str, res: dict) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
