"""The shape of the early-exit benchmark's schedule (docs/benchmarks/early-exit.md), counted on
the CPU: a tiny random Ouro in fp32 with the benchmark's scheduling settings (2c requests of 512
prompt tokens and 64 forced output tokens, `max_num_seqs` c, budget 2,048, chunk 512, runs of up
to 16 invocations) at an exit threshold. Counts, not speed: which steps ran device runs alone,
carried or beside prefill (each one not carried waits for the read-back before it), how many
plans waited for the run in flight's results (`read_backs`: the GPU idles until the next step
is queued), the prompt rows of each prefill step, and the rows of every invocation of runs
alone or carried.

    python -m benchmarks.probes.run_schedule --concurrency 32 --threshold 0.3 1.0

The tiny model's random gate takes about 1.35 loops per token at threshold 0.3, near the
Ouro-1.4B shape's 1.42 at 0.6 with dummy weights.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import numpy as np

from vllm_rlt.config import EngineConfig
from vllm_rlt.core.sched.execution_batch import RowKind
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.bench.metrics import engine_counters
from vllm_rlt.entrypoints.bench.throughput import run_requests
from vllm_rlt.models.tiny import write_tiny_ouro


def schedule_shape(model_dir: Path, c: int, threshold: float, output_len: int) -> dict:
    """The counts of one round of 2c requests at exit threshold `threshold`."""
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=c,
        max_num_batched_tokens=2048, prefill_chunk_size=512, device_decode_loops=16,
        num_kv_blocks=40_000, exit_threshold=threshold,
    ))  # fmt: skip
    steps: list[tuple[str, int, int]] = []  # (kind, rows or prompt rows, invocations)
    schedule = eng.scheduler.schedule

    read_backs = [0]  # plans that first waited for the run in flight's results

    def recorded():
        flight = eng.scheduler._flight
        batch = schedule()
        run = batch.decode_run
        read_backs[0] += flight is not None and not (run is not None and run.carried)
        prompt_rows = sum(t.num_tokens for t in batch.requests if t.kind is RowKind.PREFILL)
        if prompt_rows:
            steps.append(("prefill", prompt_rows, batch.loop_count))
        elif run is not None:
            steps.append(("carried" if run.carried else "alone", len(run.rows), batch.loop_count))
        else:
            steps.append(("host", len(batch.requests), batch.loop_count))
        return batch

    eng.scheduler.schedule = recorded
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, 512).tolist() for _ in range(2 * c)]
    before = eng.stats_dict()
    run_requests(eng, prompts, output_len, exit_threshold=threshold)
    counters = engine_counters(before, eng.stats_dict(), len(prompts))
    by_rows = collections.Counter()
    for kind, rows, n in steps:
        if kind in ("alone", "carried"):
            by_rows[rows] += n
    run_invocations = sum(by_rows.values())
    return {
        "loops_per_token": counters["loops_per_token"],
        "steps_by_kind": dict(collections.Counter(kind for kind, _, _ in steps)),
        "read_backs": read_backs[0],
        "prefill_rows_by_step": [rows for kind, rows, _ in steps if kind == "prefill"],
        "run_invocations_by_rows": dict(sorted(by_rows.items())),
        "run_rows_per_invocation": sum(r * n for r, n in by_rows.items()) / (run_invocations or 1),
        "invocations": counters["invocations"],
        "prefill_invocations": counters["prefill_invocations"],
        "steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threshold", type=float, nargs="+", default=[0.3, 1.0])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args()
    model_dir = write_tiny_ouro(Path(tempfile.mkdtemp()), vocab_size=256, seed=3)
    results = {}
    for c in args.concurrency:
        for t in args.threshold:
            r = schedule_shape(model_dir, c, t, args.output_len)
            results[f"c{c}-t{t}"] = r
            print(f"c={c} threshold={t}:", {k: v for k, v in r.items() if k != "steps"})
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
