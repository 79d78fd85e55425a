"""Device runs (docs/design/runner.md §7): decode steps whose exits, sampling and re-entry
happen on the device, alone or riding prefill batches, compute what host-decided decoding
computes: tokens, exit depths,
finish reasons, text and logprobs, in every exit mode, with seeded sampling, stop tokens, EOS,
stop strings, max_tokens, preemption and prefix hits, WCPB, aborts while a carried run is
queued, eagerly and through captured CUDA graphs (on the GPU); and they take far fewer engine
steps."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from tests.engine.harness import Job, compare, kv_all_free, make_engine, random_extras
from vllm_rlt.config_sched import OFFLINE_RUN_LOOPS, SERVER_RUN_LOOPS, SchedulerConfig
from vllm_rlt.core.sched.device_runs import RunPlanner
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.engine.async_engine import AsyncLLMEngine
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.request import DecodeToken, ExitSettings, Request
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker.invocation_timer import InvocationTimer

TARGETS = [
    ("cpu", "torch"),
    pytest.param("cuda", "torch", marks=pytest.mark.gpu),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu),
]
MODES = {"ouro": {}, "ouro_delayed": {}, "trace": {"trace_seed": 3}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


def _jobs(seed: int, num: int = 8, extras: bool = False) -> list[Job]:
    """Gate-reading decoding (thresholds, min and max loops), greedy and seeded sampling with
    top-k / top-p / min-p, logprobs, stop token ids (`extras`: logit biases and penalties too);
    most arrive together, a few later."""
    rng = random.Random(seed)
    jobs = []
    for i in range(num):
        greedy = rng.random() < 0.5
        min_loops = rng.choice([None, 1, 2])
        params = SamplingParams(
            max_tokens=rng.randint(3, 24),
            temperature=0.0 if greedy else rng.choice([0.7, 1.2]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
            min_p=rng.choice([0.0, 0.0, 0.1]),
            **(random_extras(seed, i, range(256)) if extras else {}),
            seed=rng.randrange(10**6),
            exit_threshold=rng.choice([0.3, 0.5, 0.7, 1.0]),
            min_loops=min_loops,
            max_loops=rng.choice([None, None, max(min_loops or 1, 3)]),
            logprobs=rng.choice([None, 0, 2]),
            ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(range(256), 6) if rng.random() < 0.3 else (),
        )
        prompt = rng.choices(range(256), k=rng.randint(1, 20))
        jobs.append(Job(f"j{i}", prompt, params, rng.choice([0, 0, 0, 3, 9])))
    return jobs


def _run(eng, jobs: list[Job]) -> dict:
    """{request: (tokens, exit depths, finish reason, text, logprobs)}."""
    pending, final, step = sorted(jobs, key=lambda j: j.arrival_step), {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            job = pending.pop(0)
            eng.add_request(job.req_id, job.prompt, job.params)
        for out in eng.step():
            if out.finished:
                c = out.outputs[0]
                final[out.request_id] = (tuple(c.token_ids), tuple(c.exit_depths),
                                         c.finish_reason, c.text, c.logprobs)  # fmt: skip
        step += 1
    return final


def _count_runs(eng) -> list[int]:
    """Count the steps the scheduler plans as device runs, those of them that go on from the
    run before (carried) and those beside prefill tasks, into the returned list."""
    count, schedule = [0, 0, 0], eng.scheduler.schedule

    def counting():
        batch = schedule()
        if batch is not None and batch.decode_run is not None:
            count[0] += 1
            count[1] += batch.decode_run.carried
            count[2] += len(batch.requests) > len(batch.decode_run.rows)
        return batch

    eng.scheduler.schedule = counting
    return count


def _assert_same(eng, jobs, got: dict, want: dict, exact: bool) -> None:
    """Same tokens and exit depths (on the GPU: or a proven near-tie, `compare`), finish
    reasons and text; logprobs to fp32 rounding (the coda's rows differ between the two)."""
    if exact:
        assert {k: v[:4] for k, v in got.items()} == {k: v[:4] for k, v in want.items()}
    else:
        pick = lambda res: {k: v[:2] for k, v in res.items()}  # noqa: E731
        if compare(eng, jobs, pick(got), pick(want), "last_exited"):
            return  # a near-tie parts the two: what follows it differs
    for req_id, (*_, lps) in got.items():
        for i, (a, b) in enumerate(zip(lps or (), want[req_id][4] or (), strict=True)):
            assert a.keys() == b.keys(), (req_id, i)
            # fp32 rounding: on CUDA the LM head over a run's lanes is another GEMM than over
            # one row per request, and a logprob of -6 then moves by ~1e-5 (2e-6 relative)
            near = all(math.isclose(a[t], b[t], rel_tol=1e-5, abs_tol=1e-5) for t in a)
            assert near, (req_id, i, a, b)


@pytest.mark.parametrize("device,backend", TARGETS)
@pytest.mark.parametrize("mode", list(MODES))
def test_device_runs_compute_what_the_host_path_computes(model_dir, device, backend, mode):
    jobs = _jobs(len(mode))
    results, steps = {}, {}
    for loops in (0, 16):
        eng = make_engine(model_dir, device, backend, max_num_seqs=8, exit_mode=mode,
                          device_decode_loops=loops, **MODES[mode])  # fmt: skip
        eng.eos_token_ids = tuple(range(0, 256, 11))  # requests not ignoring EOS may stop on it
        runs = _count_runs(eng)
        results[loops] = _run(eng, jobs)
        steps[loops] = eng.stats.steps
        assert kv_all_free(eng)
        assert bool(runs[0]) == bool(runs[1]) == bool(loops)
    _assert_same(eng, jobs, results[16], results[0], exact=device == "cpu")
    assert steps[16] < steps[0] / 2


def _arriving_jobs(seed: int, num: int = 8) -> list[Job]:
    """`_jobs` with longer prompts, arriving one after another."""
    rng = random.Random(41)
    return [
        Job(j.req_id, j.prompt + rng.choices(range(256), k=rng.randint(5, 40)), j.params, 2 * i)
        for i, j in enumerate(_jobs(seed, num))
    ]  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
def test_runs_beside_prefill(model_dir, mode):
    """Requests arriving one after another, their prompts in prefill while others decode: the
    decode rows ride the prefill batches as device runs and compute what host decisions do."""
    jobs = _arriving_jobs(40 + len(mode))
    results = {}
    for loops in (0, 16):
        eng = make_engine(model_dir, max_num_seqs=6, exit_mode=mode, device_decode_loops=loops,
                          prefill_chunk_size=16, **MODES[mode])  # fmt: skip
        runs = _count_runs(eng)
        results[loops] = _run(eng, jobs)
        assert kv_all_free(eng)
        assert (runs[2] >= 2) == bool(loops), runs
    _assert_same(eng, jobs, results[16], results[0], exact=True)


def _closed_loop(eng, jobs: list[Job], seats: int) -> dict:
    """`_run`'s results, `seats` requests submitted at first and one more after each step in
    which one finished (a client sending its next request when its stream ends)."""
    pending, final = list(jobs), {}
    for job in pending[:seats]:
        eng.add_request(job.req_id, job.prompt, job.params)
    pending = pending[seats:]
    while pending or eng.has_unfinished_requests():
        ended = [out for out in eng.step() if out.finished]
        for out in ended:
            c = out.outputs[0]
            final[out.request_id] = (tuple(c.token_ids), tuple(c.exit_depths),
                                     c.finish_reason, c.text, c.logprobs)  # fmt: skip
        for job in pending[: len(ended)]:
            eng.add_request(job.req_id, job.prompt, job.params)
        pending = pending[len(ended) :]
    return final


@pytest.mark.parametrize("device,backend", TARGETS)
@pytest.mark.parametrize("mode", ["ouro", "trace"])
def test_a_run_goes_on_beside_an_arrivals_prefill_unread(model_dir, device, backend, mode):
    """A request arriving while a run is in flight, a seat free: its prefill batch is planned
    and queued before the run is read back, the run going on beside it (carried), also where
    the seat is that of a row whose request ended on a token of the run before (the row idles,
    the runner has forgotten its request); a run that rode a prompt goes on beside its next
    chunk the same way, and the prompt's row joins it once its prefill is done; every request
    gets what host decisions give it."""
    jobs = _arriving_jobs(44, num=16)
    kw = dict(max_num_seqs=4, exit_mode=mode, prefill_chunk_size=16, **MODES[mode])
    want = _closed_loop(make_engine(model_dir, device, backend, device_decode_loops=0, **kw),
                        jobs, 4)  # fmt: skip
    eng = make_engine(model_dir, device, backend, device_decode_loops=4, **kw)
    rides, joins, schedule = [], [], eng.scheduler.schedule

    def recording():
        flight = eng.scheduler._flight
        batch = schedule()
        run = batch.decode_run
        if run is not None and run.carried and len(batch.requests) > len(run.rows):
            rows = batch.requests[: len(run.rows)]
            gone = any(t.request_id not in eng.scheduler.requests for t in rows)
            rode = len(flight.requests) > len(flight.decode_run.rows)  # (a prompt's next chunk)
            rides.append((eng.scheduler._unread_run is not None, gone, rode))  # (flight unread)
        if run is not None and run.joined:  # rows of prompts the run in flight rode to the end
            joins.append(eng.scheduler._unread_run is not None)
        return batch

    eng.scheduler.schedule = recording
    _assert_same(eng, jobs, _closed_loop(eng, jobs, 4), want, exact=device == "cpu")
    assert kv_all_free(eng)
    assert rides and all(unread for unread, *_ in rides), rides
    assert any(gone for _, gone, _ in rides) and any(rode for *_, rode in rides), rides
    assert joins and all(joins), joins


@pytest.mark.parametrize("run_loops", [2, 3])
def test_runs_shorter_than_a_tokens_loops(model_dir, run_loops):
    """device_decode_loops below the model's depth: runs alone take at most that many
    invocations, also while a prompt waits for its turn (before, one token's loops: longer
    than asked), and runs beside prefill the prefill batch's loops, up to the depth (before,
    more sample phases than the runs' buffers held: an IndexError); results as host decisions
    give them."""
    jobs = _arriving_jobs(43)
    want = _run(make_engine(model_dir, max_num_seqs=3, device_decode_loops=0,
                            prefill_chunk_size=16), jobs)  # fmt: skip
    eng = make_engine(model_dir, max_num_seqs=3, device_decode_loops=run_loops,
                      prefill_chunk_size=16)  # fmt: skip
    loops, schedule = [], eng.scheduler.schedule

    def recording():
        batch = schedule()
        if batch.decode_run is not None:
            beside = len(batch.requests) > len(batch.decode_run.rows)
            loops.append((beside, batch.loop_count))
        return batch

    eng.scheduler.schedule = recording
    _assert_same(eng, jobs, _run(eng, jobs), want, exact=True)
    assert kv_all_free(eng)
    assert max(n for beside, n in loops if not beside) == run_loops
    assert max(n for beside, n in loops if beside) == eng.num_loops > run_loops


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_runs_are_short_while_a_seat_may_free(model_dir, ignore_eos):
    """While a request waits for a seat that a row may free within the run, a run takes no
    more invocations than no row can end within (a row with m tokens left before max_tokens:
    fewer than m - 1, as a run of n takes up to n + 1 tokens), at least a full-depth
    token's loops; with a stop token a row may end on any token, so runs are one token's
    loops (its admission, and the streams' next tokens, wait no longer than at fixed depth).
    Otherwise runs take up to device_decode_loops invocations."""
    eng = make_engine(model_dir, max_num_seqs=2, device_decode_loops=16)
    eng.eos_token_ids = (7, 11)
    lengths, schedule, flight = [], eng.scheduler.schedule, [None]

    def recording():
        s = eng.scheduler
        left = min(r.sampling_params.max_tokens - r.num_sampled for r in s.running or s.waiting)
        waiting = bool(s.waiting)
        batch = schedule()
        run = batch.decode_run
        if run is not None and len(batch.requests) == len(run.rows) and not run.joined:
            # (a run alone; a carried one's rows are in the states its flight started from)
            before = RunPlanner._takes(flight[0]) if run.carried else 0
            lengths.append((waiting, left - before, batch.loop_count))
        flight[0] = run
        return batch

    eng.scheduler.schedule = recording
    params = SamplingParams(max_tokens=40, ignore_eos=ignore_eos, exit_threshold=0.5, temperature=0)
    _run(eng, [Job(f"j{i}", [3 + i] * 9, params) for i in range(5)])
    assert kv_all_free(eng)
    D, reach = eng.num_loops, eng.scheduler.runs.max_loops + 1  # (tokens a fresh run may take)
    long = [(left, n) for w, left, n in lengths if w and n > D]
    assert any(w for w, *_ in lengths) and max(n for *_, n in lengths) > D
    if ignore_eos:  # long runs while a request waits; within reach of max_tokens, to m - 2
        assert long and all(n <= max(D, left - 2) for left, n in long), lengths
        assert any(left <= reach for left, _ in long), lengths  # (not one token's loops)
    else:
        assert not long, lengths


def test_the_server_runs_shorter_runs_by_default(model_dir):
    """Offline, runs take up to OFFLINE_RUN_LOOPS invocations; an engine serving arrivals
    (AsyncLLMEngine, `vllm-rlt serve`) up to SERVER_RUN_LOOPS; a value given is kept."""
    kw = {"num_kv_blocks": 256, "block_size": 4, "dtype": "float32"}
    assert make_engine(model_dir).scheduler.runs.max_loops == OFFLINE_RUN_LOOPS
    served = AsyncLLMEngine.from_kwargs(str(model_dir), **kw).engine
    assert served.scheduler.runs.max_loops == SERVER_RUN_LOOPS < OFFLINE_RUN_LOOPS
    served = AsyncLLMEngine.from_kwargs(str(model_dir), device_decode_loops=9, **kw).engine
    assert served.scheduler.runs.max_loops == 9
    assert "device runs of up to 9 invocations" in served.settings_summary()


def test_preemption_and_prefix_hits(model_dir):
    """A KV cache that forces preemptions (runs fall back to the host path where their blocks
    do not fit) and prompts that share a cached prefix: the same results as host-decided
    decoding."""
    rng = random.Random(7)
    system = rng.choices(range(256), k=12)
    jobs = [Job(j.req_id, system + j.prompt, j.params, j.arrival_step) for j in _jobs(11, num=8)]
    results, preempted = {}, {}
    for loops in (0, 16):
        eng = make_engine(model_dir, max_num_seqs=6, num_kv_blocks=80, block_size=4,
                          enable_prefix_caching=True, device_decode_loops=loops)  # fmt: skip
        runs = _count_runs(eng)
        results[loops] = _run(eng, jobs)
        preempted[loops] = eng.scheduler.num_preemptions
        assert kv_all_free(eng) and eng.scheduler.prefix_hits > 0
        assert bool(runs[0]) == bool(loops)
    assert preempted[16] > 0
    _assert_same(eng, jobs, results[16], results[0], exact=True)


def test_wcpb_prompts_beside_device_runs(model_dir):
    """WCPB with small chunks, prompts arriving while other requests decode in device runs: the
    same results as host-decided decoding."""
    rng = random.Random(5)
    jobs = [
        Job(j.req_id, j.prompt + rng.choices(range(256), k=rng.randint(10, 30)), j.params,
            j.arrival_step)
        for j in _jobs(31)
    ]  # fmt: skip
    results = {}
    for loops in (0, 16):
        eng = make_engine(model_dir, max_num_seqs=8, wavefront_chunked_prefill=True,
                          prefill_chunk_size=8, max_num_batched_tokens=32,
                          device_decode_loops=loops)  # fmt: skip
        runs = _count_runs(eng)
        results[loops] = _run(eng, jobs)
        assert kv_all_free(eng) and bool(runs[0]) == bool(loops)
    _assert_same(eng, jobs, results[16], results[0], exact=True)


def test_an_abort_while_a_carried_run_is_in_flight_ends_that_request_alone(model_dir):
    """Aborted while the run carrying it is queued: it ends with what it had, its blocks go back
    (the queued run still writes them, before anything planned later), and every other request
    computes what it computes without it."""
    jobs = [Job(j.req_id, j.prompt, j.params, 0) for j in _jobs(21, num=5)]
    jobs = [Job(j.req_id, j.prompt, replace(j.params, max_tokens=40), 0) for j in jobs]
    # (the aborted one cannot end before the carried run)
    jobs[0] = replace(jobs[0], params=replace(jobs[0].params, ignore_eos=True, stop_token_ids=()))
    want = _run(make_engine(model_dir, device_decode_loops=0), jobs[1:])
    eng = make_engine(model_dir, device_decode_loops=8)
    runs = _count_runs(eng)
    for job in jobs:
        eng.add_request(job.req_id, job.prompt, job.params)
    final = {}
    while not runs[1] and eng.has_unfinished_requests():  # until a carried run is in flight
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert runs[1], "no carried run was planned"
    aborted = eng.abort_request("j0")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    later = []
    while eng.has_unfinished_requests():
        later += eng.step()
    final.update({o.request_id: o for o in later if o.finished})
    assert "j0" not in {o.request_id for o in later}  # the queued run's tokens never come out
    got = {r: tuple(o.outputs[0].token_ids) for r, o in final.items()}
    assert got == {r: v[0] for r, v in want.items()}
    assert kv_all_free(eng)


def test_a_stop_string_inside_a_run_drops_the_tokens_after_it(model_dir):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, exit_threshold=0.5)
    probe = make_engine(model_dir, device_decode_loops=0)
    text = _run(probe, [Job("p", [7, 8, 9], greedy)])["p"][3]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, exit_threshold=0.5,
                            stop=[stop])  # fmt: skip
    got = {}
    for loops in (0, 16):
        eng = make_engine(model_dir, device_decode_loops=loops)
        got[loops] = _run(eng, [Job("s", [7, 8, 9], params)])["s"]
        assert kv_all_free(eng)
    assert got[16][:4] == got[0][:4]
    tokens, _, reason, out_text, _ = got[16]
    assert reason == "stop" and stop not in out_text and len(tokens) < 24


def test_the_timer_times_every_invocation_of_a_run(model_dir):
    eng = make_engine(model_dir, max_num_seqs=4)
    eng.runner.timer = InvocationTimer(eng.runner.device)
    runs = _count_runs(eng)
    _run(eng, _jobs(2, num=4))
    timed = eng.runner.timer.summary()
    assert runs[0] and sum(s["count"] for s in timed.values()) == eng.stats.invocations


def _planner(mode: str = "ouro") -> RunPlanner:
    return RunPlanner(SchedulerConfig(), None, make_exit_policy(mode, None), 4, True)


def _decoding(
    min_loops: int,
    max_loops: int,
    threshold: float,
    loops_done: int,
    trace: tuple[int, ...] | None = None,
    exit_at: int | None = None,
) -> Request:
    settings = ExitSettings(min_loops, max_loops, threshold, trace)
    req = Request("r", [1, 2], SamplingParams(max_tokens=99), settings, seed=0)
    req.output_token_ids.append(5)
    req.decode = DecodeToken(position=2, index=0, loops_done=loops_done, exit_at=exit_at)
    return req


def _sample_at(planner: RunPlanner, req: Request, loops: int) -> tuple[bool, ...]:
    return planner._sample_at([req], (planner._row(req, loops),), loops)


def test_samples_only_where_a_token_may_have_exited():
    planner = _planner()
    # every gate read but min_loops = max_loops = 4: a token exits every 4 loops
    assert _sample_at(planner, _decoding(4, 4, 0.6, 1), 12) == tuple(
        i in (3, 7, 11) for i in range(13)
    )
    # exits after 2 to 4 loops, the first token has run 1: from invocation 1 on
    gate = _sample_at(planner, _decoding(2, 4, 0.6, 1), 8)
    assert gate == (False, True, True, True, True, True, True, True, True)
    # a fixed-depth row beside a gated one samples at its depth's multiples only
    fixed = _sample_at(planner, _decoding(1, 4, 1.0, 0), 9)
    assert fixed == tuple(i in (4, 8) for i in range(10))
    # min_loops 1: any invocation may end a token
    assert _sample_at(planner, _decoding(1, 3, 0.6, 2), 6) == (False, *[True] * 6)


def test_traced_rows_sample_where_their_tokens_exit():
    # the current token (index 0) exits at 3 and has run 1; the next take 2, 1, 4, 2, 1 loops
    # (indices 1-5 of the trace), then max_loops (4) past its end
    planner = _planner("trace")
    req = _decoding(1, 4, 1.0, 1, trace=(3, 2, 1, 4, 2, 1), exit_at=3)
    assert _sample_at(planner, req, 12) == tuple(i in (2, 4, 5, 9, 11, 12) for i in range(13))
