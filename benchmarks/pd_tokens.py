"""Token agreement of prefill/decode disaggregation with one engine: the correctness half of the
two-GPU run (docs/benchmarks/README.md §3, docs/serving.md §7).

The setups of `benchmarks/pd_arrival.py` (`single`, and by default `pd`: a `vllm-rlt serve`
process each, engine k on GPU k % num_gpus) serve the same greedy requests: prompts of mixed
lengths (seeded random token ids, uniform in `--min-input-len`..`--max-input-len`),
`--output-len` tokens with EOS ignored, at fixed depth, all sent at once. On CUDA every engine
runs `--batch-invariant`, so that batching never changes a token and a setup must give the
tokens one engine gives; on the CPU (fp32) that holds without it. The generated ids come back as
logprob tokens (`return_tokens_as_token_ids`, docs/serving.md §3).

Reported for each setup against `single`: per request whether the ids are identical and where
they first differ; identical requests, and identical tokens (those before the first
difference). The exit status is 0 whatever the agreement.

    python -m benchmarks.pd_tokens --out pd-tokens.json             # 2 GPUs
    python -m benchmarks.pd_tokens --smoke --out pd-tokens-smoke.json  # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import httpx

from benchmarks.model_shapes import SHAPES, write_shape
from benchmarks.pd_arrival import SETUPS, Server, engine_flags, run_meta
from vllm_rlt.entrypoints.bench.workload import Workload, build_workload

REFERENCE = "single"


async def generate(url: str, workload: Workload, timeout_s: float) -> list[list[int] | str]:
    """Each request's generated token ids (or its error), all requests sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:

        async def one(prompt: list[int], output_len: int) -> list[int] | str:
            body = {"model": "bench", "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                    "return_tokens_as_token_ids": True}  # fmt: skip
            try:
                resp = await client.post("/v1/completions", json=body)
                resp.raise_for_status()
            except httpx.HTTPError as err:
                return f"{type(err).__name__}: {err}"
            names = resp.json()["choices"][0]["logprobs"]["tokens"]
            return [int(n.removeprefix("token_id:")) for n in names]

        return list(
            await asyncio.gather(
                *(one(r.prompt_token_ids, r.output_len) for r in workload.requests)
            )
        )


def first_difference(ref: list[int], got: list[int]) -> int | None:
    """The first position where the ids differ (or where one list ends early); None if equal."""
    for k, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return k
    return None if len(ref) == len(got) else min(len(ref), len(got))


def compare(ref: list, got: list, prompt_lens: list[int]) -> dict:
    """Per request and in all, how `got` agrees with `ref` (a failed request agrees nowhere)."""
    requests = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if isinstance(a, str) or isinstance(b, str):
            row = {"identical": False, "first_diff": 0, "identical_tokens": 0,
                   "error": b if isinstance(b, str) else f"{REFERENCE}: {a}"}  # fmt: skip
        else:
            diff = first_difference(a, b)
            same = len(a) if diff is None else diff
            row = {"identical": diff is None, "first_diff": diff, "identical_tokens": same}
        requests.append({"index": i, "prompt_len": prompt_lens[i], **row})
    total = sum(len(a) for a in ref if not isinstance(a, str))
    return {
        "requests": len(requests),
        "identical_requests": sum(r["identical"] for r in requests),
        "tokens": total,
        "identical_tokens": sum(r["identical_tokens"] for r in requests),
        "failed": sum("error" in r for r in requests),
        "per_request": requests,
    }


def run_setup(args, setup: str, model_dir: Path, workload: Workload) -> list:
    """One setup's token ids for `workload`; its server's log goes beside `--out`."""
    flags = [*args.engine_flags, *SETUPS[setup]]
    out = Path(args.out)
    with Server(model_dir, flags, out.with_name(f"{out.stem}-{setup}.log")) as srv:
        return asyncio.run(generate(srv.url, workload, args.request_timeout))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="ouro-1.4b", choices=sorted(SHAPES))
    others = [s for s in SETUPS if s != REFERENCE]
    p.add_argument("--setups", nargs="+", choices=others, default=["pd"],
                   help=f"compared with {REFERENCE!r}")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--chunk", type=int, default=32, help="WCPB prefill chunk")
    p.add_argument("--kv-cache-gb", type=float, default=80.0,
                   help="per engine; the default holds every request at once (the 64 default "
                   "requests of Ouro-1.4B take about 57 GB), so none is preempted")  # fmt: skip
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels on every engine (default: on CUDA, not with "
                   "--smoke)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU, few requests")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.num_requests, args.output_len, args.kv_cache_gb = "tiny", 6, 8, 0.1
        args.min_input_len, args.max_input_len = 8, 96
    if args.batch_invariant is None:
        args.batch_invariant = not args.smoke
    args.engine_flags = engine_flags(args.smoke, args.chunk, args.kv_cache_gb)
    if args.batch_invariant:
        args.engine_flags.append("--batch-invariant")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    lens = list(range(args.min_input_len, args.max_input_len + 1))
    workload = build_workload(
        "concurrent", args.num_requests, lens, args.output_len, vocab,
        concurrency=args.num_requests, seed=args.seed,
    )  # fmt: skip
    prompt_lens = [len(r.prompt_token_ids) for r in workload.requests]
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape(args.shape, Path(tmp) / args.shape)
        for setup in [REFERENCE, *args.setups]:
            tokens[setup] = run_setup(args, setup, model_dir, workload)
    results = {}
    for setup in args.setups:
        results[setup] = r = compare(tokens[REFERENCE], tokens[setup], prompt_lens)
        kernels = "batch-invariant" if args.batch_invariant else "default kernels"
        print(f"{setup} vs {REFERENCE}: {r['identical_requests']}/{r['requests']} requests and "
              f"{r['identical_tokens']}/{r['tokens']} tokens identical, {r['failed']} failed "
              f"({kernels})", flush=True)  # fmt: skip
    out = {"meta": run_meta("benchmarks.pd_tokens", argv, args), "results": results,
           "tokens": tokens}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
