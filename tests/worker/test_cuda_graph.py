"""CUDA-graph replay: the model runner's invocation through a graph's padded static buffers
equals its eager invocation (hidden, gate logits, KV) for decode invocations and for mixed ones
(prefill chunks of 1-65 rows beside decode rows, rows of several requests at several depths),
padding rows touch only the scratch block, and generation through the static-buffer path equals
eager generation (split, WCPB, atomic, decode cohorts). On CPU the static-buffer call runs
eagerly (exactly the call a graph records); `gpu` tests capture and replay."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.engine.harness import compare, kv_all_free, make_engine, random_jobs, run_batched
from tests.helpers import GQA, rel_err, tiny_model
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import ScheduledRequest
from vllm_rlt.kernels import pdl
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.cuda_graph import CudaGraphRunner, StaticInvocation
from vllm_rlt.worker.graph_tables import GraphSpec, graph_specs
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.plan_driver import PlanDriver, prompt_rows

BLOCK_SIZE = 4
# decode graphs of 1, 2, 4, 6 rows; mixed of 8, 16, 32, 64, 100 with tile slots for 12 segments
SPECS = graph_specs(6, 100, 12)
# decode rows (request, position, depth): at different requests, depths, blocks
DECODE = [prompt_rows("a", 7, 1, 0), prompt_rows("b", 5, 1, 2), prompt_rows("c", 11, 1, 3)]
# a mixed invocation of 83 rows (bucket 100): a 65-row chunk (tiles of 64 and 1 rows), decode
# rows, a 1-row prefill piece, two pieces of one request at two depths, a short piece
MIXED = [
    prompt_rows("a", 0, 65, 0),
    prompt_rows("b", 9, 1, 0),
    prompt_rows("c", 20, 1, 2),
    prompt_rows("c", 21, 12, 1),
    prompt_rows("d", 33, 1, 3),
    prompt_rows("e", 5, 3, 1),
]


def test_scratch_block_is_never_handed_out():
    manager = KVCacheManager(12, BLOCK_SIZE, "last_exited", num_loops=4)
    cache = DeviceKVCache(2, 12, BLOCK_SIZE, 2, 8, torch.float32, "cpu")
    assert cache.kv.shape[2] == 13 and cache.scratch_block == 12
    manager.reserve("x", 5)  # 2 blocks x 4 planes
    manager.reserve("y", 4)  # 1 block x 4 planes
    handed = {b for r in "xy" for p in range(4) for b in manager.block_table(r, p)}
    assert manager.num_free_blocks == 0 and handed == set(range(12))


def random_segments(rng: random.Random) -> list[ScheduledRequest]:
    """2-5 requests, each with a history and 1-2 pieces at consecutive positions and distinct
    depths (1-17 rows: decode rows and prefill pieces), in random order."""
    segments = []
    for i in range(rng.randint(2, 5)):
        start = rng.randint(0, 40)
        for depth in rng.sample(range(4), rng.randint(1, 2)):
            n = rng.choice([1, 1, 2, 3, 9, 17])
            segments.append(prompt_rows(f"r{i}", start, n, depth))
            start += n
    rng.shuffle(segments)
    return segments


def _setup(segments, backend: str, device: str = "cpu", dtype=torch.float32, **overrides):
    """A driver (an eager model runner) whose requests hold every position the segments' rows
    run at (random tokens), with random KV (every position a row may read) and random hidden
    states (the input rows past depth 0)."""
    model = tiny_model(seed=3, backend=backend, device=device, dtype=dtype, **GQA, **overrides)
    driver = PlanDriver(model, num_blocks=512, block_size=BLOCK_SIZE)
    ends = {}
    for s in segments:
        ends[s.request_id] = max(ends.get(s.request_id, 0), s.token_start + s.num_tokens)
    gen = torch.Generator(device="cpu").manual_seed(1)
    for req, end in ends.items():
        driver.add(req, torch.randint(model.config.vocab_size, (end,), generator=gen).tolist())
    _randomize(driver.kv_cache.kv, gen)
    _randomize(driver.runner.states.buffer, gen)
    return driver


def _randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    t.copy_(torch.randn(t.shape, generator=gen))


def _run(driver: PlanDriver, segments, graphs: CudaGraphRunner | None = None):
    """One invocation over the segments, eagerly or through `graphs`' static buffers: output
    states [R, H] and gate logits [R]."""
    driver.runner.graphs = graphs
    out, gate = driver.run(segments)
    driver.runner.graphs = None
    return out[0], gate[0]


def _check_equals_eager(segments, backend, spec: GraphSpec):
    driver = _setup(segments, backend)
    kv, states = driver.kv_cache.kv, driver.runner.states.buffer
    scratch = driver.kv_cache.scratch_block
    kv[:, :, scratch] = 7.0  # a sentinel the padding rows overwrite
    kv_before, states_before = kv.clone(), states.clone()
    eager_out, eager_gate = _run(driver, segments)
    kv_eager = kv.clone()

    kv.copy_(kv_before)
    states.copy_(states_before)
    model = driver.runner.model
    max_context = model.config.max_position_embeddings
    graphs = CudaGraphRunner(model, driver.kv_cache, SPECS, max_context, capture=False)
    calls = _record(graphs)
    out, gate = _run(driver, segments, graphs)
    [(inv, rows)] = calls
    assert inv.spec == spec and inv.meta.max_context == max_context
    assert out.shape[0] == gate.shape[0] == rows < spec.num_rows  # padded
    assert rel_err(out, eager_out) < 1e-6
    # The gate logit is a dot product with cancellation (its terms sum to ~30x the logit here),
    # so the rows' last-bit differences (CPU GEMMs of 3 and of 4 rows accumulate in different
    # orders on AVX-512) grow ~30x in it: check it against the gate of the graph's own rows, and
    # against eager's within 1e-6 of the size of its terms.
    gate_layer = model.model.early_exit_gate
    assert rel_err(gate, gate_layer(out).squeeze(-1)) < 1e-6
    terms = (out.abs() @ gate_layer.weight.abs().T).squeeze(-1)
    assert ((gate - eager_gate).abs() <= 1e-6 * terms).all()

    written = torch.zeros(kv.shape[2] * BLOCK_SIZE, dtype=torch.bool)
    for s in segments:
        for pos in range(s.token_start, s.token_start + s.num_tokens):
            written[driver.slot(s.request_id, s.depth, pos)] = True
    flat = kv.flatten(2, 3)
    # the real rows wrote what the eager call wrote
    assert rel_err(flat[:, :, written], kv_eager.flatten(2, 3)[:, :, written]) < 1e-6
    # padding rows wrote position 0 of the scratch block, nothing else changed
    untouched = ~written
    untouched[scratch * BLOCK_SIZE] = False
    assert torch.equal(flat[:, :, untouched], kv_before.flatten(2, 3)[:, :, untouched])
    assert (kv[:, :, scratch, 0] != 7.0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_invocation_equals_eager(backend):
    _check_equals_eager(DECODE, backend, GraphSpec(4, 4, 0))  # 3 rows in the 4-row decode graph


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_mixed_invocation_equals_eager(backend):
    _check_equals_eager(MIXED, backend, GraphSpec(100, 12, 14))


@pytest.mark.parametrize("backend,seed", [("torch", s) for s in range(4)] + [("triton", 4)])
def test_random_mixed_invocations_equal_eager(backend, seed):
    segments = random_segments(random.Random(seed))
    rows = sum(s.num_tokens for s in segments)
    while rows in {s.num_rows for s in SPECS} or max(s.num_tokens for s in segments) == 1:
        segments.append(prompt_rows(f"x{rows}", 3, 2, 1))  # keep the call mixed and padded
        rows += 2
    spec = min(s for s in SPECS if s.num_chunk_slots and s.num_rows >= rows)
    _check_equals_eager(segments, backend, spec)


def test_prepare_declines_what_no_graph_fits():
    driver = _setup(DECODE, "torch")
    specs = graph_specs(2, 4, 3)  # decode graphs of 1 and 2 rows, a mixed graph of 4
    graphs = CudaGraphRunner(driver.runner.model, driver.kv_cache, specs, 64, capture=False)
    states = driver.runner.states.buffer[:8]
    tables = [(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16)] * 5

    def spec(starts, counts):
        inv = graphs.prepare(starts, counts, tables[: len(starts)], np.arange(sum(counts)), states)
        return inv and inv.spec

    assert spec([7, 5], [1, 1]) == GraphSpec(2, 2, 0)
    assert spec([7, 5, 11], [1, 1, 1]) == GraphSpec(4, 3, 2)  # decode rows in the mixed graph
    assert spec([3, 5], [2, 1]) == GraphSpec(4, 3, 2)
    assert spec([1, 2, 3, 4, 5], [1] * 5) is None  # 5 rows > 4
    assert spec([1, 2, 3, 4], [1] * 4) is None  # 4 one-row tiles > 3 slots of the mixed graph
    assert spec([63, 5], [2, 1]) is None  # position 63 fits, 64 does not
    assert spec([62, 5], [2, 1]) == GraphSpec(4, 3, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


def _record(graphs: CudaGraphRunner) -> list[tuple[StaticInvocation | None, int]]:
    """Record (the static invocation or None when declined, rows) of every invocation the graph
    runner sees."""
    calls, prepare = [], graphs.prepare

    def recording_prepare(starts, counts, *args):
        inv = prepare(starts, counts, *args)
        calls.append((inv, sum(counts)))
        return inv

    graphs.prepare = recording_prepare
    return calls


def _force_static(engine) -> list[tuple[StaticInvocation | None, int]]:
    """Give the engine's runner a graph runner without capture; returns its calls (`_record`)."""
    sc = engine.config.scheduler
    graphs = CudaGraphRunner(
        engine.model,
        engine.runner.kv_cache,
        graph_specs(sc.max_num_seqs, sc.max_num_batched_tokens, engine.scheduler.expected_segments),
        engine.model_config.max_position_embeddings,
        capture=False,
    )
    engine.runner.graphs = graphs
    return _record(graphs)


# workloads (backend, scheduling mode, wavefront, chunk, budget): split, WCPB, atomic (refill,
# whose decode-only invocations include padded ones), decode cohorts
CASES = [
    ("torch", "mixed", False, 3, 9),
    ("torch", "mixed", True, 5, 13),
    ("torch", "refill", False, 7, 9),
    ("triton", "mixed", True, 5, 11),
    ("triton", "no_refill", False, 4, 9),
]


@pytest.mark.parametrize("backend,mode,wavefront,chunk,budget", CASES)
def test_generation_through_static_buffers_equals_eager(
    model_dir, backend, mode, wavefront, chunk, budget
):
    num_jobs = 8 if backend == "torch" else 5  # the interpreter is slow
    jobs = random_jobs(random.Random(4), num_jobs, vocab=256, depth=4, max_prompt=20)
    kw = dict(scheduling_mode=mode, wavefront_chunked_prefill=wavefront, max_num_seqs=6)
    kw.update(prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    # (host-decided decode rows: device runs capture graphs of their own,
    # tests/engine/test_device_runs.py)
    kw.update(device_decode_loops=0)
    want = run_batched(make_engine(model_dir, "cpu", backend, enforce_eager=True, **kw), jobs)
    eng = make_engine(model_dir, "cpu", backend, **kw)
    calls = _force_static(eng)
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert kv_all_free(eng)
    assert all(inv is not None for inv, _ in calls), "an invocation ran eagerly"
    mixed = [(inv.spec, rows) for inv, rows in calls if inv.spec.num_chunk_slots]
    assert any(spec.num_rows > rows for spec, rows in mixed), "no mixed call was padded"
    assert len(mixed) < len(calls), "no decode graph ran"


# ---- GPU: capture and replay ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_graph_replay_equals_eager(dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [DECODE, MIXED, DECODE[:1], *(random_segments(random.Random(s)) for s in range(4))]
    driver = _setup([s for case in cases for s in case], "triton", "cuda", dtype)
    kv, states = driver.kv_cache.kv, driver.runner.states.buffer
    kv_before = kv.clone()
    graphs = CudaGraphRunner(driver.runner.model, driver.kv_cache, SPECS, 1024)
    assert sorted(graphs.graphs) == sorted(SPECS)
    calls = _record(graphs)
    gen = torch.Generator(device="cpu").manual_seed(2)
    for segments in cases:  # replays of several graphs with different tables in the same buffers
        _randomize(states, gen)
        states_before = states.clone()
        kv.copy_(kv_before)
        eager_out, eager_gate = _run(driver, segments)
        kv_eager = kv.clone()
        kv.copy_(kv_before)
        states.copy_(states_before)
        out, gate = _run(driver, segments, graphs)
        assert rel_err(out, eager_out) < tol
        assert rel_err(gate, eager_gate) < tol
        scratch = driver.kv_cache.scratch_block
        kv[:, :, scratch] = kv_eager[:, :, scratch]
        assert rel_err(kv, kv_eager) < tol
    assert len(calls) == len(cases) and all(inv is not None for inv, _ in calls)
    used = {inv.spec for inv, _ in calls}
    assert GraphSpec(100, 12, 14) in used and GraphSpec(4, 4, 0) in used and len(used) >= 4


@pytest.mark.gpu
def test_gpu_early_launches_read_what_the_kernel_before_wrote(monkeypatch):
    """With early launch (programmatic dependent launch) a layer's kernels start while the one
    before them runs and wait before they read its output or write. Graph replays with it equal
    graphs captured without it bit for bit (a read ahead of its producer would see the previous
    replay's values), and each other. Decode invocations (few-row GEMMs with the RoPE and
    KV-write epilogue) and mixed ones; outputs, gates and KV. The scratch block is left out: the
    padding rows all write its slot 0, in any order, with or without early launch."""
    if not pdl.pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    cases = [DECODE, MIXED, DECODE[:1], *(random_segments(random.Random(s)) for s in range(3))]
    segments = [s for case in cases for s in case]
    driver = _setup(segments, "triton", "cuda", torch.bfloat16, head_dim=32)
    kv, states = driver.kv_cache.kv, driver.runner.states.buffer
    kv_before = kv.clone()
    model = driver.runner.model
    early = CudaGraphRunner(model, driver.kv_cache, SPECS, 1024)
    monkeypatch.setattr(pdl, "ENABLED", False)
    plain = CudaGraphRunner(model, driver.kv_cache, SPECS, 1024)
    gen = torch.Generator(device="cpu").manual_seed(4)
    differ = []
    for i, segments in enumerate(cases):
        _randomize(states, gen)
        states_before = states.clone()
        results = []
        for graphs in (plain, early, early):
            kv.copy_(kv_before)
            states.copy_(states_before)
            out, gate = _run(driver, segments, graphs)
            kv_after = kv.clone()
            kv_after[:, :, driver.kv_cache.scratch_block] = 0
            results.append((out, gate, kv_after))
        for name, without, *replays in zip(("out", "gate", "kv"), *results, strict=True):
            differ += [(i, name, r) for r, x in enumerate(replays) if not torch.equal(x, without)]
    assert not differ, f"(case, output, replay) unlike the graph without early launch: {differ}"


@pytest.mark.gpu
@pytest.mark.parametrize("mode,wavefront,chunk,budget", [c[1:] for c in CASES[:3]])
def test_gpu_generation_with_graphs_equals_eager(model_dir, mode, wavefront, chunk, budget):
    jobs = random_jobs(random.Random(5), 10, vocab=256, depth=4)
    kw = dict(scheduling_mode=mode, wavefront_chunked_prefill=wavefront, max_num_seqs=6)
    kw.update(prefill_chunk_size=chunk, max_num_batched_tokens=budget)
    want = run_batched(make_engine(model_dir, "cuda", "triton", enforce_eager=True, **kw), jobs)
    eng = make_engine(model_dir, "cuda", "triton", **kw)
    graphs = eng.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == sorted(
        graph_specs(6, budget, eng.scheduler.expected_segments)
    )
    calls = _record(graphs)
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert all(inv is not None for inv, _ in calls)
    assert any(inv.spec.num_chunk_slots and inv.spec.num_rows > rows for inv, rows in calls)
    assert make_engine(model_dir, "cuda", "triton", enforce_eager=True).runner.graphs is None
