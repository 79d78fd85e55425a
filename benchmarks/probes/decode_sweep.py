"""GPU sweep behind the decode-step kernel defaults: the few-row GEMM's launch configs per Ouro-1.4B
projection, and the attention's KV split length and launch configs at the contexts the WCPB
matrix decodes at.

GEMM: each projection weight [N, K] exists in 24 copies (one per layer, so the L2 holds none
of them); a CUDA graph calls the GEMM once per copy and its replay time over 24 is the time per
call, beside cuBLAS (`torch.nn.functional.linear`) and the weight bytes over the copy bandwidth
of the same run (`--gemm-grid` picks the skinny configs: the full grid, a small one, or the
default alone), and the q/k/v and gate/up projections also with the element-wise op after them
(RoPE, SwiGLU's activation): separate launches against the few-row GEMM's epilogues.
Attention: decode rows at one context, fixed split counts (a split covers ceil(context / S),
aligned to the KV step) against the automatic choice under a CUDA graph sized for a
65536-position context (what `paged_attention` picks when `num_splits` is None and
`meta.max_context` is the graph's); `--attention-configs` times decode launch configs at that
automatic choice, or at the count another split policy would give (`--config-policies`).

    python -m benchmarks.probes.decode_sweep --out decode-sweep.json
    python -m benchmarks.probes.decode_sweep --skip-gemm --skip-attention --attention-configs \
        --out c.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F

from benchmarks.model_shapes import OURO_1_4B
from benchmarks.probes.attention_bench import Bench, _ceilings, _env, _kv_bytes, graph_us
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels.attention_splits import DECODE_SPLITS, SPLITS, choose_num_splits
from vllm_rlt.kernels.device_info import sm_count
from vllm_rlt.kernels.fused_ops import rope_qk_, silu_mul
from vllm_rlt.kernels.paged_attention import DECODE_CONFIG, LaunchConfig
from vllm_rlt.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_qkv_rope, skinny_swiglu
from vllm_rlt.models.layers import RotaryEmbedding

COPIES = 24
GRAPH_MAX_CONTEXT = OURO_1_4B["max_position_embeddings"]
SKINNY_GRIDS = {
    "full": {
        "block_n": (16, 32, 64),
        "block_k": (128, 256),
        "num_warps": (4, 8),
        "num_stages": (3, 5),
        "programs_per_sm": (1, 2, 4),
    },
    "small": {"block_n": (32, 64), "num_stages": (3, 4), "programs_per_sm": (1, 2)},
    "default": {},
}


def projections() -> dict[str, tuple[int, int]]:
    """(N, K) of Ouro-1.4B's four projections (fused qkv and gate|up)."""
    c = OURO_1_4B
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, c["num_attention_heads"] * d), "gate_up": (2 * inter, h),
            "down": (h, inter)}  # fmt: skip


def _configs(grid: dict[str, tuple[int, ...]]) -> list[SkinnyConfig]:
    keys, values = list(grid), itertools.product(*grid.values())
    return [SkinnyConfig(**dict(zip(keys, v, strict=True))) for v in values]


def _best(results: list[dict], **where) -> dict:
    chosen = (r for r in results if all(r[k] == v for k, v in where.items()))
    return min(chosen, key=lambda r: r["us"])


def _with_epilogue(name: str, x: torch.Tensor) -> dict[str, Callable]:
    """The projection followed by the element-wise op after it in the layer (SwiGLU's activation,
    RoPE), as separate launches (cuBLAS or the few-row GEMM, then `fused_ops`) and as the few-row
    GEMM's epilogue; weight -> output."""
    c, m = OURO_1_4B, x.shape[0]
    if name == "gate_up":
        return {
            "cublas+silu_mul": lambda w: silu_mul(F.linear(x, w)),
            "skinny+silu_mul": lambda w: silu_mul(skinny_linear(x, w)),
            "skinny_swiglu": lambda w: skinny_swiglu(x, w),
        }
    if name != "qkv":
        return {}
    heads = (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    rotary = RotaryEmbedding(c["head_dim"], 1024, c["rope_theta"]).cuda()
    rope = rotary.tables(torch.arange(500, 500 + m, device="cuda"), x.dtype)
    return {
        "cublas+rope": lambda w: rope_qk_(F.linear(x, w), *rope, *heads),
        "skinny+rope": lambda w: rope_qk_(skinny_linear(x, w), *rope, *heads),
        "skinny_qkv_rope": lambda w: skinny_qkv_rope(x, w, *rope, *heads),
    }


def sweep_gemm(rows: list[int], copy_gbps: float, rep: int, grid: str) -> list[dict]:
    out = []
    for name, (n, k) in projections().items():
        weights = torch.randn(COPIES, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        floor_us = n * k * 2 / copy_gbps / 1e3
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            case = {"projection": name, "n": n, "k": k, "rows": m, "floor_us": floor_us}
            configs = [("skinny", c) for c in _configs(SKINNY_GRIDS[grid])]
            for kernel, cfg in [("cublas", None), *configs]:
                args = (F.linear, x) if cfg is None else (skinny_linear, x)
                calls = [functools.partial(*args, w, *([cfg] if cfg else [])) for w in weights]
                us = graph_us(calls, rep)
                out.append({**case, "kernel": kernel, "config": cfg and asdict(cfg), "us": us,
                            "frac_of_copy": floor_us / us})  # fmt: skip
            for kernel, call in _with_epilogue(name, x).items():
                us = graph_us([functools.partial(call, w) for w in weights], rep)
                out.append({**case, "kernel": kernel, "config": None, "us": us,
                            "frac_of_copy": floor_us / us})  # fmt: skip
                print(f"{name:>12} rows {m:2d}: {kernel} {us:.1f} us", flush=True)
            best = _best(out, projection=name, rows=m)
            share = f"{best['frac_of_copy']:.0%}"
            print(f"{name:>12} rows {m:2d}: best {best['kernel']} {best['config']} "
                  f"{best['us']:.1f} us ({share} of copy)", flush=True)  # fmt: skip
        del weights
    return out


def sweep_attention(rep: int, copy_gbps: float) -> list[dict]:
    bench, out = Bench(rep), []
    for ctx, rows in itertools.product((512, 768, 1024), (1, 2, 4, 8, 16, 32)):
        segs = [(ctx - 1, 1)] * rows
        sets = bench.cases(segs, max_sets=8)
        graph_sets = [(replace(m, max_context=GRAPH_MAX_CONTEXT), q, k, v) for m, q, k, v in sets]
        for splits in ("auto", 1, 2, 3, 4, 6, 8):
            if splits == "auto":
                t = bench.attention(graph_sets, False)
            else:
                t = bench.attention(sets, False, num_splits=splits)
            us = t["graph_us"]
            out.append({"context": ctx, "rows": rows, "num_splits": splits, "us": us,
                        "frac_of_copy": _kv_bytes(segs) / us / 1e3 / copy_gbps})  # fmt: skip
        auto, best = out[-7], _best(out, context=ctx, rows=rows)
        print(f"attention ctx {ctx} rows {rows:2d}: auto {auto['us']:.1f} us, best "
              f"{best['num_splits']} splits {best['us']:.1f} us", flush=True)  # fmt: skip
    return out


ATTENTION_CONFIGS = [
    LaunchConfig(block_n, warps, stages, use_dot)
    for block_n, warps, stages, use_dot in itertools.product(
        (32, 64, 128), (4, 8), (2, 3, 4), (True, False)
    )
    if use_dot or block_n <= 64
]


# Split policies of a config sweep: "auto", the engine's choice; "fine" and "general", the split
# count of the decode or the general policy forced on every launch (exact for "fine": its min_len
# is the KV step that explicit counts get; "general" splits evenly where the engine's pieces are
# >= 256 positions)
POLICIES = {"auto": None, "fine": DECODE_SPLITS, "general": SPLITS}


def sweep_attention_configs(
    rep: int, copy_gbps: float, contexts: list[int], rows_list: list[int], policies: list[str]
) -> list[dict]:
    """Decode launch configs at the split count of each policy for a graph-sized grid."""
    bench, out = Bench(rep), []
    heads = OURO_1_4B["num_key_value_heads"]
    for ctx, rows, name in itertools.product(contexts, rows_list, policies):
        segs = [(ctx - 1, 1)] * rows
        sets = bench.cases(segs, max_sets=8)
        graph_sets = [(replace(m, max_context=GRAPH_MAX_CONTEXT), q, k, v) for m, q, k, v in sets]
        policy, splits = POLICIES[name], None
        if policy is not None:  # the count this policy gives the grid (its min_len is the step)
            num_sms = sm_count(torch.device("cuda"))
            splits = choose_num_splits(rows * heads, GRAPH_MAX_CONTEXT, num_sms, policy)
        for cfg in ATTENTION_CONFIGS:
            kw = {"decode_config": cfg, "num_splits": splits}
            us = bench.attention(graph_sets, False, **kw)["graph_us"]
            out.append({"context": ctx, "rows": rows, "policy": name, "num_splits": splits,
                        "config": asdict(cfg), "us": us,
                        "frac_of_copy": _kv_bytes(segs) / us / 1e3 / copy_gbps})  # fmt: skip
        default = next(
            r for r in out[-len(ATTENTION_CONFIGS) :] if r["config"] == asdict(DECODE_CONFIG)
        )
        best = _best(out, context=ctx, rows=rows, policy=name)
        print(f"decode config ctx {ctx} rows {rows:2d} policy {name}: default "
              f"{default['us']:.1f} us, best {best['config']} {best['us']:.1f} us",
              flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rep", type=int, default=30, help="do_bench repetition time (ms)")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--gemm-grid", choices=sorted(SKINNY_GRIDS), default="full")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--attention-configs", action="store_true", help="also sweep decode configs")
    p.add_argument("--config-contexts", type=int, nargs="+", default=[512, 768])
    p.add_argument("--config-rows", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--config-policies", nargs="+", choices=sorted(POLICIES), default=["auto"])
    args = p.parse_args(argv)
    ceilings = _ceilings(args.rep)
    res = {"env": _env(), "ceilings": ceilings, "command": sys.argv, "commit": commit(),
           "engine_sha256": engine_digest()}  # fmt: skip
    copy_gbps = ceilings["copy_GBps"]
    if not args.skip_attention:
        res["attention"] = sweep_attention(args.rep, copy_gbps)
        _write(args.out, res)
    if args.attention_configs:
        res["attention_configs"] = sweep_attention_configs(
            args.rep, copy_gbps, args.config_contexts, args.config_rows, args.config_policies
        )
        _write(args.out, res)
    if not args.skip_gemm:
        res["gemm"] = sweep_gemm(args.rows, copy_gbps, args.rep, args.gemm_grid)
        _write(args.out, res)


def _write(path: str, res: dict) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
