"""GPU time of a decode invocation's 96 projections (Ouro-1.4B: q/k/v, o, gate/up, down in 24
layers, distinct weights) chained at R rows: the persistent kernel of `persistent_chain.cu` (one
block per SM, a ring of weight tiles that runs ahead across its grid barriers) against the
few-row GEMM and cuBLAS, each launch after the one before as in the engine. Every chain is
captured in a CUDA graph and replayed; the weight bytes over the time give the bandwidth. Each
projection's input is the first K columns of the previous one's output; the persistent outputs
are checked projection by projection against torch in fp32 over the same inputs. What this
tests: whether keeping the weight stream going across barriers removes the fixed cost per
projection that separate launches pay (docs/design/runner.md §4). Needs Hopper or later and a
CUDA toolkit (the kernel is built like the native kernels, `vllm_rlt/kernels/native.py`).

    python -m benchmarks.probes.persistent_chain --rows 1 4 8 --out chain.json
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
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.kernels import native
from vllm_rlt.kernels.skinny_gemm import skinny_linear

SOURCE = Path(__file__).with_name("persistent_chain.cu")
LAYERS = 24


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """`vrlt_persistent_chain`'s signature."""
    ptr, i = ctypes.c_void_p, ctypes.c_int
    library.vrlt_persistent_chain.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i, i, i, i, ptr]
    library.vrlt_persistent_chain.restype = ctypes.c_int
    return library


def shapes(config: dict) -> list[tuple[int, int]]:
    """(N, K) of a layer's projections, in order."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * d
    return [(qkv, h), (h, config["num_attention_heads"] * d), (2 * i, h), (h, i)]


class Chain:
    """The weights, input and outputs of one chain, and the tables the kernel reads."""

    def __init__(self, weights: list[torch.Tensor], x0: torch.Tensor):
        device, rows = x0.device, x0.shape[0]
        ks = [x0.shape[1]] + [w.shape[0] for w in weights[:-1]]  # the widest each x can be
        fits = [w.shape[1] <= k and w.shape[0] % 8 == w.shape[1] % 8 == 0
                for w, k in zip(weights, ks, strict=True)]  # fmt: skip
        if not all(fits) or x0.shape[1] % 8:
            raise ValueError("N and K must be multiples of 8, each K within the N before it")
        self.weights, self.x0 = weights, x0
        self.ys = [torch.zeros(rows, w.shape[0], device=device, dtype=x0.dtype) for w in weights]
        self.w_ptrs = torch.tensor([w.data_ptr() for w in weights], device=device)
        self.y_ptrs = torch.tensor([y.data_ptr() for y in self.ys], device=device)
        self.n = torch.tensor([w.shape[0] for w in weights], device=device, dtype=torch.int32)
        self.k = torch.tensor([w.shape[1] for w in weights], device=device, dtype=torch.int32)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self.max_k = max(w.shape[1] for w in weights)

    def run(self, library: ctypes.CDLL, blocks: int, stream: int | None) -> None:
        self.counter.zero_()
        err = library.vrlt_persistent_chain(
            self.w_ptrs.data_ptr(), self.y_ptrs.data_ptr(), self.n.data_ptr(),
            self.k.data_ptr(), self.x0.data_ptr(), self.counter.data_ptr(), len(self.weights),
            self.max_k, self.x0.shape[0], blocks, stream,
        )  # fmt: skip
        if err:
            raise RuntimeError(f"persistent chain: CUDA error {err}")

    def inputs(self) -> list[torch.Tensor]:
        """Each projection's x: the input, then the first K columns of the output before."""
        pairs = zip(self.ys[:-1], self.weights[1:], strict=True)
        return [self.x0] + [y[:, : w.shape[1]] for y, w in pairs]

    def max_rel_err(self) -> float:
        """The outputs against torch in fp32 over the same inputs, projection by projection."""
        worst = 0.0
        for x, w, y in zip(self.inputs(), self.weights, self.ys, strict=True):
            ref = x.float() @ w.float().T
            worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
        return worst


def layered(linear, weights: list[torch.Tensor], x0: torch.Tensor) -> torch.Tensor:
    """The chain by separate launches of `linear` (each output feeds the next)."""
    x = x0
    for w, nxt in zip(weights, weights[1:] + [None], strict=True):
        y = linear(x, w)
        x = y[:, : nxt.shape[1]] if nxt is not None else y
    return x


def graph_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    args = p.parse_args(argv)
    device = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    lib_path = native.build(native.nvcc_path(), f"{major}{minor}", [SOURCE], "libchain.so")
    library = declare(ctypes.CDLL(str(lib_path)))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        (torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16()
        for _ in range(LAYERS)
        for n, k in shapes(OURO_1_4B)
    ]
    gbytes = sum(w.numel() * 2 for w in weights) / 1e9
    blocks = torch.cuda.get_device_properties(device).multi_processor_count
    stream = torch.cuda.current_stream(device).cuda_stream
    results = []
    for rows in args.rows:
        x0 = torch.randn(rows, weights[0].shape[1], device=device, generator=gen).bfloat16()
        chain = Chain(weights, x0)
        timed = {
            "persistent": graph_us(lambda c=chain: c.run(library, blocks, stream)),
            "skinny": graph_us(lambda x=x0: layered(skinny_linear, weights, x)),
            "cublas": graph_us(lambda x=x0: layered(F.linear, weights, x)),
        }
        chain.run(library, blocks, stream)
        torch.cuda.synchronize()
        line = {"rows": rows, "max_rel_err": chain.max_rel_err(), "weight_GB": gbytes}
        for name, us in timed.items():
            line[name] = {"us": us, "TBps": gbytes / us * 1e3}
        results.append(line)
        print(json.dumps(line), flush=True)
    res = {"env": _env(), "command": sys.argv, "commit": commit(), "engine_sha256": engine_digest(),
           "blocks": blocks, "results": results}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
