"""The invocation timer (`vllm_rlt.worker.invocation_timer`): with one attached, the runner
times every recurrent-core call under the shape that the engine's own trace and graph choices
give it."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from tests.engine.harness import make_engine, random_jobs, run_batched
from tests.worker.test_cuda_graph import _force_static, _record
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.worker.invocation_timer import InvocationTimer, detailed_shape, invocation_shape


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


def test_a_shape_names_the_rows_kind_and_the_graph():
    assert invocation_shape(0, 64, 1024) == "prefill 1024"
    assert invocation_shape(8, 8, 8) == "decode 8"
    assert invocation_shape(8, 1016, 1024) == "mixed 1024"
    assert invocation_shape(3, 40, None) == "mixed eager"


def _expected(trace, calls) -> Counter:
    """Shapes from the engine's task trace (rows and decode rows per invocation) and the graph
    runner's choice of bucket for each call (None: eager; no calls: every invocation eager)."""
    rows, decode = defaultdict(int), defaultdict(int)
    for t in trace:
        rows[t.invocation] += t.num_tokens
        decode[t.invocation] += t.num_tokens if t.kind == "decode" else 0
    buckets = [inv and inv.spec.num_rows for inv, _ in calls] if calls is not None else None
    return Counter(
        invocation_shape(decode[i], rows[i], buckets[i] if buckets else None) for i in sorted(rows)
    )


DEVICES = [
    ("cpu", "torch", False),
    ("cpu", "torch", True),  # static buffers (graphs not captured on the CPU)
    pytest.param("cuda", "triton", True, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device,backend,static", DEVICES)
def test_the_runner_times_every_invocation_under_its_shape(model_dir, device, backend, static):
    # (host-decided decode rows: a device run loads its graph once for all its invocations;
    # tests/engine/test_device_runs.py times those)
    kw = dict(scheduling_mode="mixed", wavefront_chunked_prefill=True, max_num_seqs=6)
    kw.update(device_decode_loops=0)
    kw.update(prefill_chunk_size=5, max_num_batched_tokens=13)
    eng = make_engine(model_dir, device, backend, **kw)
    calls = None
    if static:
        calls = _record(eng.runner.graphs) if device == "cuda" else _force_static(eng)
    eng.stats.trace = []
    eng.runner.timer = InvocationTimer(eng.runner.device)
    run_batched(eng, random_jobs(random.Random(2), 6, vocab=256, depth=4, max_prompt=20))
    timed = eng.runner.timer.summary()
    assert Counter({shape: s["count"] for shape, s in timed.items()}) == _expected(
        eng.stats.trace, calls
    )
    assert {shape.split()[0] for shape in timed} == {"prefill", "mixed", "decode"}
    assert all(s["total_ms"] > 0 and s["mean_ms"] * s["count"] == pytest.approx(s["total_ms"])
               for s in timed.values())  # fmt: skip
    assert eng.runner.timer.summary() == timed  # read once, kept


def test_detailed_shapes_add_rows_and_context(model_dir):
    """`by_context`: the same invocations, keyed by bucket, decode rows, prefill rows and the
    context classes of both kinds of rows."""
    assert detailed_shape(7, 519, 576, 8192, 8200) == "b576 d7 p512 pc8K dc10K"
    assert detailed_shape(0, 40, None, 33, 0) == "beager d0 p128 pc2K dc0K"
    runs = {}
    for by_context in (False, True):
        eng = make_engine(model_dir, "cpu", "torch", wavefront_chunked_prefill=True,
                          prefill_chunk_size=5, max_num_batched_tokens=13)  # fmt: skip
        eng.runner.timer = InvocationTimer(eng.runner.device, by_context)
        run_batched(eng, random_jobs(random.Random(2), 6, vocab=256, depth=4, max_prompt=20))
        runs[by_context] = eng.runner.timer.summary()
    assert sum(s["count"] for s in runs[True].values()) == sum(
        s["count"] for s in runs[False].values()
    )
    for shape in runs[True]:
        bucket, decode, prefill, pc, dc = shape.split()
        assert bucket == "beager" and pc.endswith("K") and dc.endswith("K")
        assert (int(decode[1:]) > 0) == (dc != "dc0K") and (int(prefill[1:]) > 0) == (pc != "pc0K")
