"""Compile the Triton kernels of representative launches for an sm_90 GPU on a machine without
one: every launch the wrappers below make is recorded instead of run, then compiled to PTX and
a cubin for compute capability 9.0 (Triton's bundled ptxas), early launch (`GDC`) on. The
interpreter runs the kernels' arithmetic on the CPU; this catches what only the GPU compiler
rejects. Run without TRITON_INTERPRET (`test_sm90_compile.py` starts it); prints one line per
kernel instance."""

from __future__ import annotations

import os

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def record_launches(scenario) -> list[tuple[JITFunction, tuple, dict]]:
    """The (kernel, args, kwargs) of every launch `scenario()` makes, none of them run."""
    launches, run = [], JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs)
    )
    try:
        scenario()
    finally:
        JITFunction.run = run
    return launches


def compile_sm90(fn: JITFunction, args: tuple, kwargs: dict) -> str:
    """The PTX of `fn` compiled for sm_90 at these launch arguments (GDC forced on)."""
    signature, constexprs = {}, {}
    for i, p in enumerate(fn.params):
        value = args[i] if i < len(args) else kwargs.get(p.name, p.default)
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = True if p.name == "GDC" else value
        else:
            signature[p.name] = mangle_type(value)
    options = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def scenario() -> None:
    """One call of each kernel wrapper, in the shapes and modes whose kernels differ."""
    from vllm_rlt.attention.metadata import TILE_ROWS, build_attention_metadata
    from vllm_rlt.kernels import fused_ops, interleaved_rope, invariant_gemm, kv_write, skinny_gemm
    from vllm_rlt.kernels import paged_attention as pa
    from vllm_rlt.kernels.kv_format import FP8, KVLayer
    from vllm_rlt.models.layers import RotaryEmbedding

    bf, rows, d = torch.bfloat16, 4, 128

    def randn(*shape, dtype=bf):
        return torch.randn(*shape).to(dtype)

    x, w = randn(rows, 256), randn(256)
    fused_ops.rms_norm(x, w, 1e-6)
    fused_ops.add_rms_norm(x, x.clone(), w, 1e-6, w, 1e-6)
    fused_ops.silu_mul(randn(rows, 512))
    fused_ops.gate_logits(x, randn(1, 256), randn(1))
    caches = {dt: KVLayer(torch.zeros(16, 4, 2, d, dtype=dt), torch.zeros(16, 4, 2, d, dtype=dt),
                          *((0.5, 2.0) if dt == FP8 else (1.0, 1.0)))
              for dt in (bf, FP8)}  # fmt: skip
    slots = torch.arange(rows)
    cos, sin = RotaryEmbedding(d, 64, 1e4).tables(torch.arange(rows), bf)
    for kv in (None, (caches[bf], slots), (caches[FP8], slots)):
        fused_ops.rope_qk_(randn(rows, 8 * d), cos, sin, 4, 2, d, kv=kv)
        skinny_gemm.skinny_qkv_rope(randn(rows, 256), randn(8 * d, 256), cos, sin, 4, 2, d, kv=kv)
    kv_write.write_kv_cache(randn(rows, 2, d), randn(rows, 2, d), caches[FP8], slots)
    table = torch.rand(rows, 1, d // 2, 2)
    interleaved_rope.bias_rope_(randn(rows, 6 * d), randn(2, 1, 2, d), table, 2, d,
                                kv=(caches[bf], slots))  # fmt: skip
    split = skinny_gemm.SkinnyConfig(programs_per_sm=64)
    skinny_gemm.skinny_linear(randn(rows, 1024), randn(256, 1024), split)
    skinny_gemm.skinny_linear(randn(20, 256), randn(256, 256))
    skinny_gemm.skinny_swiglu(randn(rows, 256), randn(512, 256))
    invariant_gemm.invariant_linear(randn(rows, 256), randn(256, 256))
    # decode rows (bf16; FP8 in KV splits, with the combine), then a decode row beside a 64-row
    # prefill chunk (one launch of both tile classes; batch-invariant)
    decode = build_attention_metadata([40, 7, 63, 12], [1] * 4, [[0, 1, 2, 3]] * 4, 16, "cpu",
                                      TILE_ROWS)  # fmt: skip
    mixed = build_attention_metadata([40, 0], [1, 64], [[0, 1, 2, 3]] * 2, 16, "cpu", TILE_ROWS)
    paged = {dt: KVLayer(c.k.view(-1, 16, 2, d), c.v.view(-1, 16, 2, d), *c[2:])
             for dt, c in caches.items()}  # fmt: skip
    pa.paged_attention(randn(rows, 4, d), paged[bf], decode)
    pa.paged_attention(randn(rows, 4, d), paged[FP8], decode, num_splits=2)
    pa.paged_attention(randn(65, 4, d), paged[bf], mixed)
    pa.paged_attention(randn(65, 4, d), paged[bf], mixed, invariant=True)
    run_bookkeeping()


def run_bookkeeping() -> None:
    """Device runs' kernels (`run_rows`): enter, exit in every mode, the LAST_EXITED fill over
    an FP8 cache, take, and take with lanes."""
    from vllm_rlt.kernels import run_rows
    from vllm_rlt.kernels.kv_format import FP8
    from vllm_rlt.worker.kv_cache import DeviceKVCache
    from vllm_rlt.worker.run_state import RunState

    rows, hidden, vocab, planes, blocks = 4, 64, 32, 4, 6
    s = RunState(8, 8, vocab, planes, blocks, hidden, torch.bfloat16, "cpu", lanes=2)
    buffer, out = torch.zeros(12, hidden, dtype=torch.bfloat16), torch.zeros(rows, hidden)
    run_rows.enter_rows(s, rows, out.to(torch.bfloat16), buffer, 0, 4)
    for mode in run_rows.EXIT_MODES:
        run_rows.exit_rows(s, rows, mode, torch.zeros(rows), out.to(torch.bfloat16), buffer)
    run_rows.fill_skipped(s, rows, DeviceKVCache(2, 96, 4, 2, 8, FP8, "cpu"))
    tokens = torch.zeros(rows, dtype=torch.int64)
    run_rows.take_tokens(s, rows, tokens, torch.zeros(12, 3, dtype=torch.int64))
    run_rows.take_lanes(s, 2, 2, 1, tokens)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the kernels must be JIT functions")
    seen = set()
    for fn, args, kwargs in record_launches(scenario):
        ptx = compile_sm90(fn, args, kwargs)
        key = (fn.__name__, len(ptx))
        if key not in seen:
            seen.add(key)
            print(f"{fn.__name__} {len(ptx)} {ptx.count('griddepcontrol')}", flush=True)


if __name__ == "__main__":
    main()
