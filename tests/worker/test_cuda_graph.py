"""CUDA-graph replay: the padded static-buffer call equals the eager invocation (hidden, gate
logits, KV) for decode invocations and for mixed ones (prefill chunks of 1-65 rows beside decode
rows, rows of several requests at several depths), padding rows touch only the scratch block, and
generation through the static-buffer path equals eager generation (split, WCPB, atomic, decode
cohorts). On CPU the static-buffer call runs eagerly (exactly the call a graph records); `gpu`
tests capture and replay."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.engine.harness import compare, kv_all_free, make_engine, random_jobs, run_batched
from tests.helpers import GQA, rel_err, tiny_model
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.kernels import pdl
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.cuda_graph import CudaGraphRunner
from vllm_rlt.worker.graph_tables import GraphSpec, graph_specs
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.paged_executor import PagedExecutor, Segment

BLOCK_SIZE = 4
# decode graphs of 1, 2, 4, 6 rows; mixed of 8, 16, 32, 64, 100 with tile slots for 12 segments
SPECS = graph_specs(6, 100, 12)
# decode rows (request, position, depth): at different requests, depths, blocks
DECODE = [Segment("a", 7, 1, 0), Segment("b", 5, 1, 2), Segment("c", 11, 1, 3)]
# a mixed invocation of 83 rows (bucket 100): a 65-row chunk (tiles of 64 and 1 rows), decode
# rows, a 1-row prefill piece, two pieces of one request at two depths, a short piece
MIXED = [
    Segment("a", 0, 65, 0),
    Segment("b", 9, 1, 0),
    Segment("c", 20, 1, 2),
    Segment("c", 21, 12, 1),
    Segment("d", 33, 1, 3),
    Segment("e", 5, 3, 1),
]


def test_scratch_block_is_never_handed_out():
    manager = KVCacheManager(12, BLOCK_SIZE, "last_exited", num_loops=4)
    cache = DeviceKVCache(2, 12, BLOCK_SIZE, 2, 8, torch.float32, "cpu")
    assert cache.kv.shape[2] == 13 and cache.scratch_block == 12
    manager.reserve("x", 5)  # 2 blocks x 4 planes
    manager.reserve("y", 4)  # 1 block x 4 planes
    handed = {b for r in "xy" for p in range(4) for b in manager.block_table(r, p)}
    assert manager.num_free_blocks == 0 and handed == set(range(12))


def random_segments(rng: random.Random) -> list[Segment]:
    """2-5 requests, each with a history and 1-2 pieces at consecutive positions and distinct
    depths (1-17 rows: decode rows and prefill pieces), in random order."""
    segments = []
    for i in range(rng.randint(2, 5)):
        start = rng.randint(0, 40)
        for depth in rng.sample(range(4), rng.randint(1, 2)):
            n = rng.choice([1, 1, 2, 3, 9, 17])
            segments.append(Segment(f"r{i}", start, n, depth))
            start += n
    rng.shuffle(segments)
    return segments


def _setup(segments, backend: str, device: str = "cpu", dtype=torch.float32, **overrides):
    """An executor whose cache holds random KV (every position a row may read) and room for
    the segments, and random input rows [R, H]."""
    model = tiny_model(seed=3, backend=backend, device=device, dtype=dtype, **GQA, **overrides)
    ex = PagedExecutor.create(model, num_blocks=512, block_size=BLOCK_SIZE)
    ends = {}
    for s in segments:
        ends[s.req_id] = max(ends.get(s.req_id, 0), s.token_start + s.num_tokens)
    for req, end in ends.items():
        ex.kv_manager.reserve(req, end)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ex.kv_cache.kv.copy_(torch.randn(ex.kv_cache.kv.shape, generator=gen))
    hidden = torch.randn(
        sum(s.num_tokens for s in segments), model.config.hidden_size, generator=gen
    )
    return ex, hidden.to(device, dtype)


def _static_call(ex: PagedExecutor, graphs: CudaGraphRunner, segments, hidden):
    """The invocation through the graph runner, its input rows gathered from a larger buffer."""
    r = hidden.shape[0]
    states = torch.zeros(3 * r, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    index = np.random.default_rng(0).permutation(3 * r)[:r]
    states[torch.from_numpy(index).to(hidden.device)] = hidden
    m = ex.kv_manager
    inv = graphs.prepare(
        [s.token_start for s in segments],
        [s.num_tokens for s in segments],
        [m.block_table(s.req_id, m.plane(s.depth)) for s in segments],
        index,
        states,
    )
    assert inv is not None
    return inv, *graphs.run(inv)


def _check_equals_eager(segments, backend, spec: GraphSpec):
    ex, hidden = _setup(segments, backend)
    scratch = ex.kv_cache.scratch_block
    ex.kv_cache.kv[:, :, scratch] = 7.0  # a sentinel the padding rows overwrite
    kv_before = ex.kv_cache.kv.clone()
    eager = ex.loop(segments, hidden)
    kv_eager = ex.kv_cache.kv.clone()

    ex.kv_cache.kv.copy_(kv_before)
    max_context = ex.model.config.max_position_embeddings
    graphs = CudaGraphRunner(ex.model, ex.kv_cache, SPECS, max_context, capture=False)
    inv, out, gate = _static_call(ex, graphs, segments, hidden)
    assert inv.spec == spec and inv.meta.max_context == max_context
    assert out.shape[0] == gate.shape[0] == hidden.shape[0] < spec.num_rows  # padded
    assert rel_err(out, eager.hidden) < 1e-6
    # The gate logit is a dot product with cancellation (its terms sum to ~30x the logit here),
    # so the rows' last-bit differences (CPU GEMMs of 3 and of 4 rows accumulate in different
    # orders on AVX-512) grow ~30x in it: check it against the gate of the graph's own rows, and
    # against eager's within 1e-6 of the size of its terms.
    gate_layer = ex.model.model.early_exit_gate
    assert rel_err(gate, gate_layer(out).squeeze(-1)) < 1e-6
    terms = (out.abs() @ gate_layer.weight.abs().T).squeeze(-1)
    assert ((gate - eager.gate_logits).abs() <= 1e-6 * terms).all()

    kv, m = ex.kv_cache.kv, ex.kv_manager
    written = torch.zeros(kv.shape[2] * BLOCK_SIZE, dtype=torch.bool)
    for s in segments:
        for pos in range(s.token_start, s.token_start + s.num_tokens):
            written[m.slot(s.req_id, m.plane(s.depth), pos)] = True
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
        segments.append(Segment(f"x{rows}", 3, 2, 1))  # keep the call mixed and padded
        rows += 2
    spec = min(s for s in SPECS if s.num_chunk_slots and s.num_rows >= rows)
    _check_equals_eager(segments, backend, spec)


def test_prepare_declines_what_no_graph_fits():
    ex, hidden = _setup(DECODE, "torch")
    specs = graph_specs(2, 4, 3)  # decode graphs of 1 and 2 rows, a mixed graph of 4
    graphs = CudaGraphRunner(ex.model, ex.kv_cache, specs, 64, capture=False)
    states = torch.zeros(8, hidden.shape[1])
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


def _record(graphs: CudaGraphRunner) -> list[tuple[GraphSpec | None, int]]:
    """Record (spec or None when declined, rows) of every invocation the graph runner sees."""
    calls, prepare = [], graphs.prepare

    def recording_prepare(starts, counts, *args):
        inv = prepare(starts, counts, *args)
        calls.append((inv and inv.spec, sum(counts)))
        return inv

    graphs.prepare = recording_prepare
    return calls


def _force_static(engine) -> list[tuple[GraphSpec | None, int]]:
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
    assert all(spec is not None for spec, _ in calls), "an invocation ran eagerly"
    mixed = [(spec, rows) for spec, rows in calls if spec.num_chunk_slots]
    assert any(spec.num_rows > rows for spec, rows in mixed), "no mixed call was padded"
    assert len(mixed) < len(calls), "no decode graph ran"


# ---- GPU: capture and replay ----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_graph_replay_equals_eager(dtype, tol):
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [DECODE, MIXED, DECODE[:1], *(random_segments(random.Random(s)) for s in range(4))]
    ex, _ = _setup([s for case in cases for s in case], "triton", "cuda", dtype)
    kv_before = ex.kv_cache.kv.clone()
    graphs = CudaGraphRunner(ex.model, ex.kv_cache, SPECS, 1024)
    assert sorted(graphs.graphs) == sorted(SPECS)
    gen = torch.Generator(device="cpu").manual_seed(2)
    used = set()
    for segments in cases:  # replays of several graphs with different tables in the same buffers
        rows = sum(s.num_tokens for s in segments)
        hidden = torch.randn(rows, ex.model.config.hidden_size, generator=gen).to("cuda", dtype)
        ex.kv_cache.kv.copy_(kv_before)
        eager = ex.loop(segments, hidden)
        kv_eager = ex.kv_cache.kv.clone()
        ex.kv_cache.kv.copy_(kv_before)
        inv, out, gate = _static_call(ex, graphs, segments, hidden)
        used.add(inv.spec)
        assert rel_err(out, eager.hidden) < tol
        assert rel_err(gate, eager.gate_logits) < tol
        scratch = ex.kv_cache.scratch_block
        ex.kv_cache.kv[:, :, scratch] = kv_eager[:, :, scratch]
        assert rel_err(ex.kv_cache.kv, kv_eager) < tol
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
    ex, _ = _setup(segments, "triton", "cuda", torch.bfloat16, head_dim=32)
    kv_before = ex.kv_cache.kv.clone()
    early = CudaGraphRunner(ex.model, ex.kv_cache, SPECS, 1024)
    monkeypatch.setattr(pdl, "ENABLED", False)
    plain = CudaGraphRunner(ex.model, ex.kv_cache, SPECS, 1024)
    gen = torch.Generator(device="cpu").manual_seed(4)
    differ = []
    for i, segments in enumerate(cases):
        rows = sum(s.num_tokens for s in segments)
        hidden = torch.randn(rows, ex.model.config.hidden_size, generator=gen).to("cuda")
        results = []
        for graphs in (plain, early, early):
            ex.kv_cache.kv.copy_(kv_before)
            _, out, gate = _static_call(ex, graphs, segments, hidden.bfloat16())
            kv = ex.kv_cache.kv.clone()
            kv[:, :, ex.kv_cache.scratch_block] = 0
            results.append((out.clone(), gate.clone(), kv))
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
    assert all(spec is not None for spec, _ in calls)
    assert any(spec.num_chunk_slots and spec.num_rows > rows for spec, rows in calls)
    assert make_engine(model_dir, "cuda", "triton", enforce_eager=True).runner.graphs is None
