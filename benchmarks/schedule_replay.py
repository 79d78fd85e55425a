"""Replay one WCPB-matrix cell through the scheduler alone (no model, no GPU): per mode, the
engine steps, recurrent-core invocations, rows and CUDA-graph bucket rows it would run.

    python -m benchmarks.schedule_replay --chunk 128 --inputs fixed --num-requests 24 --out r.json

Every request is admitted as soon as `max_num_seqs` allows (the concurrent profile), generates
`--output-len` tokens at fixed depth, and a stub runner answers each step with token 1, applied
at once or, with `--async-scheduling`, after the next step is scheduled (as the engine does by
default). The counts explain the matrix's per-invocation measurements: how many steps the host
runs (by the kinds of rows they carry and their loop count), how many invocations mix decode rows
with prefill rows, how many padding rows the graph buckets add, and which invocations no graph
holds (bucket "eager": more tiles than a graph's slots).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from benchmarks.wcpb_matrix import INPUTS, MODES, add_async_scheduling_flag, mode_settings
from vllm_rlt.attention.metadata import tile_rows_for
from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import RowKind, SampledToken, StepOutput
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.entrypoints.bench.workload import build_workload
from vllm_rlt.request import ExitSettings, Request
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.graph_tables import graph_specs, select_spec
from vllm_rlt.worker.invocation_timer import invocation_kind, invocation_shape

DEPTH = 4  # Ouro-1.4B's loops


def make_scheduler(mode: str, args, **settings) -> Scheduler:
    """A scheduler with the matrix's settings of `mode` (`args`: max_num_seqs,
    max_num_batched_tokens, chunk, wcpb_cap), `settings` over them, and a KV cache that never
    preempts; fixed depth."""
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=args.chunk,
        **{**mode_settings(mode, args.wcpb_cap), **settings},
    )
    kv = KVCacheManager(1 << 20, 16, "last_exited", DEPTH)
    return Scheduler(config, kv, make_exit_policy("ouro", None), DEPTH)


def make_request(req_id: str, prompt_len: int, output_len: int) -> Request:
    """A request of `prompt_len` dummy tokens that generates `output_len` tokens at fixed depth."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    return Request(req_id, [1] * prompt_len, params, ExitSettings(1, DEPTH, 1.0), seed=0)


def replay(mode: str, prompt_lens: list[int], args, async_scheduling: bool = False) -> dict:
    sched = make_scheduler(mode, args, async_scheduling=async_scheduling)
    kv = sched.kv
    for i, n in enumerate(prompt_lens):
        sched.add_request(make_request(f"r{i}", n, args.output_len))
    tile_rows = tile_rows_for(sched.planner.task_rows)  # the engine's
    specs = graph_specs(
        args.max_num_seqs, args.max_num_batched_tokens, sched.expected_segments, tile_rows
    )
    counts, buckets, steps = Counter(), Counter(), Counter()
    while sched.has_unfinished():
        batch = sched.schedule()
        counts["steps"] += 1
        kinds = {t.kind for t in batch.requests}
        kind = "mixed" if len(kinds) == 2 else kinds.pop().value if kinds else "empty"
        steps[f"{kind} x{batch.loop_count}"] += 1
        for i in range(batch.loop_count):
            live = batch.live(i, DEPTH)
            if not live:
                break
            rows = [t.num_tokens for t, _ in live]
            decode = sum(t.kind is RowKind.DECODE for t, _ in live)
            # None: no graph holds its tiles, it runs eagerly
            spec = select_spec(specs, rows, tile_rows)
            bucket = None if spec is None else spec.num_rows
            shape = invocation_shape(decode, sum(rows), bucket)  # the engine's timing keys
            counts["invocations"] += 1
            counts[f"{invocation_kind(decode, sum(rows))}_invocations"] += 1
            counts["rows"] += sum(rows)
            counts["bucket_rows"] += sum(rows) if bucket is None else bucket
            buckets[shape] += 1
        sampled = {r: SampledToken(1, None, ()) for r in batch.sample_req_ids}
        sched.update(batch, StepOutput((), lambda sampled=sampled: sampled))
    assert kv.num_free_blocks == kv.num_total_blocks
    return {
        **counts,
        "steps_by_kind_and_loops": dict(sorted(steps.items())),
        "invocations_by_kind_and_bucket": dict(sorted(buckets.items())),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--inputs", choices=list(INPUTS), default="fixed")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--wcpb-cap", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="the matrix's seed + repeat")
    add_async_scheduling_flag(
        p,
        default=False,
        help="model the engine's async scheduling (its default): each step's tokens are applied "
        "after the next step is scheduled, unless nothing can be planned without them, so "
        "finished requests may free their slots a step later (default: off, every step's "
        "tokens applied at once)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    # the matrix's workload (its prompt lengths; the token ids do not matter here)
    wl = build_workload("concurrent", args.num_requests, INPUTS[args.inputs], 1, 2, seed=args.seed)
    lens = [len(r.prompt_token_ids) for r in wl.requests]
    modes = {m: replay(m, lens, args, args.async_scheduling) for m in args.modes}
    result = {"args": vars(args), "modes": modes}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    for mode, r in result["modes"].items():
        print(
            f"{mode:>9}: {r['steps']} steps, {r['invocations']} invocations "
            f"({r.get('prefill_invocations', 0)} prefill, {r.get('mixed_invocations', 0)} mixed, "
            f"{r.get('decode_invocations', 0)} decode), {r['rows']} rows in {r['bucket_rows']} "
            "bucket rows"
        )
    return result


if __name__ == "__main__":
    main()
