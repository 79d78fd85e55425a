"""Speculation with the exit gate (docs/design/speculative.md §3), CPU fp32: device runs with
lanes give every request what host-decided plain decoding gives it (tokens, exit depths, finish
reasons, text), greedy requests drafting and the others decoding plainly beside them, in both
gate modes, for several K and d, with staggered arrivals, stop tokens, EOS, `max_tokens`,
preemption, prefix hits and carried runs; on the packaged model, whose trained gate and depths
accept most drafts, a request takes far fewer invocations than it runs loops. What neither
windows nor lanes cover is refused."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.engine.harness import Job, kv_all_free, make_engine, random_extras
from tests.engine.test_device_runs import _assert_same, _run
from vllm_rlt.config import ConfigError
from vllm_rlt.core.sched import device_runs as sched_runs
from vllm_rlt.core.sched import spec_governor
from vllm_rlt.engine import assembly
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker import run_rows_torch
from vllm_rlt.worker.device_runs import DeviceRunner

D = 4  # the packaged model's loops


def _jobs(seed: int, num: int = 8) -> list[Job]:
    """Mostly greedy requests on the packaged model (text-like prompts), some with their own
    threshold or `min_loops`, stop ids or EOS; a sampled one and one asking for logprobs
    (both decode plainly), some with a logit bias; staggered arrivals, a shared system
    prompt."""
    rng = random.Random(seed)
    system = rng.choices(range(40, 120), k=10)
    jobs = []
    for i in range(num):
        kind = rng.choice(["greedy"] * 6 + ["sampled", "logprobs"])
        params = SamplingParams(
            max_tokens=rng.randint(4, 40),
            temperature=0.8 if kind == "sampled" else 0.0,
            seed=rng.randrange(10**6),
            logprobs=2 if kind == "logprobs" else None,
            exit_threshold=rng.choice([None, None, 0.4, 0.8]),
            min_loops=rng.choice([None, None, 2]),
            ignore_eos=rng.random() < 0.6,
            stop_token_ids=rng.sample(range(40, 120), 3) if rng.random() < 0.3 else (),
            **random_extras(seed, i, range(40, 120), penalties=False),
        )
        prompt = rng.choice([system, []]) + rng.choices(range(40, 120), k=rng.randint(2, 24))
        jobs.append(Job(f"j{i}", prompt, params, rng.choice([0, 0, 0, 2, 6])))
    return jobs


def _lanes_runs(eng) -> list[int]:
    """Count the runs with lanes, and those carried, into the returned list; check that no row
    takes more tokens in a run than the scheduler's bound on them (which lets runs go on while
    a request waits for a seat no row can free): one per sample phase, and those of the lanes
    live at a carried run's start (a fresh run starts with one)."""
    count, schedule, record = [0, 0], eng.scheduler.schedule, eng.scheduler.runs.record

    def checked(run, results):
        bound = sum(run.sample_at) + (run.lanes if run.carried and run.lanes > 1 else 0)
        assert all(len(r.sampled) <= bound for r in results), (run, results)
        record(run, results)

    eng.scheduler.runs.record = checked

    def counting():
        batch = schedule()
        run = batch.decode_run
        if run is not None and run.lanes > 1:
            count[0] += 1
            count[1] += run.carried
        return batch

    eng.scheduler.schedule = counting
    return count


_PLAIN: dict = {}


def _plain(mode: str, jobs: list[Job], **kw) -> dict:
    """Host-decided plain decoding of `jobs` (cached per mode and settings)."""
    key = (mode, repr(jobs), tuple(sorted(kw.items())))
    if key not in _PLAIN:
        eng = make_engine(default_model_dir(), exit_mode=mode, device_decode_loops=0, **kw)
        eng.eos_token_ids = (7, 11)
        _PLAIN[key] = _run(eng, jobs)
    return _PLAIN[key]


@pytest.mark.parametrize(
    "mode,k,draft_loops",
    [("ouro", 1, 1), ("ouro_delayed", 3, 1), ("ouro", 2, 2), ("ouro_delayed", 4, 3)],
)
def test_lanes_compute_what_plain_decoding_computes(mode, k, draft_loops):
    jobs = _jobs(len(mode))  # (one plain reference per mode)
    eng = make_engine(default_model_dir(), exit_mode=mode, max_num_seqs=6,
                      num_speculative_tokens=k, speculative_draft_loops=draft_loops)  # fmt: skip
    eng.eos_token_ids = (7, 11)
    lanes = _lanes_runs(eng)
    got = _run(eng, jobs)
    assert kv_all_free(eng)
    assert lanes[0] > 0
    _assert_same(eng, jobs, got, _plain(mode, jobs, max_num_seqs=6), exact=True)
    stats = eng.stats_dict()  # drafts were made and (the packaged model) mostly accepted
    assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"] > 0
    assert stats["spec_acceptance_rate"] > 0.3 and stats["spec_mean_accepted_length"] > 1


def test_warm_up_changes_no_result():
    """The runner's start-up warm-up (on CUDA it captures every function of plain runs and runs
    with lanes, `settle` included, over idle rows; here it runs them eagerly) leaves nothing
    that changes what the requests after it get."""
    jobs = _jobs(4)
    eng = make_engine(default_model_dir(), max_num_seqs=6, num_speculative_tokens=3)
    eng.runner.runs.warm_up("ouro", 1, 8)
    eng.eos_token_ids = (7, 11)
    lanes = _lanes_runs(eng)
    got = _run(eng, jobs)
    assert kv_all_free(eng) and lanes[0] > 0
    _assert_same(eng, jobs, got, _plain("ouro", jobs, max_num_seqs=6), exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lanes_on_gpu(backend):
    """On CUDA (the Triton `take_lanes`, captured graphs), fp32: what host-decided decoding
    computes, up to proven near-ties."""
    jobs = _jobs(3)
    results = {}
    for k, loops in ((3, 16), (0, 0)):
        eng = make_engine(default_model_dir(), "cuda", backend, max_num_seqs=6,
                          num_speculative_tokens=k, device_decode_loops=loops)  # fmt: skip
        eng.eos_token_ids = (7, 11)
        lanes = _lanes_runs(eng)
        results[k] = _run(eng, jobs)
        assert kv_all_free(eng) and bool(lanes[0]) == bool(k)
    _assert_same(eng, jobs, results[3], results[0], exact=False)


def test_preemption_prefix_hits_and_carried_runs():
    """A KV cache that forces preemptions, prompts sharing a cached prefix, and runs that go on
    from the one before: the same results, every block given back."""
    jobs = _jobs(5, num=10)
    kw = dict(max_num_seqs=5, num_kv_blocks=160, block_size=4, enable_prefix_caching=True)
    eng = make_engine(default_model_dir(), num_speculative_tokens=3, **kw)
    eng.eos_token_ids = (7, 11)
    lanes = _lanes_runs(eng)
    got = _run(eng, jobs)
    assert kv_all_free(eng) and eng.scheduler.prefix_hits > 0
    assert eng.scheduler.num_preemptions > 0 and lanes[0] > 0 and lanes[1] > 0
    _assert_same(eng, jobs, got, _plain("ouro", jobs, **kw), exact=True)


def test_requests_with_penalties_decode_plainly_beside_lanes():
    """A run over a request with a penalty has no lanes (its logits depend on the tokens
    before): every request gets what plain decoding gives it."""
    jobs = _jobs(9)
    jobs = [Job(j.req_id, j.prompt, replace(j.params, presence_penalty=1.0), j.arrival_step)
            if i % 3 == 0 else j for i, j in enumerate(jobs)]  # fmt: skip
    eng = make_engine(default_model_dir(), max_num_seqs=6, num_speculative_tokens=3)
    eng.eos_token_ids = (7, 11)
    got = _run(eng, jobs)
    assert kv_all_free(eng)
    _assert_same(eng, jobs, got, _plain("ouro", jobs, max_num_seqs=6), exact=True)


def test_no_more_lanes_live_than_the_model_has_loops(monkeypatch):
    """`run_lanes` gives a row at most as many lanes as the model has loops: with one lane more
    (the bound lifted), no sample phase leaves more than that many of a row's lanes live, and
    with tokens running deep (a high threshold) some phase reaches it."""
    monkeypatch.setattr(assembly, "run_lanes", lambda drafts, loops: drafts + 1)
    monkeypatch.setattr(sched_runs, "run_lanes", lambda drafts, loops: drafts + 1)
    take, most = run_rows_torch.take_lanes, [0]

    def counted(s, n, lanes, draft_loops, token_ids):
        take(s, n, lanes, draft_loops, token_ids)
        most[0] = max(most[0], int((~s.done[: n * lanes].view(n, lanes)).sum(1).max()))

    monkeypatch.setattr(run_rows_torch, "take_lanes", counted)
    eng = make_engine(default_model_dir(), max_num_seqs=2, num_speculative_tokens=D)
    assert eng.scheduler.runs._lanes([], (), 1).lanes == D + 1  # (the bound is lifted)
    params = SamplingParams(max_tokens=24, temperature=0.0, exit_threshold=0.97, ignore_eos=True)
    rng = random.Random(5)
    _run(eng, [Job(f"r{i}", rng.choices(range(40, 120), k=12), params, i) for i in range(3)])
    assert most[0] == D


def test_a_request_takes_fewer_invocations_than_loops(monkeypatch):
    """Concurrency 1 on the packaged model at its default threshold: with drafts of one loop
    accepted, a token takes about one invocation where plain decoding runs its ~1.9 loops."""
    calls = [0]
    step = DeviceRunner._step

    def counted(self, rows):
        calls[0] += 1
        return step(self, rows)

    monkeypatch.setattr(DeviceRunner, "_step", counted)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    jobs = [Job(f"r{i}", rng.choices(range(40, 120), k=20), params) for i in range(3)]
    invocations = {}
    for k in (0, 4):
        calls[0] = 0
        eng = make_engine(default_model_dir(), max_num_seqs=1, num_speculative_tokens=k)
        got = _run(eng, jobs)
        invocations[k] = calls[0]
    loops = sum(sum(v[1]) for v in got.values())
    tokens = sum(len(v[0]) for v in got.values())
    assert invocations[0] >= loops - 3 * 4  # plain: one loop per invocation (not the prompts')
    assert loops > 1.5 * tokens and invocations[4] < 0.7 * invocations[0]


def test_what_speculation_refuses():
    model = default_model_dir()
    with pytest.raises(ConfigError, match="exit_mode='trace'"):
        make_engine(model, num_speculative_tokens=2, exit_mode="trace")
    with pytest.raises(ConfigError, match="device_decode_loops"):
        make_engine(model, num_speculative_tokens=2, device_decode_loops=0)
    with pytest.raises(ConfigError, match="device_decode_loops"):
        make_engine(model, num_speculative_tokens=2, scheduling_mode="no_refill")
    eng = make_engine(model, num_speculative_tokens=2)  # the gate on: any exit settings
    for params in (SamplingParams(exit_threshold=0.3), SamplingParams(max_loops=2)):
        eng.add_request(f"x{params.max_loops}", [50, 60, 70], params)
    assert eng.scheduler.spec is None  # no windows: lanes


def test_the_measured_fallback_ends_lanes_that_measure_slower(monkeypatch):
    """Speculation with the exit gate under `speculative_fallback`, on a clock the test drives
    that charges ten times as much for a step while the governor speculates, in phases of 8
    steps (runs of 8 invocations take few steps): plain decoding measures faster than the better of
    two looks at speculation, no run planned while the governor says so has lanes (a carried run
    with lanes ends), and the tokens and exit depths are plain decoding's."""
    monkeypatch.setattr(spec_governor, "PHASE_STEPS", 8)
    monkeypatch.setattr(spec_governor, "SETTLE_STEPS", 2)
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    rng = random.Random(4)
    jobs = [Job(f"r{i}", rng.choices(range(40, 120), k=16), params) for i in range(2)]
    settings = dict(max_num_seqs=2, device_decode_loops=8)
    want = _run(make_engine(default_model_dir(), **settings), jobs)
    eng = make_engine(
        default_model_dir(), num_speculative_tokens=3, speculative_fallback=True, **settings
    )
    gov, now, runs = eng.scheduler.governor, [0.0], []  # runs: (mode, lanes?) of each run
    gov.clock = lambda: now[0]
    observe, schedule = gov.observe, eng.scheduler.schedule

    def timed(tokens: int, num_decoding: int) -> None:
        now[0] += 10.0 if gov.speculate else 1.0
        observe(tokens, num_decoding)

    def noted():
        speculate, batch = gov.speculate, schedule()
        if batch.decode_run is not None:
            runs.append((speculate, batch.decode_run.lanes > 1))
        return batch

    gov.observe, eng.scheduler.schedule = timed, noted
    _assert_same(eng, jobs, _run(eng, jobs), want, exact=True)
    assert gov.rates[2, False] > gov.rates[2, True]  # (2 decoding requests: load bucket 2)
    assert any(lanes for on, lanes in runs if on)
    assert any(not on for on, _ in runs) and not any(lanes for on, lanes in runs if not on)


@pytest.mark.parametrize("run_loops", [2, 3])
def test_carried_runs_with_lanes_reserve_the_positions_their_lanes_reach(run_loops):
    """Runs of 2 or 3 invocations carried one after another: lanes live at a carried run's
    start stand up to lanes - 1 positions past the newest token, so the run reserves the blocks
    of those too (before, a lane wrote its KV through a block table that did not reach its
    position, and greedy tokens parted from plain decoding's after 20 to 80 tokens)."""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    rng = random.Random(4)
    jobs = [Job(f"r{i}", rng.choices(range(40, 120), k=16), params) for i in range(2)]
    settings = dict(max_num_seqs=2, device_decode_loops=run_loops)
    want = _run(make_engine(default_model_dir(), **settings), jobs)
    eng = make_engine(default_model_dir(), num_speculative_tokens=3, **settings)
    count = _lanes_runs(eng)
    _assert_same(eng, jobs, _run(eng, jobs), want, exact=True)
    assert count[0] > 10 and count[1] > 10  # runs with lanes, carried ones among them
    assert kv_all_free(eng)
