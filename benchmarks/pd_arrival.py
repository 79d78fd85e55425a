"""Prefill/decode disaggregation against data-parallel replicas and one engine, on Poisson
arrivals, through the OpenAI server (docs/serving.md §7-8).

For each setup a `vllm-rlt serve` process starts on a free port: `single` (one engine), `pd`
(`--pd-prefill 1 --pd-decode 1`), `replicas` (`--data-parallel-size 2`); on CUDA engine k runs
on GPU k % num_gpus. Each (rate, prompt length) then replays the arrival profile over HTTP
(`vllm_rlt.entrypoints.bench.drivers.run_http`: streamed completions, greedy, EOS ignored) and
reports
request throughput, TTFT / ITL percentiles and, from `/metrics` before and after, the KV
transfer counters (volume, and how long transfers ran ahead of the end of prefill). Model: a
shape with dummy weights at fixed depth; WCPB with `--chunk` on every engine.

    python -m benchmarks.pd_arrival --out pd-arrival.json                 # 2 GPUs
    python -m benchmarks.pd_arrival --smoke --setups pd --out smoke.json  # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.model_shapes import SHAPES, write_shape
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.disagg.engines import free_port
from vllm_rlt.entrypoints.bench.drivers import run_http
from vllm_rlt.entrypoints.bench.metrics import summarize
from vllm_rlt.entrypoints.bench.workload import build_workload

SETUPS = {
    "single": [],
    "pd": ["--pd-prefill", "1", "--pd-decode", "1"],
    "replicas": ["--data-parallel-size", "2"],
}
START_TIMEOUT_S = 600.0  # a server's engines load, capture graphs and join their group


def engine_flags(smoke: bool, chunk: int, kv_cache_gb: float) -> list[str]:
    """What every engine of a setup runs with: the shape's dummy weights at fixed depth, WCPB
    with `chunk`; bf16 on CUDA, or fp32 on the CPU with `smoke`."""
    dtype, device = ("float32", "cpu") if smoke else ("bfloat16", "cuda")
    return [
        "--load-format", "dummy", "--dtype", dtype, "--device", device, "--exit-threshold", "1",
        "--wavefront-chunked-prefill", "--prefill-chunk-size", str(chunk),
        "--kv-cache-memory-gb", str(kv_cache_gb),
    ]  # fmt: skip


def run_meta(module: str, argv: list[str] | None, args: argparse.Namespace) -> dict:
    """A results file's provenance: the command, commit, engine digest, GPUs and arguments."""
    return {
        "command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit(),
        "engine_sha256": engine_digest(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "engine_flags"},
    }


def transfer_counters(base_url: str) -> dict[str, float]:
    """The server's `vllm_rlt:pd_*` counters (none for a server without disaggregation)."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {
        s.name.removeprefix("vllm_rlt:"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm_rlt:pd_") and s.name.endswith("_total")
    }


class Server:
    """`vllm-rlt serve` in a child process, until the `with` block ends (SIGINT, then kill)."""

    def __init__(self, model_dir: Path, flags: list[str], log: Path):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", str(model_dir),
               "--port", str(self.port), "--served-model-name", "bench",
               "--disable-log-requests", *flags]  # fmt: skip
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the server did not start (log: {self.log.name})")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_setup(args, setup: str, model_dir: Path, vocab: int) -> list[dict]:
    """The runs of one setup; its server's log goes beside `--out` (OUT-SETUP.log)."""
    flags = [*args.engine_flags, *SETUPS[setup]]
    out = Path(args.out)
    runs = []
    with Server(model_dir, flags, out.with_name(f"{out.stem}-{setup}.log")) as srv:
        warm = build_workload("concurrent", 2, [16], 4, vocab, seed=99)
        asyncio.run(run_http(srv.url, "bench", warm))
        for input_len in args.input_lens:
            for rate in args.rates:
                workload = build_workload(
                    "arrival", args.num_requests, [input_len], args.output_len, vocab,
                    concurrency=args.concurrency, rate=rate, seed=args.seed,
                )  # fmt: skip
                before = transfer_counters(srv.url)
                records, duration = asyncio.run(run_http(srv.url, "bench", workload))
                after = transfer_counters(srv.url)
                run = {"setup": setup, "input_len": input_len, "rate": rate,
                       "summary": summarize(records, duration),
                       "transfers": {k: after[k] - before.get(k, 0) for k in after}}  # fmt: skip
                s = run["summary"]
                print(f"{setup:>8} in={input_len:<5} rate={rate:<4} req/s "
                      f"{s['request_throughput']:.3f}  TTFT p50 {1e3 * s['ttft_s']['p50']:.1f} ms"
                      f"  ITL p99 {1e3 * s['itl_s']['p99']:.2f} ms", flush=True)  # fmt: skip
                runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="ouro-1.4b", choices=sorted(SHAPES))
    p.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--input-lens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--chunk", type=int, default=32, help="WCPB prefill chunk")
    p.add_argument("--kv-cache-gb", type=float, default=40.0, help="per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, few requests")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.rates, args.input_lens, args.output_len = "tiny", [20.0], [48], 4
        args.num_requests, args.kv_cache_gb = 6, 0.1
    args.engine_flags = engine_flags(args.smoke, args.chunk, args.kv_cache_gb)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape(args.shape, Path(tmp) / args.shape)
        vocab = SHAPES[args.shape]["vocab_size"]
        for setup in args.setups:
            runs += run_setup(args, setup, model_dir, vocab)
    out = {"meta": run_meta("benchmarks.pd_arrival", argv, args), "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
