"""CUDA-graph replay of one-row-segment (decode) invocations: the padded static-buffer call equals
the eager invocation (hidden, gate logits, KV), padding rows touch only the scratch block, and
generation through the static-buffer path equals eager generation. On CPU the static-buffer call
runs eagerly (exactly the call a graph records); `gpu` tests capture and replay."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.engine.harness import compare, kv_all_free, make_engine, random_jobs, run_batched
from tests.helpers import GQA, rel_err, tiny_model
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.cuda_graph import DecodeGraphRunner, row_buckets
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.paged_executor import PagedExecutor, Segment

BLOCK_SIZE = 4
# (request, prompt length, depth of its decode row): rows at different requests, depths, blocks
DECODE_ROWS = [("a", 7, 0), ("b", 5, 2), ("c", 11, 3)]


def test_row_buckets():
    assert row_buckets(1) == (1,)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert row_buckets(100)[-3:] == (80, 96, 100)
    assert row_buckets(1000)[-1] == 256


def test_scratch_block_is_never_handed_out():
    manager = KVCacheManager(12, BLOCK_SIZE, "last_exited", num_loops=4)
    cache = DeviceKVCache(2, 12, BLOCK_SIZE, 2, 8, torch.float32, "cpu")
    assert cache.kv.shape[2] == 13 and cache.scratch_block == 12
    manager.reserve("x", 5)  # 2 blocks x 4 planes
    manager.reserve("y", 4)  # 1 block x 4 planes
    handed = {b for r in "xy" for p in range(4) for b in manager.block_table(r, p)}
    assert manager.num_free_blocks == 0 and handed == set(range(12))


def _decode_setup(backend: str, device: str = "cpu", dtype=torch.float32):
    """An executor whose requests hold prompt KV in every plane and room for one decode row."""
    model = tiny_model(seed=3, backend=backend, device=device, dtype=dtype, **GQA)
    ex = PagedExecutor.create(model, num_blocks=64, block_size=BLOCK_SIZE)
    rng = random.Random(0)
    for req, length, _ in DECODE_ROWS:
        ex.prefill_all_depths(req, rng.choices(range(model.config.vocab_size), k=length))
        ex.kv_manager.reserve(req, length + 1)
    segments = [Segment(req, length, 1, depth) for req, length, depth in DECODE_ROWS]
    gen = torch.Generator(device="cpu").manual_seed(1)
    hidden = torch.randn(len(segments), model.config.hidden_size, generator=gen)
    return ex, segments, hidden.to(device, dtype)


def _static_call(ex: PagedExecutor, graphs: DecodeGraphRunner, segments, hidden):
    """The invocation through the graph runner, its input rows gathered from a larger buffer."""
    states = torch.zeros(10, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    index = np.array([7, 2, 5][: len(segments)], dtype=np.int64)
    states[torch.from_numpy(index)] = hidden
    starts = [s.token_start for s in segments]
    tables = [ex.kv_manager.block_table(s.req_id, ex.kv_manager.plane(s.depth)) for s in segments]
    inv = graphs.prepare(starts, [1] * len(segments), tables, index, states)
    assert inv is not None
    return inv, *graphs.run(inv)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_static_invocation_equals_eager(backend):
    ex, segments, hidden = _decode_setup(backend)
    scratch = ex.kv_cache.scratch_block
    ex.kv_cache.kv[:, :, scratch] = 7.0  # a sentinel the padding rows overwrite
    kv_before = ex.kv_cache.kv.clone()
    eager = ex.loop(segments, hidden)
    kv_eager = ex.kv_cache.kv.clone()

    ex.kv_cache.kv.copy_(kv_before)
    max_context = ex.model.config.max_position_embeddings
    graphs = DecodeGraphRunner(ex.model, ex.kv_cache, 6, max_context, capture=False)
    inv, out, gate = _static_call(ex, graphs, segments, hidden)
    assert (inv.bucket, out.shape[0], gate.shape[0]) == (4, 3, 3)  # 3 rows padded to bucket 4
    assert inv.meta.max_context == max_context
    assert rel_err(out, eager.hidden) < 1e-6
    assert rel_err(gate, eager.gate_logits) < 1e-6

    kv = ex.kv_cache.kv
    written = torch.zeros(kv.shape[2] * BLOCK_SIZE, dtype=torch.bool)
    for s in segments:
        written[ex.kv_manager.slot(s.req_id, ex.kv_manager.plane(s.depth), s.token_start)] = True
    flat = kv.flatten(2, 3)
    # the real rows wrote what the eager call wrote
    assert rel_err(flat[:, :, written], kv_eager.flatten(2, 3)[:, :, written]) < 1e-6
    # padding rows wrote position 0 of the scratch block, nothing else changed
    untouched = ~written
    untouched[scratch * BLOCK_SIZE] = False
    assert torch.equal(flat[:, :, untouched], kv_before.flatten(2, 3)[:, :, untouched])
    assert (kv[:, :, scratch, 0] != 7.0).all()


def test_prepare_declines_what_no_graph_fits():
    ex, segments, hidden = _decode_setup("torch")
    graphs = DecodeGraphRunner(ex.model, ex.kv_cache, 2, 64, capture=False)
    states, index = hidden, np.arange(3)
    tables = [ex.kv_manager.block_table(s.req_id, s.depth) for s in segments]
    assert graphs.prepare([7, 5, 11], [1, 1, 1], tables, index, states) is None  # 3 rows > 2
    assert graphs.prepare([3, 5], [2, 1], tables[:2], index[:3], states) is None  # a 2-row segment
    assert graphs.prepare([64], [1], tables[:1], index[:1], states) is None  # past max_context
    assert graphs.prepare([7, 5], [1, 1], tables[:2], index[:2], states[:2]).bucket == 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


def _force_static(engine) -> list[tuple[int, int]]:
    """Give the engine's runner a graph runner; returns the (bucket, rows) of each of its calls."""
    max_context = engine.model_config.max_position_embeddings
    graphs = DecodeGraphRunner(
        engine.model, engine.runner.kv_cache, engine.config.scheduler.max_num_seqs, max_context,
        capture=False,
    )  # fmt: skip
    calls, run = [], graphs.run
    graphs.run = lambda inv: (calls.append((inv.bucket, inv.hidden.shape[0])), run(inv))[1]
    engine.runner.graphs = graphs
    return calls


# workloads whose decode-only invocations include padded ones (3 rows in bucket 4, 5 in 6)
CASES = [("torch", "mixed", 3), ("torch", "refill", 1), ("triton", "no_refill", 4)]


@pytest.mark.parametrize("backend,mode,chunk", CASES)
def test_generation_through_static_buffers_equals_eager(model_dir, backend, mode, chunk):
    jobs = random_jobs(random.Random(4), 8, vocab=256, depth=4, max_prompt=20)
    kw = dict(scheduling_mode=mode, prefill_chunk_size=chunk, max_num_seqs=6)
    kw["max_num_batched_tokens"] = 9
    want = run_batched(make_engine(model_dir, "cpu", backend, **kw), jobs)
    eng = make_engine(model_dir, "cpu", backend, **kw)
    calls = _force_static(eng)
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert kv_all_free(eng)
    assert any(bucket > rows for bucket, rows in calls), "no invocation was padded"
    assert any(rows > 1 for _, rows in calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gpu_graph_replay_equals_eager(dtype, tol):
    ex, segments, hidden = _decode_setup("triton", "cuda", dtype)
    kv_before = ex.kv_cache.kv.clone()
    graphs = DecodeGraphRunner(ex.model, ex.kv_cache, 6, 1024)
    assert sorted(graphs.graphs) == [1, 2, 4, 6]
    for rows in (3, 1, 2):  # replays with different metadata in the same buffers
        ex.kv_cache.kv.copy_(kv_before)
        eager = ex.loop(segments[:rows], hidden[:rows])
        ex.kv_cache.kv.copy_(kv_before)
        _, out, gate = _static_call(ex, graphs, segments[:rows], hidden[:rows])
        assert rel_err(out, eager.hidden) < tol
        assert rel_err(gate, eager.gate_logits) < tol


@pytest.mark.gpu
def test_gpu_generation_with_graphs_equals_eager(model_dir):
    jobs = random_jobs(random.Random(5), 10, vocab=256, depth=4)
    kw = dict(scheduling_mode="refill", prefill_chunk_size=2, max_num_seqs=6)
    kw["max_num_batched_tokens"] = 9
    want = run_batched(make_engine(model_dir, "cuda", "triton", enforce_eager=True, **kw), jobs)
    eng = make_engine(model_dir, "cuda", "triton", **kw)
    graphs = eng.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 6]
    calls, run = [], graphs.run
    graphs.run = lambda inv: (calls.append((inv.bucket, inv.hidden.shape[0])), run(inv))[1]
    got = run_batched(eng, jobs)
    assert compare(eng, jobs, got, want, "last_exited") == 0
    assert len(calls) > 10 and any(bucket > rows for bucket, rows in calls)
    assert make_engine(model_dir, "cuda", "triton", enforce_eager=True).runner.graphs is None
