"""GPU probe: can one resident launch stream a decode invocation's projections faster than
96 few-row GEMM launches?

`layer-kernels.md` puts the c = 1 gap in each kernel: every projection call costs ~3-5 us beyond
its weight bytes over the bandwidth (pipeline fill, the tail of the grid). This probe times the
24 layers' four Ouro-1.4B projections (q/k/v, o, gate/up, down) at one row two ways:

- `skinny`: the engine's few-row GEMM, 96 launches captured in a CUDA graph (early launch on);
- `resident`: one launch of one program per SM (or two) that runs every projection of every
  layer in turn, with a grid-wide barrier after each (an arrival counter in global memory). Two
  kernels: `_resident_kernel` multiplies register tiles, loads each program's first weight tile
  of the next projection before it waits at the barrier, and can pull tiles into the L2 ahead;
  `_resident_dot_kernel` runs the few-row GEMM's arithmetic (`tl.dot`) over one flat loop per
  projection, which the compiler pipelines.

No attention or norms: each projection's input is the previous one's output (cut or padded to
its K), which makes the probe a pure chain of dependent weight streams. The resident kernel is
checked against a torch chain of the same projections before it is timed.

    python -m benchmarks.persistent_probe --out skinny.json
    python -m benchmarks.persistent_probe --variant 32,128,4,2,6,0 --out resident.json

Results and reading: docs/benchmarks/persistent-probe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl

from benchmarks.attention_bench import graph_us
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels.pdl import prefetch_l2
from vllm_rlt.kernels.skinny_gemm import skinny_linear

LAYERS, HIDDEN, INTER, QKV = 24, 2048, 5632, 6144
# (N, K) per projection; each input is the previous output's first K values
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))


@triton.jit
def _tile(
    w_ptr, layer_stride, layer, n_rows, K, blk, kc, ok,
    BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """Pointers and mask of weight tile (blk, kc) of one layer's [n_rows, K] weight (every
    STEP-th column: STEP = LINE for one pointer per 128-byte line)."""
    rows = blk * BN + tl.arange(0, BN)
    cols = kc * BK + tl.arange(0, BK // STEP) * STEP
    base = w_ptr + layer_stride.to(tl.int64) * layer
    ptrs = base + rows.to(tl.int64)[:, None] * K + cols[None, :]
    return ptrs, ok & (rows < n_rows)[:, None] & (cols < K)[None, :]


@triton.jit
def _num_tiles(N, K, pid, P, BN: tl.constexpr, BK: tl.constexpr):
    """Tiles of program `pid` (of P) in a [N, K] weight: its blocks pid, pid + P, ... times the
    K steps of each."""
    return tl.maximum((N // BN - pid + P - 1) // P, 0) * (K // BK)


@triton.jit
def _barrier(bar_ptr, target):
    """Grid-wide barrier: count this program in, wait until `target` programs are counted."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile_of(j, w_ptr, w_stride, layer, N, K, nw_ptr, nw_stride, n_layer, nN, nK, n_ok, pid, P,
             BN: tl.constexpr, BK: tl.constexpr, STEP: tl.constexpr):  # fmt: skip
    """Pointers and mask of this program's j-th tile: of this projection while j < its tiles,
    then of the next projection (when n_ok)."""
    kc_n = K // BK
    total = _num_tiles(N, K, pid, P, BN, BK)
    nkc_n = nK // BK
    jn = tl.maximum(j - total, 0)
    nblk = pid + (jn // nkc_n) * P
    ptrs, mask = _tile(w_ptr, w_stride, layer, N, K, pid + (j // kc_n) * P, j % kc_n,
                       j < total, BN, BK, STEP)  # fmt: skip
    nptrs, nmask = _tile(nw_ptr, nw_stride, n_layer, nN, nK, nblk, jn % nkc_n,
                         n_ok & (j >= total) & (nblk < nN // BN), BN, BK, STEP)  # fmt: skip
    return tl.where(j < total, ptrs, nptrs), mask | nmask


@triton.jit
def _phase(
    w_ptr, w_stride, layer, N, K, x_ptr, y_ptr, nw_ptr, nw_stride, n_layer, nN, nK, n_ok,
    w_tile, pid, P, BN: tl.constexpr, BK: tl.constexpr, PD: tl.constexpr, LOADED: tl.constexpr,
    LINE: tl.constexpr,
):  # fmt: skip
    """y = W x for this program's blocks (pid, pid + P, ...). With LOADED, w_tile holds its
    first tile (loaded earlier); returns its first tile of the next projection (nw_ptr,
    n_layer) when n_ok. PD > 0: also pull the tile PD ahead into the L2 (into the next
    projection's first tiles near the end)."""
    kc_n = K // BK
    total = _num_tiles(N, K, pid, P, BN, BK)
    args = (w_ptr, w_stride, layer, N, K, nw_ptr, nw_stride, n_layer, nN, nK, n_ok, pid, P)
    if not LOADED:
        ptrs, mask = _tile_of(0, *args, BN, BK, 1)
        w_tile = tl.load(ptrs, mask=mask, other=0.0)
    for j in tl.static_range(1, PD):
        lines, lmask = _tile_of(j, *args, BN, BK, LINE)
        prefetch_l2(tl.where(lmask, lines, w_ptr))
    acc = tl.zeros([BN, BK], tl.float32)
    if total == 0:  # nothing to do here: only the next projection's first tile
        ptrs, mask = _tile_of(0, *args, BN, BK, 1)
        w_tile = tl.load(ptrs, mask=mask & LOADED, other=0.0)
    for it in range(0, total):
        kc = it % kc_n
        blk = pid + (it // kc_n) * P
        ptrs, mask = _tile_of(it + 1, *args, BN, BK, 1)
        nxt = tl.load(ptrs, mask=mask & (LOADED | (it + 1 < total)), other=0.0)
        if PD > 0:
            lines, lmask = _tile_of(it + PD, *args, BN, BK, LINE)
            prefetch_l2(tl.where(lmask, lines, w_ptr))
        xk = tl.load(x_ptr + kc * BK + tl.arange(0, BK), cache_modifier=".cg").to(tl.float32)
        acc += w_tile.to(tl.float32) * xk[None, :]
        if kc == kc_n - 1:
            rows = blk * BN + tl.arange(0, BN)
            tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))
            acc = tl.zeros([BN, BK], tl.float32)
        w_tile = nxt
    return w_tile


@triton.jit
def _phase_dot(w_ptr, w_stride, layer, N, K, x_ptr, y_ptr, pid, P, BN: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    """y = W x as the few-row GEMM computes it (x padded to 16 rows, tl.dot), over one flat
    loop of (block, K step) that the compiler pipelines across blocks."""
    kc_n = K // BK
    total = _num_tiles(N, K, pid, P, BN, BK)
    offs_m = tl.arange(0, 16)
    acc = tl.zeros([16, BN], tl.float32)
    for it in range(0, total):
        kc = it % kc_n
        blk = pid + (it // kc_n) * P
        cols = kc * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * 0 + cols[None, :], mask=(offs_m < 1)[:, None],
                    other=0.0, cache_modifier=".cg")  # fmt: skip
        ptrs, mask = _tile(w_ptr, w_stride, layer, N, K, blk, kc, True, BN, BK, 1)
        w = tl.load(ptrs, mask=mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if kc == kc_n - 1:
            rows = blk * BN + tl.arange(0, BN)
            out = y_ptr + offs_m[:, None] * 0 + rows[None, :]
            tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < 1)[:, None])
            acc = tl.zeros([16, BN], tl.float32)


@triton.jit
def _resident_dot_kernel(
    x_ptr, a_ptr, b_ptr, w0, w1, w2, w3, bar_ptr, n_layers,
    N0, K0, N1, K1, N2, K2, N3, K3, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """`_resident_kernel`'s chain with `_phase_dot` (no loads ahead of the barriers)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    ws, ns, ks = (w0, w1, w2, w3), (N0, N1, N2, N3), (K0, K1, K2, K3)
    srcs, dsts = (x_ptr, a_ptr, b_ptr, a_ptr), (a_ptr, b_ptr, a_ptr, x_ptr)
    for layer in range(0, n_layers):
        for p in tl.static_range(4):
            _phase_dot(ws[p], ns[p] * ks[p], layer, ns[p], ks[p], srcs[p], dsts[p], pid, P, BN, BK)
            _barrier(bar_ptr, (layer * 4 + p + 1) * P)
    _count_out(bar_ptr, P)


@triton.jit
def _count_out(bar_ptr, P):
    """Every program is past the last barrier once all have counted out: the last one out
    zeroes both counters for the next launch."""
    tl.debug_barrier()
    out = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if out == P - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


@triton.jit
def _resident_kernel(
    x_ptr, a_ptr, b_ptr, w0, w1, w2, w3, bar_ptr, n_layers,
    N0, K0, N1, K1, N2, K2, N3, K3, PREFETCH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PD: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    """x -> (q/k/v) a -> (o) b -> (gate/up) a -> (down) x, per layer; barrier after each."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    yes = pid >= 0
    ws, ns, ks = (w0, w1, w2, w3), (N0, N1, N2, N3), (K0, K1, K2, K3)
    ss = (N0 * K0, N1 * K1, N2 * K2, N3 * K3)
    srcs, dsts = (x_ptr, a_ptr, b_ptr, a_ptr), (a_ptr, b_ptr, a_ptr, x_ptr)
    ptrs, mask = _tile(w0, ss[0], 0, N0, K0, pid, 0, yes, BN, BK, 1)
    w_tile = tl.load(ptrs, mask=mask, other=0.0)
    for layer in range(0, n_layers):
        for p in tl.static_range(4):
            # the next projection ((p + 1) % 4): of the next layer after down
            n_layer = layer + (p == 3)
            n_ok = yes & (n_layer < n_layers)
            w_tile = _phase(ws[p], ss[p], layer, ns[p], ks[p], srcs[p], dsts[p],
                            ws[(p + 1) % 4], ss[(p + 1) % 4], n_layer, ns[(p + 1) % 4],
                            ks[(p + 1) % 4], n_ok, w_tile, pid, P, BN, BK, PD, PREFETCH == 1,
                            LINE)  # fmt: skip
            _barrier(bar_ptr, (layer * 4 + p + 1) * P)
    _count_out(bar_ptr, P)


def resident(x, a, b, weights, bar, programs, prefetch, bn, bk, warps, pd, barriers_only=False):
    """prefetch: 0 or 1 (`_resident_kernel`), or 2 + S: `_resident_dot_kernel`, S stages."""
    shapes = [0 if barriers_only and i % 2 == 0 else s
              for i, s in enumerate(s for w in weights for s in w.shape[1:])]  # fmt: skip
    if prefetch >= 2:
        _resident_dot_kernel[(programs,)](
            x, a, b, *weights, bar, weights[0].shape[0], *shapes, BN=bn, BK=bk,
            num_warps=warps, num_stages=prefetch - 2,
        )  # fmt: skip
        return
    _resident_kernel[(programs,)](
        x, a, b, *weights, bar, weights[0].shape[0], *shapes,
        PREFETCH=prefetch, BN=bn, BK=bk, PD=pd, LINE=64, num_warps=warps,
    )  # fmt: skip


def torch_chain(x, weights):
    """The resident kernel's chain from x, in fp32 with each output rounded to x's dtype; each
    projection reads the first K values of the one before (K: its weight's last dimension)."""
    q, o, gate_up, down = weights

    def proj(w, v):
        return (w.float() @ v[: w.shape[1]].float()).to(x.dtype)

    for layer in range(q.shape[0]):
        x = proj(down[layer], proj(gate_up[layer], proj(o[layer], proj(q[layer], x))))
    return x


def skinny_calls(x1, weights):
    """The same chain on the few-row GEMM: 4 launches per layer (inputs cut by views)."""
    calls = []
    bufs = {"x": x1}

    def step(layer, p, src, dst, k):
        def call():
            bufs[dst] = skinny_linear(bufs[src][:, :k], weights[p][layer])

        return call

    for layer in range(LAYERS):
        calls += [step(layer, 0, "x", "a", HIDDEN), step(layer, 1, "a", "b", HIDDEN),
                  step(layer, 2, "b", "a", HIDDEN), step(layer, 3, "a", "x", INTER)]  # fmt: skip
    return calls


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--variant", default=None, help="bn,bk,warps,programs_per_sm,prefetch,pd")
    ap.add_argument("--barriers-only", action="store_true", help="no weight rows: barriers alone")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    weights = [torch.randn(LAYERS, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for n, k in SHAPES]  # fmt: skip
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(INTER, device="cuda", dtype=torch.bfloat16)
    a = torch.zeros(2 * INTER, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(2 * INTER, device="cuda", dtype=torch.bfloat16)
    bar = torch.zeros(2, device="cuda", dtype=torch.int32)
    result = {"commit": commit(), "engine_sha256": engine_digest(), "weight_bytes": nbytes,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "sms": sms, "rows": []}  # fmt: skip
    if args.variant is None:
        us = graph_us(skinny_calls(x[None, :HIDDEN].clone(), weights), args.rep) * len(SHAPES)
        result["rows"].append({"path": "skinny", "us_per_layer": us, "invocation_us": us * LAYERS})
    else:
        bn, bk, warps, pps, prefetch, pd = (int(v) for v in args.variant.split(","))
        cfg = (sms * pps, prefetch, bn, bk, warps, pd)
        err = None
        if not args.barriers_only:
            ref = torch_chain(x, [w[:2] for w in weights])
            resident(x, a, b, [w[:2] for w in weights], bar, *cfg)
            err = ((x[:HIDDEN].float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert err < 2e-2, f"resident chain differs from torch: rel err {err}"
            assert bar.tolist() == [0, 0], f"barrier counters not reset: {bar.tolist()}"
        call = [lambda: resident(x, a, b, weights, bar, *cfg, barriers_only=args.barriers_only)]
        us = graph_us(call, args.rep)
        result["rows"].append({"path": "resident", "bn": bn, "bk": bk, "warps": warps,
                               "programs_per_sm": pps, "prefetch": prefetch, "l2_ahead": pd,
                               "barriers_only": args.barriers_only, "rel_err": err,
                               "us_per_layer": us / LAYERS, "invocation_us": us})  # fmt: skip
    for row in result["rows"]:
        row["share_of_4250_gbs"] = nbytes / (row["invocation_us"] * 1e-6) / 4250e9
        print(json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
