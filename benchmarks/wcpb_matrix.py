"""The WCPB matrix (docs/benchmarks/wcpb-matrix.md): Atomic vs Split vs WCPB over chunk sizes
x arrival profiles x input-length mixes, the three modes of a cell interleaved (A B C A B C ...)
on one set of weights, medians over repeats.

    python -m benchmarks.wcpb_matrix --out-dir matrix                                # H200 run
    python -m benchmarks.wcpb_matrix --smoke --out-dir /tmp/m                       # CPU check

Writes `results.json` (every run), `summary.json` and `README.md` (tables with WCPB/Split
ratios beside each profile's invocation bound) and PNG plots when matplotlib is installed.
A run may be split across calls with `--cells` (indices into the cell list): runs already in
`results.json` are kept, except those of the cells being run again, and every call's command
and versions are listed. The files are written after every run, so a call cut off by a time
limit keeps the runs it finished. On a GPU,
`--busy-rounds` more interleaved rounds per cell run under the CUDA activity recorder and give
the GPU busy fraction and the device time of each invocation shape (`invocation_ms` in
`results.json`: `vllm_rlt.worker.invocation_timer`; `--timer-context` keys them by prefill rows
and context too); they are kept out of the other medians
(recording perturbs timing).
`--modes` picks the modes (default Atomic, Split, WCPB, each with the engine's defaults: WCPB's
cap on prefill rows beside decode rows and its ride limit are half the budget); `wcpb-cap` adds
WCPB whose invocations with decode rows take at most `--wcpb-cap` prefill rows
(`max_prefill_rows_with_decode`; the budget turns the cap off); `wcpb-ride` sets WCPB's ride
limit (`max_prefill_rows_per_decode_token`: prefill rows a decode token rides while a seat is
free) to 512 explicitly, the default at the matrix's budget, and `wcpb-noride` lifts it;
`unchunked` is refill
scheduling with one chunk = the budget. `--profiles` and `--inputs` pick the cells; the
long-prompt mix (docs/benchmarks/long-prompts.md):

    python -m benchmarks.wcpb_matrix --inputs long --profiles concurrent arrival \
        --modes unchunked split wcpb --out-dir benchmarks/results/long-prompts
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.model_shapes import write_shape
from benchmarks.provenance import commit, engine_digest
from vllm_rlt.config import EngineConfig
from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.drivers import gpu_activity, run_inprocess
from vllm_rlt.entrypoints.bench.metrics import engine_counters, summarize
from vllm_rlt.entrypoints.bench.workload import build_workload
from vllm_rlt.models.loader import load_model
from vllm_rlt.worker.invocation_timer import InvocationTimer

WCPB = {"scheduling_mode": "mixed", "wavefront_chunked_prefill": True}
MODES = {
    "atomic": {"scheduling_mode": "refill"},
    # the long-prompt mix's baseline: refill scheduling, one chunk = the whole budget
    "unchunked": {"scheduling_mode": "refill"},
    "split": {"scheduling_mode": "mixed"},
    "wcpb": WCPB,
    # experiments beside the matrix's three modes (the ITL tail): WCPB whose invocations with
    # decode rows take at most --wcpb-cap prefill rows instead of its default, half the budget
    # (docs/benchmarks/wcpb-matrix.md §4); WCPB with the ride limit set explicitly, which the
    # runs from before it was the default compare with WCPB (docs/benchmarks/wcpb-matrix.md §3)
    "wcpb-cap": WCPB,
    "wcpb-ride": {**WCPB, "max_prefill_rows_per_decode_token": 512},
    "wcpb-noride": {**WCPB, "max_prefill_rows_per_decode_token": 1 << 30},  # more than any rides
}
DEFAULT_MODES = ("atomic", "split", "wcpb")
# modes compared with Split (and unchunked), with their titles
WAVEFRONT_MODES = {
    "wcpb": "WCPB",
    "wcpb-cap": "WCPB with the cap",
    "wcpb-ride": "WCPB, ride limit",
    "wcpb-noride": "WCPB, no ride limit",
}


def mode_settings(mode: str, wcpb_cap: int) -> dict:
    """The scheduler settings of a matrix mode (`wcpb_cap`: the cap of mode wcpb-cap)."""
    cap = {"max_prefill_rows_with_decode": wcpb_cap} if mode == "wcpb-cap" else {}
    return {**MODES[mode], **cap}


PROFILES = {
    "serial": {"profile": "serial", "concurrency": 1},
    "concurrent": {"profile": "concurrent", "concurrency": 8},
    "arrival": {"profile": "arrival", "concurrency": 4, "rate": 2.0},
}
INPUTS = {"fixed": [512], "variable": [256, 512, 768], "long": [8192] + [512] * 9}
CYCLED = {"long"}  # input mixes taken in order (every 10th prompt long), not drawn
# (metric path, short name) reported per mode
METRICS = [
    (("summary", "request_throughput"), "req/s"),
    (("summary", "output_token_throughput"), "out tok/s"),
    (("summary", "ttft_s", "p50"), "TTFT p50 s"),
    (("summary", "tpot_s", "p50"), "TPOT p50 s"),
    (("summary", "itl_s", "p99"), "ITL p99 s"),
    (("summary", "e2e_s", "p50"), "E2E p50 s"),
    (("engine", "rows_per_invocation"), "rows/inv"),
    (("engine", "prefill_rows_per_prefill_invocation"), "prefill rows/prefill inv"),
    (("engine", "invocations_per_request"), "inv/req"),
]
BUSY = "GPU busy"  # from the profiled rounds


def add_async_scheduling_flag(
    parser: argparse.ArgumentParser,
    default: bool = SchedulerConfig.async_scheduling,
    help: str = "the engine's async scheduling (default: the engine's)",
) -> None:
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=default, help=help
    )


def cell_config(args, chunk: int, mode: str) -> EngineConfig:
    """The engine config of a matrix mode at chunk size `chunk` (`args`: max_num_seqs,
    max_num_batched_tokens, kv_cache_gb, wcpb_cap, async_scheduling); fixed depth."""
    return EngineConfig.from_kwargs(
        async_scheduling=args.async_scheduling,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.max_num_batched_tokens if mode == "unchunked" else chunk,
        exit_threshold=1.0,
        kv_cache_memory_gb=args.kv_cache_gb,
        **mode_settings(mode, args.wcpb_cap),
    )


def release_device_memory() -> None:
    """Free a finished engine's device memory (its KV cache) before the next one starts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cells(chunks: list[int], profiles=tuple(PROFILES), inputs=("fixed", "variable")):
    """(chunk, profile, input mix) of every cell, in `--cells` order."""
    return list(itertools.product(chunks, profiles, inputs))


def run_one(
    loaded,
    args,
    chunk: int,
    mode: str,
    profile: str,
    inputs: str,
    repeat: int,
    smoke: dict,
    profiled: bool = False,
) -> dict:
    """One engine run of one mode in one cell (`smoke`: CPU overrides of inputs and rates;
    `profiled`: record GPU activity for the busy fraction)."""
    config = cell_config(args, chunk, mode)
    vocab = loaded.config.vocab_size
    p = {**PROFILES[profile], **smoke.get("profiles", {}).get(profile, {})}
    lens = smoke.get("inputs", INPUTS)[inputs]
    wl = build_workload(
        p["profile"], args.num_requests, lens, args.output_len, vocab,
        concurrency=p["concurrency"], rate=p.get("rate", 2.0), seed=args.seed + repeat,
        cycle=inputs in CYCLED,
    )  # fmt: skip

    async def go():
        engine = AsyncLLMEngine(LLMEngine(config, loaded))
        try:
            warm = build_workload("concurrent", 2, [chunk + 3], 2, vocab, seed=99)
            await run_inprocess(engine, warm, tag="warmup")
            before = engine.engine.stats.as_dict()
            if profiled:
                timer = InvocationTimer(engine.engine.runner.device, args.timer_context)
                engine.engine.runner.timer = timer
            with gpu_activity() if profiled else contextlib.nullcontext({}) as gpu:
                records, duration = await run_inprocess(engine, wl)
            after = engine.engine.stats.as_dict()
        finally:
            await engine.shutdown()
        out = {
            "summary": summarize(records, duration),
            "engine": engine_counters(before, after, len(wl.requests)),
        }
        if profiled:
            out["gpu_busy_fraction"] = gpu["gpu_busy_s"] / duration
            out["gpu_kernels"] = gpu["gpu_kernels"]  # where the GPU time went, by kernel
            out["invocation_ms"] = timer.summary()  # ... and by invocation shape
        return out

    result = asyncio.run(go())
    release_device_memory()
    cell = {"chunk": chunk, "profile": profile, "inputs": inputs, "mode": mode, "repeat": repeat}
    return {**cell, "requests": args.num_requests, "profiled": profiled, **result}


def _get(run: dict, path: tuple) -> float:
    value = run
    for key in path:
        value = value[key]
    return float(value)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def _ratios(w: dict[str, float], s: dict[str, float]) -> dict[str, float]:
    """A wavefront mode's medians `w` over a baseline's `s` (Split, or unchunked), and the
    invocation bound."""
    return {
        "req/s": w["req/s"] / s["req/s"],
        "TTFT p50": w["TTFT p50 s"] / s["TTFT p50 s"],
        "ITL p99": w["ITL p99 s"] / s["ITL p99 s"],
        "prefill rows/prefill inv": w["prefill rows/prefill inv"] / s["prefill rows/prefill inv"],
        "invocation bound": s["inv/req"] / w["inv/req"],
    }


def summarize_matrix(runs: list[dict]) -> list[dict]:
    """Per cell and mode: median and spread of every metric; WCPB/Split ratios and the bound."""
    rows = []
    keys = sorted({(r["chunk"], r["profile"], r["inputs"]) for r in runs})
    for chunk, profile, inputs in keys:
        cell = {"chunk": chunk, "profile": profile, "inputs": inputs, "modes": {}}
        cell["requests"] = sorted({r.get("requests") for r in runs if (r["chunk"], r["profile"],
                                   r["inputs"]) == (chunk, profile, inputs)} - {None})  # fmt: skip
        for mode in MODES:
            mine = [r for r in runs if (r["chunk"], r["profile"], r["inputs"], r["mode"]) ==
                    (chunk, profile, inputs, mode)]  # fmt: skip
            timed = [r for r in mine if not r.get("profiled")]
            if not timed:
                continue
            stats = {name: _spread([_get(r, path) for r in timed]) for path, name in METRICS}
            busy = [r["gpu_busy_fraction"] for r in mine if r.get("profiled")]
            if busy:  # profiled rounds count for the busy fraction only
                stats[BUSY] = _spread(busy)
            cell["modes"][mode] = stats | {"repeats": len(timed)}
        m = cell["modes"]
        med = {mode: {k: v["median"] for k, v in m[mode].items() if k != "repeats"} for mode in m}
        for mode in WAVEFRONT_MODES:
            if "split" in m and mode in m:
                cell[f"{mode}_over_split"] = _ratios(med[mode], med["split"])
            if "unchunked" in m and mode in m:  # the long-prompt mix's targets
                cell[f"{mode}_over_unchunked"] = _ratios(med[mode], med["unchunked"])
        rows.append(cell)
    return rows


def _spread_text(spread: dict | None) -> str:
    """'median (min-max)'; '-' for a metric a mode does not have yet (the files are written after
    every run, so a cell can hold one mode's profiled round and not the other's)."""
    if spread is None:
        return "-"
    return f"{spread['median']:.4g} ({spread['min']:.3g}-{spread['max']:.3g})"


def markdown(cells_summary: list[dict], calls: list[dict]) -> str:
    lines = ["# WCPB matrix", "", "Commands (one per call; later calls replace earlier cells):", ""]
    for meta in calls:
        lines.append(
            f"- `{meta['command']}` (commit {meta['commit'][:10]}): "
            f"GPU {meta['gpu']}; torch {meta['torch']}; triton {meta['triton']}; "
            f"Python {meta['python']}; model {meta['shape']} ({meta['dtype']}, "
            "dummy weights, fixed depth)."
        )
    lines += ["", "Medians over repeats (min-max in brackets); modes interleaved per cell.", ""]
    for cell in cells_summary:
        requests = "/".join(str(n) for n in cell["requests"])
        lines.append(f"## chunk {cell['chunk']}, {cell['profile']}, {cell['inputs']} inputs")
        lines += ["", f"{requests} requests per run.", ""]
        names = [name for _, name in METRICS]
        if any(BUSY in vals for vals in cell["modes"].values()):
            names.append(BUSY)
        lines.append("| mode | repeats | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 2) + "|")
        for mode, vals in cell["modes"].items():
            cols = [_spread_text(vals.get(name)) for name in names]
            lines.append(f"| {mode} | {vals['repeats']} | " + " | ".join(cols) + " |")
        for mode, title in WAVEFRONT_MODES.items():
            for base, base_title in (("split", "Split"), ("unchunked", "unchunked")):
                if f"{mode}_over_{base}" in cell:
                    ratios = cell[f"{mode}_over_{base}"].items()
                    text = ", ".join(f"{k} {v:.3f}" for k, v in ratios)
                    lines += ["", f"{title} / {base_title}: {text}"]
        lines.append("")
    return "\n".join(lines)


def plot(cells_summary: list[dict], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [m for m in MODES if any(m in c["modes"] for c in cells_summary)]
    if not shown:  # only profiled rounds: no medians to plot
        return
    labels = [f"c{c['chunk']}\n{c['profile'][:4]}\n{c['inputs'][:3]}" for c in cells_summary]
    for name, fname in (("req/s", "throughput.png"), ("TTFT p50 s", "ttft.png"),
                        ("ITL p99 s", "itl_p99.png")):  # fmt: skip
        fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 3.5))
        width = 0.8 / len(shown)
        for k, mode in enumerate(shown):
            vals = [
                c["modes"].get(mode, {}).get(name, {}).get("median", 0.0) for c in cells_summary
            ]
            offset = (k - (len(shown) - 1) / 2) * width
            ax.bar(np.arange(len(labels)) + offset, vals, width, label=mode)
        ax.set_xticks(np.arange(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)


def _save(out_dir: Path, calls: list[dict], runs: list[dict]) -> None:
    summary = summarize_matrix(runs)
    (out_dir / "results.json").write_text(json.dumps({"calls": calls, "runs": runs}, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "README.md").write_text(markdown(summary, calls))
    plot(summary, out_dir)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--shape", default="ouro-1.4b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--layer-kernels", default="auto", help="the model's LayerKernels strategy")
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 128])
    p.add_argument("--cells", type=int, nargs="*", default=None, help="indices into the cells")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arrival-repeats", type=int, default=1)
    p.add_argument("--busy-rounds", type=int, default=1, help="profiled rounds per cell (GPU only)")
    p.add_argument(
        "--timer-context", action="store_true",
        help="profiled rounds key invocations by rows and context as well "
        "(`invocation_timer.detailed_shape`)",
    )  # fmt: skip
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-gb", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(DEFAULT_MODES))
    p.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    p.add_argument(
        "--inputs", nargs="+", choices=list(INPUTS), default=["fixed", "variable"],
        help="input mixes; long: every 10th prompt 8,192 tokens, the others 512 (the "
        "long-prompt mix, with --modes unchunked split wcpb)",
    )  # fmt: skip
    p.add_argument("--wcpb-cap", type=int, default=256, help="prefill rows beside decode rows")
    add_async_scheduling_flag(p)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few requests")
    args = p.parse_args(argv)
    smoke = {}
    if args.smoke:
        args.shape, args.dtype, args.attention_backend = "tiny", "float32", "torch"
        args.num_requests, args.output_len, args.kv_cache_gb = 3, 3, 0.05
        smoke = {
            "inputs": {"fixed": [40], "variable": [20, 40, 60], "long": [120] + [20] * 9},
            "profiles": {"arrival": {"rate": 50.0}},
        }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(
            write_shape(args.shape, tmp), dtype=args.dtype, load_format="dummy",
            attention_backend=args.attention_backend, layer_kernels=args.layer_kernels,
        )  # fmt: skip
    todo = cells(args.chunks, args.profiles, args.inputs)
    if args.cells is not None:
        todo = [todo[i] for i in args.cells]
    meta = {
        "command": "python -m benchmarks.wcpb_matrix " + " ".join(argv or sys.argv[1:]),
        "commit": commit(),
        "engine_sha256": engine_digest(),
        "args": vars(args),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "shape": args.shape,
        "dtype": args.dtype,
    }
    calls, runs = [meta], []
    if (out_dir / "results.json").exists():  # an earlier call's cells: keep those not rerun
        old = json.loads((out_dir / "results.json").read_text())
        calls = old["calls"] + calls
        runs = [r for r in old["runs"] if (r["chunk"], r["profile"], r["inputs"]) not in todo]
    for chunk, profile, inputs in todo:
        repeats = args.arrival_repeats if profile == "arrival" else args.repeats
        busy_rounds = args.busy_rounds if torch.cuda.is_available() else 0
        for r in range(repeats + busy_rounds):
            for mode in args.modes:  # interleaved: A B C A B C ...
                profiled = r >= repeats
                runs.append(run_one(loaded, args, chunk, mode, profile, inputs, r, smoke, profiled))
                s = runs[-1]["summary"]
                print(f"chunk {chunk} {profile} {inputs} r{r} {mode}: "
                      f"{s['request_throughput']:.3f} req/s", flush=True)  # fmt: skip
                _save(out_dir, calls, runs)  # after every run: a cut-off call keeps it
    return summarize_matrix(runs)


if __name__ == "__main__":
    main()
