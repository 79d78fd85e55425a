"""GPU time of a decode invocation in one launch: Ouro-1.4B's 24 layers of projections (q/k/v, o,
gate/up, down; distinct weights), sandwich norms and attention (each row's q over a cache of
`--context` positions; no RoPE or KV write) at R rows. The persistent kernel of
`persistent_chain.cu` (one cooperative launch, one block per SM, a ring of weight tiles that runs
ahead across its grid barriers; after a barrier the blocks share the attention's pieces and
merges, and each builds its next input: the norms, SwiGLU's activation) against the engine's
separate launches: the few-row GEMM with its SwiGLU epilogue, paged attention and the Triton
norms, or cuBLAS with them. Every variant is captured in a CUDA graph and replayed; the weight
bytes over the time give the bandwidth. The persistent outputs are checked step by step against
torch in fp32 over the same inputs. What this tests: whether one launch that keeps the weight
stream going removes the fixed cost per kernel that separate launches pay
(docs/design/runner.md §4). Needs Hopper or later and a CUDA toolkit (built like the native
kernels, `vllm_rlt/kernels/native.py`).

    python -m benchmarks.probes.persistent_chain --rows 1 4 8 --context 512 --out chain.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.model_shapes import OURO_1_4B
from benchmarks.probes.attention_bench import _env
from benchmarks.probes.layer_kernels import time_ms
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.attention.metadata import build_attention_metadata
from vllm_rlt.kernels import fused_ops, native
from vllm_rlt.kernels.kv_format import KVLayer
from vllm_rlt.kernels.paged_attention import paged_attention
from vllm_rlt.kernels.skinny_gemm import skinny_linear, skinny_swiglu

SOURCE = Path(__file__).with_name("persistent_chain.cu")
SLICE, SWIGLU, ADD_NORM, NORM, ATTEND = range(5)  # how a projection's x is built (kernel's Mode)
HEAD_DIM, BLOCK_SIZE = 128, 16  # the kernel's attention heads; the engine's KV block
NORM_MAX = 2048  # widest row the kernel's norms take (one 8-column slice per thread)


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """`vrlt_persistent_chain`'s signature."""
    ptr, i = ctypes.c_void_p, ctypes.c_int
    library.vrlt_persistent_chain.argtypes = [ptr, ptr, ptr, ptr, ptr, i, ctypes.c_float, i, i,
                                              i, i, i, i, ptr]  # fmt: skip
    library.vrlt_persistent_chain.restype = ctypes.c_int
    return library


def layer_plan(config: dict, layers: int) -> list[tuple[int, int, int]]:
    """(N, K, mode) of the projections of `layers` Ouro layers, in order."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads = config["num_attention_heads"]
    qkv = (heads + 2 * config["num_key_value_heads"]) * d
    plan = []
    for layer in range(layers):
        plan += [(qkv, h, NORM if layer == 0 else ADD_NORM), (h, heads * d, ATTEND),
                 (2 * i, h, ADD_NORM), (h, i, SWIGLU)]  # fmt: skip
    return plan


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


class Chain:
    """One chain's weights, norms, residual buffers and outputs, and the tables the kernel
    reads; `run` launches it, `max_rel_err` checks it."""

    def __init__(self, weights, modes, norms_a, norms_b, h0: torch.Tensor, eps: float,
                 caches: list[tuple[torch.Tensor, torch.Tensor] | None], pieces: int):  # fmt: skip
        device, rows = h0.device, h0.shape[0]
        heads, ctx = next((kc.shape[2], kc.shape[1]) for kc, _ in filter(None, caches))
        for p, (w, mode) in enumerate(zip(weights, modes, strict=True)):
            n, k = w.shape
            before = weights[p - 1].shape[0] if p else 0
            fits = {
                SLICE: k <= before,
                SWIGLU: 2 * k == before,
                NORM: p == 0,
                ADD_NORM: p > 0 and k == before == h0.shape[1],
                ATTEND: k == heads * HEAD_DIM <= before and ctx % BLOCK_SIZE == 0,
            }[mode]
            norm_fits = mode not in (NORM, ADD_NORM) or k <= NORM_MAX
            if not (fits and norm_fits) or n % 8 or k % 8 or (mode == NORM and k != h0.shape[1]):
                raise ValueError(f"projection {p} ({n} x {k}, mode {mode}) does not chain")
        self.weights, self.modes, self.eps, self.h0 = weights, modes, eps, h0
        self.norms_a, self.norms_b, self.caches = norms_a, norms_b, caches
        self.heads, self.ctx, self.pieces = heads, ctx, pieces
        self.parts = [torch.zeros(rows * heads * pieces * (HEAD_DIM + 2), device=device)
                      if cache else None for cache in caches]  # fmt: skip
        self.attn = [torch.zeros(rows, heads * HEAD_DIM, device=device, dtype=h0.dtype)
                     if cache else None for cache in caches]  # fmt: skip
        # the same caches as the engine's paged layout (blocks of 16 positions, a row's in a run)
        blocks = ctx // BLOCK_SIZE
        tables = [[r * blocks + j for j in range(blocks)] for r in range(rows)]
        self.meta = build_attention_metadata([ctx - 1] * rows, [1] * rows, tables, BLOCK_SIZE,
                                             device)  # fmt: skip
        self.paged = [KVLayer(*(t.view(-1, BLOCK_SIZE, heads, HEAD_DIM) for t in cache))
                      if cache else None for cache in caches]  # fmt: skip
        self.ys = [torch.zeros(rows, w.shape[0], device=device, dtype=h0.dtype) for w in weights]
        self.h_in, self.h_out, h = [], [], h0
        for mode in modes:
            self.h_in.append(h if mode in (ADD_NORM, NORM) else None)
            if mode == ADD_NORM:
                h = torch.zeros_like(h0)
            self.h_out.append(h if mode == ADD_NORM else None)
        k_caches = [cache[0] if cache else None for cache in caches]
        v_caches = [cache[1] if cache else None for cache in caches]
        columns = [weights, self.ys, self.h_in, self.h_out, norms_a, norms_b, k_caches, v_caches,
                   self.parts, self.attn]  # fmt: skip
        self.tables = torch.tensor(
            [[t.data_ptr() if t is not None else 0 for t in col] for col in columns], device=device
        )
        pointers = (row.data_ptr() for row in self.tables)
        self.rows_of_tables = (ctypes.c_void_p * len(columns))(*pointers)
        self.n = torch.tensor([w.shape[0] for w in weights], device=device, dtype=torch.int32)
        self.k = torch.tensor([w.shape[1] for w in weights], device=device, dtype=torch.int32)
        self.mode = torch.tensor(modes, device=device, dtype=torch.int32)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)

    def run(self, library: ctypes.CDLL, blocks: int) -> None:
        """One launch on the current stream (a capture's, inside a CUDA graph capture)."""
        self.counter.zero_()
        cuda = self.h0.is_cuda
        stream = torch.cuda.current_stream(self.h0.device).cuda_stream if cuda else None
        max_k = max(w.shape[1] for w in self.weights)
        err = library.vrlt_persistent_chain(
            self.rows_of_tables, self.n.data_ptr(), self.k.data_ptr(), self.mode.data_ptr(),
            self.counter.data_ptr(), len(self.weights), self.eps, self.heads, self.ctx,
            self.pieces, max_k, self.h0.shape[0], blocks, stream,
        )  # fmt: skip
        if err:
            raise RuntimeError(f"persistent chain: CUDA error {err}")

    def max_rel_err(self) -> float:
        """Each step against torch in fp32 over the kernel's own inputs to it: the residual
        after each sandwich step, and each projection's output."""
        worst = 0.0

        def err(got: torch.Tensor, ref: torch.Tensor) -> float:
            return ((got.float() - ref).abs().max() / ref.abs().max()).item()

        for p, (w, mode) in enumerate(zip(self.weights, self.modes, strict=True)):
            k = w.shape[1]
            y = self.ys[p - 1].float() if p else None
            if mode == SLICE:
                x = y[:, :k]
            elif mode == ATTEND:
                kc, vc = (t.float() for t in self.caches[p])  # [R, ctx, heads, d]
                q = y[:, :k].view(-1, self.heads, HEAD_DIM)
                scores = torch.einsum("rhd,rchd->rhc", q, kc) * HEAD_DIM**-0.5
                ref = torch.einsum("rhc,rchd->rhd", scores.softmax(-1), vc).reshape(-1, k)
                worst = max(worst, err(self.attn[p], ref))
                x = self.attn[p].float()
            elif mode == SWIGLU:
                x = F.silu(y[:, :k]) * y[:, k:]
            else:
                h = self.h_in[p].float()
                if mode == ADD_NORM:
                    ref_h = h + _rms(y, self.norms_a[p], self.eps)
                    worst = max(worst, err(self.h_out[p], ref_h))
                    h = self.h_out[p].float()
                x = _rms(h, self.norms_b[p], self.eps)
            worst = max(worst, err(self.ys[p], x @ w.float().T))
        return worst


def separate(chain: Chain, skinny: bool) -> torch.Tensor:
    """The chain in the engine's separate launches: projections on the few-row GEMM (SwiGLU in
    the gate/up launch) or cuBLAS (a separate SwiGLU launch), paged attention, the Triton
    norms."""
    modes, eps = chain.modes + [None], chain.eps
    h = chain.h0
    x = fused_ops.rms_norm(h, chain.norms_b[0], eps)
    for p, w in enumerate(chain.weights):
        after = modes[p + 1]
        if after == SWIGLU:
            x = skinny_swiglu(x, w) if skinny else fused_ops.silu_mul(F.linear(x, w))
            continue
        y = skinny_linear(x, w) if skinny else F.linear(x, w)
        if after == SLICE:
            x = y[:, : chain.weights[p + 1].shape[1]]
        elif after == ATTEND:
            q = y[:, : chain.weights[p + 1].shape[1]].view(-1, chain.heads, HEAD_DIM)
            x = paged_attention(q, chain.paged[p + 1], chain.meta).view(q.shape[0], -1)
        elif after == ADD_NORM:
            h, x = fused_ops.add_rms_norm(h, y, chain.norms_a[p + 1], eps,
                                          chain.norms_b[p + 1], eps)  # fmt: skip
    return y


def graph_us(fn, reps: int = 20) -> tuple[float, bool]:
    """(us per call of `fn` replayed in a CUDA graph, True); (us per eager call, False) where
    the capture fails."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
        run, captured = graph.replay, True
    except RuntimeError as err:
        print(f"capture failed ({err}); timing eager calls", flush=True)
        torch.cuda.synchronize()
        run, captured = fn, False
    run()
    return time_ms(run, reps) * 1e3, captured


def random_chain(
    plan,
    rows: int,
    heads: int,
    ctx: int,
    pieces: int,
    device,
    gen: torch.Generator,
    eps: float = 1e-6,
) -> Chain:
    """Random weights (scaled by 1/sqrt(K)), norms about 1, KV caches of `ctx` positions and
    `heads` heads, and residual stream for `plan`."""

    def norm_weight(k: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(k, device=device, generator=gen)).bfloat16()

    weights = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
               for n, k, _ in plan]  # fmt: skip
    modes = [mode for _, _, mode in plan]
    norms_a = [norm_weight(k) if m == ADD_NORM else None for _, k, m in plan]
    norms_b = [norm_weight(k) if m in (ADD_NORM, NORM) else None for _, k, m in plan]
    h0 = torch.randn(rows, plan[0][1], device=device, generator=gen).bfloat16()
    shape = (rows, ctx, heads, HEAD_DIM)
    caches = [tuple(torch.randn(shape, device=device, generator=gen).bfloat16() for _ in "kv")
              if m == ATTEND else None for _, _, m in plan]  # fmt: skip
    return Chain(weights, modes, norms_a, norms_b, h0, eps, caches, pieces)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--context", type=int, default=512, help="positions each row attends to")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    lib_path = native.build(native.nvcc_path(), f"{major}{minor}", [SOURCE], "libchain.so")
    library = declare(ctypes.CDLL(str(lib_path)))
    plan = layer_plan(OURO_1_4B, OURO_1_4B["num_hidden_layers"])
    gbytes = sum(n * k * 2 for n, k, _ in plan) / 1e9
    blocks = torch.cuda.get_device_properties(device).multi_processor_count
    results = []
    for rows in args.rows:
        heads = OURO_1_4B["num_attention_heads"]
        pieces = native.decode_pieces(rows * heads, args.context, blocks)
        gen = torch.Generator(device=device).manual_seed(rows)
        chain = random_chain(plan, rows, heads, args.context, pieces, device, gen)
        timed = {
            "persistent": graph_us(lambda c=chain: c.run(library, blocks)),
            "skinny": graph_us(lambda c=chain: separate(c, skinny=True)),
            "cublas": graph_us(lambda c=chain: separate(c, skinny=False)),
        }
        chain.run(library, blocks)
        torch.cuda.synchronize()
        line = {"rows": rows, "context": args.context, "pieces": pieces,
                "max_rel_err": chain.max_rel_err(), "weight_GB": gbytes}  # fmt: skip
        for name, (us, captured) in timed.items():
            line[name] = {"us": us, "TBps": gbytes / us * 1e3, "graph": captured}
        results.append(line)
        print(json.dumps(line), flush=True)
    res = {"env": _env(), "command": sys.argv, "commit": commit(), "engine_sha256": engine_digest(),
           "blocks": blocks, "results": results}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
