"""Self-speculative decoding (docs/design/speculative.md), CPU fp32:

- greedy output with speculation equals serial output without it, token for token and exit
  depth for exit depth, in refill / no_refill / mixed scheduling and with WCPB, for K in
  {1, 2, 4} drafts of d in {1, 2, 3} loops, on random workloads with staggered arrivals;
  decode-only steps draft and verify a window at once (a window takes one step);
- the same under preemption (a KV cache that holds one longest request), with no block leak;
- sampled requests: each generated position's token distribution with speculation equals the
  one without (chi-square test of homogeneity, see `test_sampled_distribution_is_unchanged`);
- windows need fixed depth: a request of a fixed-depth engine cannot ask for exits.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from tests.engine.harness import Job, compare, kv_all_free, make_engine, run_batched, run_serial
from tests.helpers import chi_square_homogeneity, chi_square_sf
from vllm_rlt.config import ConfigError
from vllm_rlt.core.sched import spec_governor
from vllm_rlt.core.sched.execution_batch import RowKind
from vllm_rlt.core.sched.spec_governor import SETTLE_STEPS
from vllm_rlt.core.sched.spec_planner import SpecPlanner
from vllm_rlt.models.ouro import OuroForCausalLM
from vllm_rlt.models.tiny import default_model_dir, write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

D = 4
MODES = ("refill", "no_refill", "mixed", "wcpb")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


@pytest.fixture
def always_draft(monkeypatch):
    """Every window takes K drafts: the random test model accepts few, so the adaptive rule
    would soon stop drafting (with d = 3 at once), and the exactness under test is the
    windows'."""
    monkeypatch.setattr(SpecPlanner, "acceptance", lambda self: 1.0)


def greedy_jobs(seed: int, num: int, max_prompt: int = 24, max_tokens: int = 14) -> list[Job]:
    """Greedy fixed-depth jobs with staggered arrivals and a shared prefix among some."""
    rng = random.Random(seed)
    system = rng.choices(range(256), k=rng.randint(0, 8))
    jobs = []
    for i in range(num):
        params = SamplingParams(
            max_tokens=rng.randint(1, max_tokens),
            temperature=0.0,
            exit_threshold=1.0,
            ignore_eos=rng.random() < 0.8,
        )
        prompt = rng.choice([system, []]) + rng.choices(range(256), k=rng.randint(1, max_prompt))
        jobs.append(Job(f"g{i}", prompt, params, rng.randint(0, 8), rng.randint(0, 2)))
    return jobs


_SERIAL: dict = {}


def serial(model_dir) -> tuple[list[Job], dict]:
    if not _SERIAL:
        jobs = greedy_jobs(0, 6)
        _SERIAL["want"] = jobs, run_serial(make_engine(model_dir, max_num_seqs=1), jobs)
    return _SERIAL["want"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft_loops", [1, 2, 3])
def test_greedy_equals_plain_decoding(model_dir, always_draft, mode, k, draft_loops):
    jobs, want = serial(model_dir)
    rng = random.Random(k * 10 + draft_loops + len(mode))
    chunk = rng.choice([2, 3, 7, 32])
    eng = make_engine(
        model_dir,
        scheduling_mode="mixed" if mode == "wcpb" else mode,
        wavefront_chunked_prefill=mode == "wcpb",
        prefill_chunk_size=chunk,
        max_num_batched_tokens=rng.choice([max(chunk, k + 1), 9, 16]),
        max_num_seqs=rng.choice([2, 3, 8]),
        async_scheduling=rng.random() < 0.5,
        max_context_with_decode=rng.choice([0, 2048]),
        num_speculative_tokens=k,
        speculative_draft_loops=draft_loops,
    )
    schedule, fused = eng.scheduler.schedule, []

    def recording():  # drafts sampled within a step, between a window's positions
        batch = schedule()
        fused.extend(d for d in batch.drafts if d.invocation)
        return batch

    eng.scheduler.schedule = recording
    got = run_batched(eng, jobs, check=_blocks_bounded)
    assert compare(eng, jobs, got, want, "last_exited") <= 1
    assert kv_all_free(eng)
    spec = eng.scheduler.spec
    assert spec.num_windows > 0 and spec.num_drafted >= spec.num_windows
    assert spec.num_accepted <= spec.num_drafted
    assert fused or mode not in ("refill", "no_refill")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_window_takes_one_step(model_dir, always_draft, async_scheduling):
    """Concurrency 1, K = 4, d = 1: a window drafts all its positions and verifies them in one
    step, so engine steps per emitted token are about 1 / the mean accepted length, not
    (K + 2) / it; the output is plain decoding's. With async scheduling too: the next window
    needs the acceptance, so its plan reads it back first instead of a step with no work
    waiting for it (`StepUpdate._read_if_idle`)."""
    params = SamplingParams(max_tokens=31, temperature=0.0, exit_threshold=1.0, ignore_eos=True)
    job = Job("a", list(range(3, 13)), params)
    eng = make_engine(
        model_dir, num_speculative_tokens=4, speculative_draft_loops=1,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    empty, execute = [], eng.runner.execute

    def counting(batch):
        empty.append(not batch.requests and not batch.sample_req_ids)
        return execute(batch)

    eng.runner.execute = counting
    assert run_batched(eng, [job]) == run_batched(make_engine(model_dir), [job])
    stats = eng.stats_dict()
    steps, windows = stats["steps"], stats["spec_windows"]
    assert windows >= 10
    # the prompt's step and the last tokens' (a window drafts at most the tokens left)
    assert windows < steps <= windows + 4
    assert (steps - 4) / stats["generated_tokens"] <= 1 / stats["spec_mean_accepted_length"]
    assert sum(empty) <= async_scheduling  # (the last: it reads the final tokens back)


@pytest.mark.parametrize("wavefront", [False, True])
def test_windows_share_invocations_with_prefill(model_dir, always_draft, wavefront):
    """Under mixed scheduling (and WCPB) draft and verify rows ride the invocations of prefill
    tasks, and the output is still plain decoding's."""
    jobs, want = serial(model_dir)
    eng = make_engine(
        model_dir, max_num_seqs=8, max_num_batched_tokens=16, prefill_chunk_size=4,
        wavefront_chunked_prefill=wavefront, num_speculative_tokens=2, speculative_draft_loops=1,
    )  # fmt: skip
    schedule, shared = eng.scheduler.schedule, Counter()

    def recording():
        batch = schedule()
        kinds = {t.kind for t in batch.requests}
        if RowKind.PREFILL in kinds and RowKind.SPEC in kinds:
            spec = [t for t in batch.requests if t.kind is RowKind.SPEC]
            shared["verify" if any(t.num_tokens > 1 for t in spec) else "draft"] += 1
        return batch

    eng.scheduler.schedule = recording
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert shared["verify"] and shared["draft"], shared


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["refill", "mixed", "wcpb"])
def test_greedy_equals_plain_decoding_on_gpu(model_dir, backend, mode):
    """fp32 on CUDA; with the triton backend window rows replay CUDA graphs."""
    jobs = greedy_jobs(0, 6)
    want = run_serial(make_engine(model_dir, "cuda", backend, max_num_seqs=1), jobs)
    eng = make_engine(
        model_dir, "cuda", backend, scheduling_mode="mixed" if mode == "wcpb" else mode,
        wavefront_chunked_prefill=mode == "wcpb", prefill_chunk_size=4, max_num_seqs=4,
        max_num_batched_tokens=16, num_speculative_tokens=2, speculative_draft_loops=1,
    )  # fmt: skip
    got = run_batched(eng, jobs, check=_blocks_bounded)
    assert compare(eng, jobs, got, want, "last_exited") <= 1
    assert kv_all_free(eng) and eng.scheduler.spec.num_windows > 0


def _blocks_bounded(eng) -> None:
    """After each step a request holds no block past its window's last position (rejected
    positions are given back when their acceptance is read)."""
    kv, k = eng.kv_manager, eng.config.speculative.num_speculative_tokens
    for req in eng.scheduler.running:
        most = kv.blocks_for(req.num_tokens + k + 1)
        held = sum(len(kv.block_table(req.request_id, p)) for p in range(kv.num_planes))
        assert held <= most, (req.request_id, held, most)


def test_windows_draft_and_accept(always_draft):
    """The packaged model, trained, accepts most drafts of 2 loops out of 4 (a window really
    skips target decode steps)."""
    eng = make_engine(
        default_model_dir(), exit_threshold=1.0, num_speculative_tokens=3,
        speculative_draft_loops=2, max_num_seqs=2,
    )  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_engine(default_model_dir(), exit_threshold=1.0, max_num_seqs=2)
    prompt = list(range(3, 40))
    want = run_batched(plain, [Job("a", prompt, params)])
    assert run_batched(eng, [Job("a", prompt, params)]) == want
    spec = eng.scheduler.spec
    assert spec.num_accepted / spec.num_drafted > 0.3
    assert spec.num_windows < 23  # fewer windows than tokens after the first


SEEDS_PER_ARM = 400
TOP_K = 4  # the tokens of each context: keeps the categories few (p and q are top-k as well)
ALPHA = 1e-3  # significance of each position's test (3 positions: family-wise <= 0.3%)


def test_sampled_distribution_is_unchanged():
    """Temperature 1 on the packaged model (fixed depth): the tokens at output positions 1-3
    (position 0 comes from the prefill, before any window) of 300 seeded samples with
    speculation (K = 3 drafts of 2 loops) and 300 without (other seeds) pass a chi-square test
    of homogeneity at significance 1e-3 per position (categories with fewer than 5 expected
    counts merged). Deterministic: the seeds are fixed."""
    prompt = list(range(5, 17))

    def sample_arm(seed0: int, **spec) -> list[tuple[int, ...]]:
        eng = make_engine(default_model_dir(), exit_threshold=1.0, max_num_seqs=64, **spec)
        jobs = [
            Job(
                f"s{i}",
                prompt,
                SamplingParams(max_tokens=4, top_k=TOP_K, seed=seed0 + i, ignore_eos=True),
            )  # fmt: skip
            for i in range(SEEDS_PER_ARM)
        ]
        got = run_batched(eng, jobs)
        assert kv_all_free(eng)
        if spec:  # most positions came from windows, with drafts accepted and rejected
            windows = eng.scheduler.spec
            assert windows.num_windows >= SEEDS_PER_ARM
            assert 0.2 < windows.num_accepted / windows.num_drafted < 0.95
        return [got[j.req_id][0] for j in jobs]

    plain = sample_arm(0)
    spec = sample_arm(
        10**6, num_speculative_tokens=3, speculative_draft_loops=1, speculative_max_decode_rows=64
    )
    for position in range(1, 4):
        a = Counter(t[position] for t in plain)
        b = Counter(t[position] for t in spec)
        stat, df = chi_square_homogeneity(a, b)
        p_value = chi_square_sf(stat, df)
        print(f"position {position}: chi2 {stat:.2f}, df {df}, p {p_value:.3g}")
        assert df >= 1, "too few categories: the test would be vacuous"
        assert p_value > ALPHA


def preemption_workload(seed: int):
    """Fixed-depth jobs, greedy and one sampled, under a KV cache that holds one longest request
    exactly."""
    rng = random.Random(seed)
    jobs = greedy_jobs(seed, rng.randint(2, 4), max_prompt=16, max_tokens=10)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
    jobs.append(Job("sampled", rng.choices(range(256), k=rng.randint(1, 16)), sampled, 1))
    longest = max(len(j.prompt) + j.params.max_tokens - 1 for j in jobs)
    chunk = rng.randint(1, 8)
    settings = {
        "num_kv_blocks": D * -(-longest // 4),
        "prefill_chunk_size": chunk,
        "max_num_batched_tokens": rng.randint(max(chunk, 5), 16),
        "max_num_seqs": rng.randint(2, 4),
        "scheduling_mode": rng.choice(["refill", "no_refill", "mixed"]),
        "enable_prefix_caching": rng.random() < 0.5,
        "async_scheduling": rng.random() < 0.5,
        "num_speculative_tokens": rng.choice([1, 2, 4]),
        "speculative_draft_loops": rng.choice([1, 2, 3]),
    }
    settings["wavefront_chunked_prefill"] = settings["scheduling_mode"] == "mixed" and seed % 2 == 1
    return jobs, settings


@pytest.mark.parametrize("block", range(4))
def test_preemption_keeps_outputs(model_dir, always_draft, block):
    """40 workloads in 4 blocks: greedy outputs equal solo plain decoding, the sampled job gets
    all its tokens at full depth, every block is given back, and preemption really happens in
    most workloads."""
    preempted = 0
    for seed in range(block * 10, block * 10 + 10):
        jobs, settings = preemption_workload(seed)
        greedy = [j for j in jobs if j.req_id != "sampled"]
        want = run_serial(make_engine(model_dir, max_num_seqs=1), greedy)
        eng = make_engine(model_dir, **settings)
        steps = itertools.count()

        def bounded(_, jobs=jobs, steps=steps):
            work = sum((len(j.prompt) + j.params.max_tokens) * D for j in jobs)
            assert next(steps) <= 4 * work + 100, "no progress"

        got = run_batched(eng, jobs, check=bounded)
        assert compare(eng, greedy, got, want, "last_exited") == 0
        assert got["sampled"][1] == (D,) * 10
        assert kv_all_free(eng)
        assert eng.kv_manager.pool.plane_usage() == [0] * D
        preempted += eng.scheduler.num_preemptions > 0
    assert preempted >= 5


def test_what_windows_refuse(model_dir):
    """Windows need fixed depth: a request of a fixed-depth engine cannot ask for exits (an
    engine with the gate on speculates in device runs instead, test_speculative_gate.py)."""
    with pytest.raises(ConfigError, match="kv_layout='shared'"):
        make_engine(model_dir, num_speculative_tokens=2, kv_layout="shared")
    with pytest.raises(ConfigError, match="speculative_draft_loops"):
        make_engine(model_dir, num_speculative_tokens=2, speculative_draft_loops=D)
    with pytest.MonkeyPatch.context() as patch:  # Huginn-like models
        patch.setattr(OuroForCausalLM, "requires_atomic_prefill", True)
        with pytest.raises(ConfigError, match="requires atomic prefill"):
            make_engine(model_dir, num_speculative_tokens=2)
    eng = make_engine(model_dir, num_speculative_tokens=2)
    assert eng.scheduler.spec is not None
    for bad in (SamplingParams(exit_threshold=0.5), SamplingParams(max_loops=D - 1)):
        with pytest.raises(ValueError, match="fixed depth"):
            eng.add_request("x", [1, 2, 3], bad)


def test_logprobs_requests_decode_plainly(model_dir):
    """A request asking for logprobs opens no window; its tokens are plain decoding's."""
    job = Job("a", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, logprobs=2))
    eng = make_engine(model_dir, num_speculative_tokens=2)
    assert run_batched(eng, [job]) == run_batched(make_engine(model_dir), [job])
    assert eng.scheduler.spec.num_windows == 0


def test_requests_with_penalties_decode_plainly(model_dir, always_draft):
    """A request with a penalty opens no window (its logits depend on the tokens before); its
    tokens are plain decoding's, and its neighbours' windows are unchanged."""
    jobs = greedy_jobs(3, 6)
    jobs[1] = Job("p", jobs[1].prompt, SamplingParams(max_tokens=12, temperature=0,
                  exit_threshold=1.0, ignore_eos=True, frequency_penalty=1.5,
                  repetition_penalty=1.2))  # fmt: skip
    eng = make_engine(model_dir, num_speculative_tokens=2)
    got = run_batched(eng, jobs)
    assert got == run_batched(make_engine(model_dir), jobs)
    assert eng.scheduler.spec.num_windows > 0 and kv_all_free(eng)


@pytest.mark.parametrize("spec_cost", [6.0, 1.0])
def test_the_measured_fallback_keeps_the_faster_mode_and_the_tokens(
    always_draft, spec_cost, monkeypatch
):
    """`speculative_fallback` on a clock the test drives, a step costing `spec_cost` while the
    governor speculates and 1 otherwise: six times the cost turns speculation off after two
    looks (windows stop opening; a window's step emits at most K + 1 = 4 tokens a request),
    the same cost keeps it on (a window's step emits its accepted drafts too); the tokens are
    plain decoding's either way. (Phases of 8 measured steps, so that a few fit.)"""
    monkeypatch.setattr(spec_governor, "PHASE_STEPS", 8)
    settings = dict(exit_threshold=1.0, max_num_seqs=2)
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    jobs = [Job("a", list(range(3, 40)), params), Job("b", list(range(7, 30)), params)]
    want = run_batched(make_engine(default_model_dir(), **settings), jobs)
    eng = make_engine(
        default_model_dir(), num_speculative_tokens=3, speculative_draft_loops=2,
        speculative_fallback=True, **settings,
    )  # fmt: skip
    gov, now = eng.scheduler.governor, [0.0]
    gov.clock = lambda: now[0]
    observe, steps = gov.observe, []  # (the mode, windows read back) at each step at load 2

    def timed(tokens: int, num_decoding: int) -> None:
        now[0] += spec_cost if gov.speculate else 1.0
        if num_decoding == 2:  # (the requests' last tokens: a phase at load 1 starts)
            steps.append((gov.speculate, eng.scheduler.spec.num_windows))
        observe(tokens, num_decoding)

    gov.observe = timed
    assert run_batched(eng, jobs) == want
    assert gov.rates[2, True] and gov.rates[2, False]  # both measured at 2 decoding requests
    last_on = max(i for i, (on, _) in enumerate(steps) if on)
    last_off = max(i for i, (on, _) in enumerate(steps) if not on)
    windows = eng.scheduler.spec.num_windows
    if spec_cost > 1:  # off for good: no window after those open at the switch were read
        assert not steps[-1][0] and gov.looks[2, True] == 2
        assert windows == steps[last_on + 1 + SETTLE_STEPS][1]
    else:  # measured faster: on again, windows opening again
        assert steps[-1][0]
        assert windows > steps[last_off][1]
