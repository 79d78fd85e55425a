"""Timed replay of WCPB-matrix cells on the CPU: the real `Scheduler` (the matrix's settings of
each mode) against the matrix's workload (`build_workload`, its arrival times and seed), its
clock advanced by a fitted per-invocation cost model. Predictions, not measurements.

    python -m benchmarks.timed_replay --cells 10 11 --num-requests 100 --seeds 0 1 2
    python -m benchmarks.timed_replay --cells 2 3 8 9 10 11 --modes split wcpb-noride wcpb
    python -m benchmarks.timed_replay --cells 11 --candidate apart '{"max_context_with_decode": 0}'

Clocks (the engine's async scheduling): the host schedules and queues step N (`--host-ms`),
then waits for step N-1's sampled tokens, which are emitted then; the device starts step N when
it is queued and step N-1 is done, samples first (`SAMPLE_MS`), then runs its invocations.
Device ms per invocation of d decode rows and p prefill rows (context <= 2K; fitted to the H200
profiles of docs/benchmarks/long-prompts.md):
  decode-only   1.20 + 0.045 d                       (1 row 1.24, 4 rows 1.38, 8 rows 1.56)
  prefill-only  max(1.5, 1.0 + 0.0039 p)             (512 rows 3.02, 1024 rows 5.03)
  mixed         fit: 2.7 + 0.0029 p                  (128+7 3.18, 256+7 3.2-3.9, 512+7 4.1-4.5)
                additive: prefill-only(p) + 1.2      (--mixed additive: a decode surcharge)
                matrix: 1.85 + 0.0032 p              (the arrival cells' p99 gaps, see MIXED)
Per mode: ITL p50/p90/p99, TTFT p50, req/s, the share of ITL gaps that rode a prefill
invocation, and the shapes of the gaps at or above the p99: the prefill rows (rounded up to 128)
of each invocation with prefill rows that ran while the token was in flight, in brackets the
prefill-only ones it waited for.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from benchmarks.schedule_replay import DEPTH, make_request, make_scheduler
from benchmarks.wcpb_matrix import CYCLED, INPUTS, MODES, PROFILES, cells
from vllm_rlt.core.sched.execution_batch import RowKind, SampledToken, StepOutput
from vllm_rlt.entrypoints.bench.workload import build_workload

SAMPLE_MS = 0.1


def prefill_only_ms(prefill: int) -> float:
    return max(1.5, 1.0 + 0.0039 * prefill)


MIXED = {  # device ms of an invocation of `p` prefill rows beside decode rows
    "fit": lambda p: 2.7 + 0.0029 * p,
    "additive": lambda p: prefill_only_ms(p) + 1.2,
    # implied by the matrix's arrival cells: Split's p99 gap ~ 4 mixed invocations of 128 rows
    # (9.5 ms), WCPB's ~ 4 of 256 (10.9-11.6 ms) and 4 of 512 (14.2 ms, cell 10, repeat 2)
    "matrix": lambda p: 1.85 + 0.0032 * p,
}


def invocation_ms(decode: int, prefill: int, mixed_model: str = "fit") -> float:
    """Device ms of one recurrent-core invocation (the model in the module docstring)."""
    if not prefill:
        return 1.20 + 0.045 * decode
    return MIXED[mixed_model](prefill) if decode else prefill_only_ms(prefill)


def simulate(mode: str, workload, args, settings: dict) -> dict:
    """One timed run of `workload` under `mode` (+ `settings`): metrics and the tail's shapes."""
    sched = make_scheduler(mode, args, **{**settings, "async_scheduling": True})
    specs, step_s = workload.requests, args.host_ms / 1e3
    free = [0.0] * workload.concurrency  # times the client's slots free up
    sent: dict[str, float] = {}
    rides: dict[str, list[list[int]]] = {}  # per sampled token: prefill rows of each invocation
    tokens: dict[str, list[float]] = {}  # emission times
    gaps: list[tuple[float, list[int]]] = []  # (ITL s, the token's rides)
    host = dev_end = 0.0
    sampled_at = None  # the time the last step's tokens are sampled (async scheduling reads them)
    nxt = 0
    while nxt < len(specs) or sched.has_unfinished():
        while nxt < len(specs) and free and max(specs[nxt].arrival_s, min(free)) <= host:
            sent[str(nxt)] = max(specs[nxt].arrival_s, min(free))  # the engine sees it now
            free.remove(min(free))
            n, out = len(specs[nxt].prompt_token_ids), specs[nxt].output_len
            sched.add_request(make_request(str(nxt), n, out))
            nxt += 1
        if not sched.has_unfinished():
            host = max(specs[nxt].arrival_s, min(free))
            continue
        batch = sched.schedule()
        for r in batch.sample_req_ids:  # its token's loops are over: a new one starts
            rides.setdefault(r, []).append([])
        start = max(dev_end, host + step_s)
        ms = SAMPLE_MS if batch.sample_req_ids else 0.0
        for i in range(batch.loop_count):
            live = [t for t, _ in batch.live(i, DEPTH)]
            if not live:
                break
            decode = [t.request_id for t in live if t.kind is RowKind.DECODE]
            prefill = sum(t.num_tokens for t in live if t.kind is RowKind.PREFILL)
            ms += invocation_ms(len(decode), prefill, args.mixed)
            for r in rides.keys() & sched.requests.keys():  # a token in flight waits for it
                rides[r][-1].append(prefill if r in decode else -prefill)
        dev_end = start + ms / 1e3
        host += step_s
        sampled = {r: SampledToken(1, None, ()) for r in batch.sample_req_ids}
        got = sched.update(batch, StepOutput((), lambda sampled=sampled: sampled))
        ready, sampled_at = sampled_at, start + SAMPLE_MS / 1e3 if batch.sample_req_ids else None
        if not got:
            continue
        host = max(host, ready)
        for req, _ in got:
            times = tokens.setdefault(req.request_id, [])
            if times:
                gaps.append((host - times[-1], rides[req.request_id][len(times) - 1]))
            times.append(host)
            if req.status.finished:
                free.append(host)
    return _metrics(sent, tokens, gaps)


def _metrics(sent: dict, tokens: dict, gaps: list) -> dict:
    itl = np.asarray([g for g, _ in gaps])
    p99 = float(np.percentile(itl, 99))
    ttft = [tokens[r][0] - t for r, t in sent.items()]
    tail = Counter(
        "+".join(_rows(p) for p in ride if p) or "decode only" for g, ride in gaps if g >= p99
    )
    return {
        "req/s": len(sent) / max(t[-1] for t in tokens.values()),
        "TTFT p50 ms": float(np.median(ttft)) * 1e3,
        **{f"ITL p{q} ms": float(np.percentile(itl, q)) * 1e3 for q in (50, 90, 99)},
        "gaps waiting for prefill": sum(any(ride) for _, ride in gaps) / len(gaps),
        "tail shapes": dict(tail.most_common()),
    }


def _rows(prefill: int) -> str:
    """Prefill rows of an invocation rounded up to 128; in brackets when the token did not ride
    it (a prefill-only invocation it waited for)."""
    rows = str(-(-abs(prefill) // 128) * 128)
    return rows if prefill > 0 else f"({rows})"


def cell_workload(cell: int, args, seed: int):
    """The matrix's workload of cell `cell` (its index in `--cells`) with seed `seed`."""
    chunk, profile, inputs = cells([32, 128])[cell]
    p = PROFILES[profile]
    wl = build_workload(
        p["profile"], args.num_requests, INPUTS[inputs], args.output_len, 2,
        concurrency=p["concurrency"], rate=p.get("rate", 2.0), seed=seed, cycle=inputs in CYCLED,
    )  # fmt: skip
    return chunk, wl


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", type=int, nargs="+", default=[10, 11], help="the matrix's indices")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="the matrix's seed + repeat")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["split", "wcpb"])
    p.add_argument("--wcpb-cap", type=int, default=256)
    p.add_argument(
        "--candidate", nargs=2, action="append", default=[], metavar=("NAME", "JSON"),
        help="another mode: WCPB with these SchedulerConfig settings over its own",
    )  # fmt: skip
    p.add_argument("--host-ms", type=float, default=0.8, help="host time per engine step")
    p.add_argument("--mixed", choices=list(MIXED), default="fit")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs = [(m, m, {}) for m in args.modes]
    runs += [(name, "wcpb", json.loads(s)) for name, s in args.candidate]
    result = {}
    for cell in args.cells:
        for seed in args.seeds:
            args.chunk, wl = cell_workload(cell, args, seed)
            for name, mode, settings in runs:
                r = simulate(mode, wl, args, settings)
                result[f"cell {cell} seed {seed} {name}"] = r
                nums = " ".join(f"{k} {v:.4g}" for k, v in r.items() if k != "tail shapes")
                print(f"cell {cell} seed {seed} {name:>10}: {nums}", flush=True)
                print(f"    tail: {r['tail shapes']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": result}, f, indent=1)
    return result


if __name__ == "__main__":
    main()
