"""Huginn through the engine: greedy generation with the zero initial state equals an independent
greedy loop over the dense reference, batched with other requests in every scheduling mode,
chunked, eagerly and through the CUDA-graph static buffers; the seeded initial state; and the
settings Huginn refuses at startup. fp32 on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.probes.invariance import StateRecorder
from tests.engine.harness import Job, kv_all_free, make_engine, run_batched, run_serial
from tests.helpers import write_tiny_huginn
from tests.worker.test_cuda_graph import _force_static
from vllm_rlt.config import ConfigError
from vllm_rlt.models.huginn_reference import DenseHuginnReference
from vllm_rlt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_huginn(tmp_path_factory.mktemp("huginn"), seed=6)


def reference_greedy(model, prompt, max_tokens, max_loops=None):
    """Greedy tokens and exit depths of an independent loop over the dense reference. A
    request's recurrences (`max_loops`) apply to every position, prompt included, as the public
    code's `num_steps`."""
    ref = DenseHuginnReference.from_model(model)
    steps = max_loops or model.num_loops
    ids, tokens = list(prompt), []
    while len(tokens) < max_tokens:
        tokens.append(int(ref.run(ids, [steps] * len(ids)).logits[-1].argmax()))
        ids.append(tokens[-1])
    return tuple(tokens), (steps,) * max_tokens


def greedy_jobs(seed: int, num: int, vocab: int):
    rng = random.Random(seed)
    jobs = []
    for i in range(num):
        params = SamplingParams(
            max_tokens=rng.randint(1, 8),
            temperature=0.0,
            max_loops=rng.choice([None, None, 2, 3]),
            ignore_eos=True,
            init_scale=0.0,
        )
        prompt = rng.choices(range(vocab), k=rng.randint(1, 17))
        jobs.append(Job(f"j{i}", prompt, params, rng.randint(0, 4)))
    return jobs


_REFERENCE: dict = {}


def reference_results(eng, jobs):
    key = tuple(j.req_id for j in jobs)
    if key not in _REFERENCE:
        _REFERENCE[key] = {
            j.req_id: reference_greedy(eng.model, j.prompt, j.params.max_tokens, j.params.max_loops)
            for j in jobs
        }
    return _REFERENCE[key]


@pytest.mark.parametrize(
    "mode,chunk,budget",
    [
        ("refill", 4, 32),
        ("refill", 64, 64),
        ("no_refill", 3, 16),
        ("mixed", 5, 12),
        ("mixed", 64, 64),
    ],
)
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-buffers"])
def test_greedy_zero_state_equals_reference(model_dir, mode, chunk, budget, static):
    eng = make_engine(
        model_dir,
        scheduling_mode=mode,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
    )
    calls = _force_static(eng) if static else []
    jobs = greedy_jobs(1, 7, eng.model_config.vocab_size)
    got = run_batched(eng, jobs)
    assert got == reference_results(eng, jobs)
    assert kv_all_free(eng)
    if static:
        assert calls and all(inv is not None for inv, _ in calls), "an invocation ran eagerly"


def test_prefill_is_atomic_and_prefix_caching_is_off(model_dir):
    eng = make_engine(model_dir, scheduling_mode="mixed", prefill_chunk_size=4)
    assert not eng.kv_manager.enable_prefix_caching  # prompt KV depends on the seed
    assert eng.kv_manager.num_planes == eng.num_loops + 1  # one plane per recurrence + edge
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eng.add_request("a", list(range(3, 12)), params)
    for _ in range(3):
        eng.step()
    eng.add_request("b", list(range(5, 19)), params)  # arrives while "a" decodes
    while eng.has_unfinished_requests():
        batch = eng.scheduler.schedule()
        prefill = [t for t in batch.requests if t.kind.value == "prefill"]
        assert all(t.depth == 0 for t in prefill)
        if prefill:  # a prompt chunk runs every recurrence (and the coda) in its batch
            assert batch.loop_count == eng.num_loops
            assert len(prefill) == len(batch.requests)
        launched = eng.runner.execute(batch)
        eng.scheduler.update(batch, launched)


def sampled(eng, prompt, params, others=()):
    jobs = [Job("x", prompt, params)] + [
        Job(f"o{i}", p, SamplingParams(max_tokens=5, seed=i, ignore_eos=True), 0)
        for i, p in enumerate(others)
    ]
    return run_batched(eng, jobs)["x"]


def test_seeded_initial_state(model_dir):
    eng = make_engine(model_dir, max_num_seqs=4, prefill_chunk_size=4)
    prompt = list(range(7, 20))
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = sampled(eng, prompt, SamplingParams(seed=11, **greedy))
    assert sampled(eng, prompt, SamplingParams(seed=11, **greedy)) == one
    others = [list(range(30, 41)), list(range(50, 53)), list(range(60, 80))]
    assert sampled(eng, prompt, SamplingParams(seed=11, **greedy), others) == one
    seeds = {sampled(eng, prompt, SamplingParams(seed=s, **greedy))[0] for s in range(12, 16)}
    assert len(seeds | {one[0]}) > 1  # the noise changes what greedy decoding picks
    zero = sampled(eng, prompt, SamplingParams(seed=11, init_scale=0.0, **greedy))
    assert zero[0] == reference_greedy(eng.model, prompt, 8)[0]
    engine_zero = make_engine(model_dir, init_scale=0.0)
    assert sampled(engine_zero, prompt, SamplingParams(seed=3, **greedy)) == zero
    # sampled tokens: the same seed alone and batched with others
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert sampled(eng, prompt, params) == sampled(eng, prompt, params, others)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(wavefront_chunked_prefill=True), "HuginnForCausalLM, which requires atomic prefill"),
        (dict(kv_layout="shared"), "kv_layout='shared' cannot run with HuginnForCausalLM"),
        (dict(max_prefill_stall_loops=2), "split prefill batches of HuginnForCausalLM"),
        (dict(exit_threshold=0.5), "needs an exit gate"),
    ],
)
def test_startup_refuses_what_huginn_cannot_run(model_dir, kw, match):
    with pytest.raises(ConfigError, match=match):
        make_engine(model_dir, **kw)


def test_request_refuses_an_exit_threshold(model_dir):
    eng = make_engine(model_dir)
    with pytest.raises(ValueError, match="needs an exit gate"):
        eng.add_request("a", [1, 2, 3], SamplingParams(exit_threshold=0.3))


@pytest.mark.parametrize("mode", ["refill", "mixed"])
def test_preempted_requests_recompute_the_same_tokens(model_dir, mode):
    eng = make_engine(
        model_dir, scheduling_mode=mode, prefill_chunk_size=4, num_kv_blocks=48, max_num_seqs=4
    )
    jobs = greedy_jobs(2, 6, eng.model_config.vocab_size)
    got = run_batched(eng, jobs)
    assert eng.scheduler.num_preemptions > 0
    assert got == reference_results(eng, jobs)
    assert kv_all_free(eng)


def test_capacity_counts_the_edge_plane(model_dir):
    with pytest.raises(ConfigError, match="needs a block in each of its 5 planes"):
        make_engine(model_dir, num_kv_blocks=4)  # 4 recurrences + the prelude/coda plane
    eng = make_engine(model_dir, num_kv_blocks=50)  # 10 blocks of 4 positions in each plane
    assert eng.kv_manager.max_tokens_per_request() == 40
    assert eng.max_model_len == 41


def test_greedy_with_the_triton_backend_under_the_interpreter(model_dir):
    eng = make_engine(
        model_dir, backend="triton", scheduling_mode="mixed", prefill_chunk_size=5, max_num_seqs=3
    )
    jobs = greedy_jobs(3, 2, eng.model_config.vocab_size)  # the interpreter is slow
    assert run_batched(eng, jobs) == reference_results(eng, jobs)


def test_stop_ids_come_from_the_generation_config(model_dir):
    eng = make_engine(model_dir)
    assert eng.eos_token_ids == (1, 4)  # <|end_text|>, <|end_turn|>


def _recorded(model_dir, jobs, serial: bool, **kw) -> tuple[dict, dict]:
    """Tokens of `jobs` one at a time or up to 8 at once, and every state row the runner
    computed (request, position, recurrence)."""
    eng = make_engine(model_dir, max_num_seqs=1 if serial else 8, **kw)
    rec = StateRecorder(eng)
    tokens = run_serial(eng, jobs) if serial else run_batched(eng, jobs)
    assert kv_all_free(eng)
    return tokens, rec.states


@pytest.mark.parametrize(
    "device,dtype",
    [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)],
)
def test_batch_invariant_rows_are_the_same_bits_batched_as_alone(model_dir, device, dtype):
    """batch_invariant: every state row (prompt and decode, every recurrence) is the same bits
    with up to 8 requests at once, mixed scheduling and chunked prompts, as one request at a
    time, and so are the tokens. On the CPU the torch path's rows differ there (so the check
    can fail)."""
    greedy = dict(temperature=0.0, ignore_eos=True, init_scale=0.0)
    jobs = [
        Job("a", list(range(3, 12)), SamplingParams(max_tokens=2, max_loops=2, **greedy)),
        Job("b", list(range(40, 46)), SamplingParams(max_tokens=2, max_loops=3, **greedy), 1),
        Job("c", list(range(70, 75)), SamplingParams(max_tokens=1, max_loops=2, **greedy), 1),
    ]
    kw = dict(device=device, dtype=dtype, scheduling_mode="mixed", prefill_chunk_size=4)
    invariant = dict(kw, backend="triton", batch_invariant=True)
    tokens, alone = _recorded(model_dir, jobs, True, **invariant)
    batched_tokens, batched = _recorded(model_dir, jobs, False, **invariant)
    assert batched_tokens == tokens
    assert batched.keys() == alone.keys()
    assert all(torch.equal(batched[k], alone[k]) for k in alone)
    if device == "cpu":
        torch_alone = _recorded(model_dir, jobs, True, **kw)[1]
        torch_batched = _recorded(model_dir, jobs, False, **kw)[1]
        assert any(not torch.equal(torch_batched[k], torch_alone[k]) for k in torch_alone)
