"""Batched generation equals serial single-request generation (tokens and exit depths) in
every scheduling mode, chunk size and small budget; one request equals an independent greedy
loop over the dense reference; SHARED generation equals the reference's SHARED mode."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.harness import (
    Job,
    compare,
    kv_all_free,
    make_engine,
    random_jobs,
    reference_greedy,
    run_batched,
    run_serial,
)
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


# fp32 everywhere: CPU with the torch backend (all cases), CPU with the Triton kernel under the
# interpreter (a subset), and the GPU with both backends (--run-gpu).
TARGETS = [
    ("cpu", "torch"),
    pytest.param("cuda", "torch", marks=pytest.mark.gpu),
    pytest.param("cuda", "triton", marks=pytest.mark.gpu),
]
SUBSET = [("cpu", "triton"), *TARGETS[1:]]


def engine(model_dir, device="cpu", backend="torch", **kw) -> LLMEngine:
    return make_engine(model_dir, device, backend, **kw)


_SERIAL: dict = {}


def serial_baseline(model_dir, device, backend):
    if (device, backend) not in _SERIAL:
        jobs = random_jobs(random.Random(0), 10, vocab=256, depth=4)
        _SERIAL[device, backend] = (
            jobs,
            run_serial(engine(model_dir, device, backend, max_num_seqs=1), jobs),
        )
    return _SERIAL[device, backend]


@pytest.mark.parametrize("device,backend", TARGETS)
@pytest.mark.parametrize("mode", ["refill", "no_refill", "mixed"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 32])
def test_batched_equals_serial(model_dir, device, backend, mode, chunk):
    _check_batched_equals_serial(model_dir, device, backend, mode, chunk)


@pytest.mark.parametrize("device,backend", SUBSET[:1])
@pytest.mark.parametrize("mode,chunk", [("mixed", 3), ("refill", 7)])
def test_batched_equals_serial_triton_interpreter(model_dir, device, backend, mode, chunk):
    _check_batched_equals_serial(model_dir, device, backend, mode, chunk)


def _check_batched_equals_serial(model_dir, device, backend, mode, chunk):
    # on the CPU the serial results are the torch backend's (the interpreter is held to them)
    jobs, want = serial_baseline(model_dir, device, "torch" if device == "cpu" else backend)
    rng = random.Random(chunk * 7 + len(mode))
    eng = engine(
        model_dir,
        device,
        backend,
        scheduling_mode=mode,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=rng.choice([chunk, 5, 9, 16]),
        max_num_seqs=rng.choice([2, 3, 8]),
    )
    got = run_batched(eng, jobs)
    near_ties = compare(eng, jobs, got, want, "last_exited")
    assert near_ties <= 1, f"{near_ties} near-ties: more than rounding should produce"
    assert kv_all_free(eng)


@pytest.mark.parametrize("device,backend", [*TARGETS, SUBSET[0]])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_greedy_equals_dense_reference_loop(model_dir, device, backend, layout, threshold):
    eng = engine(
        model_dir, device, backend, kv_layout=layout, prefill_chunk_size=5, max_num_batched_tokens=8
    )
    prompt = random.Random(1).choices(range(256), k=13)
    params = SamplingParams(max_tokens=10, temperature=0, exit_threshold=threshold, ignore_eos=True)
    got = run_batched(eng, [_job("a", prompt, params)])["a"]
    want = reference_greedy(eng.model, prompt, 10, threshold, layout)
    assert got == want
    if threshold < 1:
        assert len(set(got[1])) > 1, "early exit never varied the depth: the test is too weak"


@pytest.mark.parametrize("device,backend", TARGETS)
def test_shared_batched_equals_serial(model_dir, device, backend):
    jobs = random_jobs(random.Random(3), 6, vocab=256, depth=4, max_prompt=12)
    want = run_serial(engine(model_dir, device, backend, kv_layout="shared", max_num_seqs=1), jobs)
    eng = engine(
        model_dir, device, backend, kv_layout="shared", max_num_seqs=4, max_num_batched_tokens=6
    )
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "shared") <= 1
    assert kv_all_free(eng)


def _job(req_id, prompt, params):
    from tests.engine.harness import Job

    return Job(req_id, prompt, params)


def test_sampling_is_seeded_and_batch_invariant(model_dir):
    """The same seeded request gives the same tokens alone and amid other traffic."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    alone = run_batched(engine(model_dir), [_job("x", [5, 6, 7], params)])["x"]
    others = random_jobs(random.Random(9), 5, vocab=256, depth=4)
    crowd = run_batched(engine(model_dir, max_num_seqs=6), [_job("x", [5, 6, 7], params), *others])
    assert crowd["x"] == alone
    other_seed = SamplingParams(max_tokens=8, temperature=1.0, seed=124, ignore_eos=True)
    assert run_batched(engine(model_dir), [_job("x", [5, 6, 7], other_seed)])["x"] != alone
    torch.manual_seed(0)  # unseeded requests draw their own seeds; nothing global leaks


@pytest.mark.parametrize("wavefront", [False, True])
def test_phase_hold_changes_no_result(model_dir, wavefront):
    """Fixed-depth requests arriving at different steps get out of phase, so the scheduler holds
    exited tokens (`DecodePlanner.phase_hold`); results still equal serial generation. (Split
    prefill runs decode rows beside a chunk for all their loops, R1, so arrivals meet them at
    depth 0; a stall bound below the depth cuts those steps short and puts them out of phase.)"""
    rng = random.Random(7)
    jobs = []
    for i in range(6):
        params = SamplingParams(
            max_tokens=rng.randint(6, 14),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randrange(10**6),
            ignore_eos=True,
        )
        prompt = rng.choices(range(256), k=rng.randint(1, 30))
        jobs.append(Job(f"h{i}", prompt, params, rng.randint(0, 12)))
    want = run_serial(engine(model_dir, max_num_seqs=1), jobs)
    eng = engine(
        model_dir, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=4,
        wavefront_chunked_prefill=wavefront, max_prefill_stall_loops=3,
    )  # fmt: skip
    sched, holds = eng.scheduler, []
    phase_hold = sched.decode.phase_hold

    def counting(decoding, ready):
        held = phase_hold(decoding, ready)
        holds.extend(r.request_id for r in ready if held and not r.is_last_sample)
        return held

    sched.decode.phase_hold = counting
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert kv_all_free(eng)
    assert len(set(holds)) >= 2  # the hold really happened, to several requests
