"""GPU probe: what the few-row GEMM's per-call cost is made of at decode sizes.

`decode-sweep.md` found every projection call ~3-5 us slower than its weight bytes over the copy
bandwidth. This probe asks whether memory latency is that cost, per Ouro-1.4B projection (the
few-row GEMM; gate/up with its SwiGLU epilogue) at 1 and 8 rows, CUDA-graph replays of 24 calls:

- cold: 24 weight copies, so the L2 (50 MB) holds none of them; hot: one copy called 24 times;
- an L2 prefetch kernel (`prefetch.global.L2` over a fraction of the weight) launched before a
  kernel that only waits (`torch.cuda._sleep`, 4-12 us, standing in for a latency-bound kernel
  such as attention), then the GEMM: the GEMM's time after the sleep, with and without it;
- the same with real paged attention (1 and 8 decode rows at 512 positions) before o_proj.

    python -m benchmarks.l2_probe --out l2-probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton
import triton.language as tl

from benchmarks.attention_bench import Bench, graph_us
from benchmarks.decode_sweep import COPIES, projections
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels import paged_attention as pa
from vllm_rlt.kernels.pdl import prefetch_l2
from vllm_rlt.kernels.skinny_gemm import skinny_linear, skinny_swiglu

REP = 25  # do_bench repetition time (ms)


@triton.jit
def _prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, ELEMS: tl.constexpr):
    offs = tl.program_id(0) * LINES + tl.arange(0, LINES)
    prefetch_l2(ptr + tl.minimum(offs, n_lines - 1).to(tl.int64) * ELEMS)


def prefetch(w: torch.Tensor, frac: float = 1.0, lines_per_program: int = 256) -> None:
    """Pull the first `frac` of w's bytes into the L2 (128-byte lines)."""
    n_lines = int(w.numel() * w.element_size() * frac) // 128
    grid = (triton.cdiv(n_lines, lines_per_program),)
    _prefetch_kernel[grid](w, n_lines, LINES=lines_per_program, ELEMS=128 // w.element_size())


def sleep_us(us: float) -> None:
    torch.cuda._sleep(int(us * 1980))  # H200 SM clock: 1980 MHz


def probe_gemms() -> list[dict]:
    out = []
    for name, (n, k) in projections().items():
        ws = torch.randn(COPIES, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        gemm = skinny_swiglu if name == "gate_up" else skinny_linear
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {
                "projection": name,
                "rows": m,
                "cold_us": graph_us([functools.partial(gemm, x, w) for w in ws], REP),
                "hot_us": graph_us([functools.partial(gemm, x, ws[0]) for _ in ws], REP),
                "prefetch_kernel_us": graph_us([functools.partial(prefetch, w) for w in ws], REP),
            }
            for sleep in (4.0, 8.0, 12.0):
                base = graph_us([functools.partial(sleep_us, sleep) for _ in ws], REP)
                calls = []
                for w in ws:
                    calls += [functools.partial(sleep_us, sleep), functools.partial(gemm, x, w)]
                row[f"sleep{sleep:g}_plain_us"] = graph_us(calls, REP) * 2 - base
                for frac in (0.25, 0.5, 1.0):
                    calls = []
                    for w in ws:
                        calls += [functools.partial(prefetch, w, frac)]
                        calls += [functools.partial(sleep_us, sleep), functools.partial(gemm, x, w)]
                    row[f"sleep{sleep:g}_pf{frac:g}_us"] = graph_us(calls, REP) * 3 - base
            print(json.dumps(row), flush=True)
            out.append(row)
        del ws
    return out


def probe_attention_then_o_proj() -> list[dict]:
    bench, out = Bench(REP), []
    n, k = projections()["o"]
    ws = torch.randn(COPIES, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    for rows in (1, 8):
        sets = bench.cases([(511, 1)] * rows, max_sets=8)
        kc, vc = bench.k_cache, bench.v_cache
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        attn = [functools.partial(pa.paged_attention, q, kc, vc, m) for m, q, _, _ in sets]
        plain, early = [], []
        for i, w in enumerate(ws):
            plain += [attn[i % len(attn)], functools.partial(skinny_linear, x, w)]
            early += [functools.partial(prefetch, w), *plain[-2:]]
        row = {
            "rows": rows,
            "attention_us": graph_us([attn[i % len(attn)] for i in range(COPIES)], REP),
            "attn+o_us": graph_us(plain, REP) * 2,
            "pf+attn+o_us": graph_us(early, REP) * 3,
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("l2_probe needs a CUDA GPU")
    res = {"commit": commit(), "engine_sha256": engine_digest(), "gemm": probe_gemms()}
    res["attention"] = probe_attention_then_o_proj()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
