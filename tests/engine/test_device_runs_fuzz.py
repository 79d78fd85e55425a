"""Device runs over random engine settings (hypothesis, derandomized: CI runs the same examples
every time), CPU fp32: whatever the scheduling mode, chunk, budget, seats, block size, KV
cache size (preemption), prefix caching, stall bound, R7 threshold, run length and exit mode,
device runs give every request what host-decided decoding gives it; and on the packaged model,
runs with lanes (speculation with the exit gate) do too, for any K and d. Fuzzing like this
found runs of fewer invocations than the model's depth overflowing their buffers beside prefill
(test_device_runs.py `test_runs_shorter_than_a_tokens_loops`) and carried runs with lanes
under-reserving KV blocks (test_speculative_gate.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.engine.harness import kv_all_free, make_engine
from tests.engine.test_device_runs import MODES, _arriving_jobs, _assert_same, _run
from tests.engine.test_speculative_gate import _jobs as _text_jobs
from vllm_rlt.models.tiny import default_model_dir, write_tiny_ouro


def fuzz(examples: int):
    """`examples` derandomized examples, without shrinking: an example takes about a second, and
    a failing one names its settings already."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))  # fmt: skip


# what every engine of an example shares: the scheduling and cache settings
SCHEDULING = st.fixed_dictionaries(
    {
        "max_num_seqs": st.sampled_from([1, 2, 3, 8]),
        "block_size": st.sampled_from([4, 16]),
        "enable_prefix_caching": st.booleans(),
        "prefill_chunk_size": st.sampled_from([3, 8, 16, 64]),
        "max_num_batched_tokens": st.sampled_from([8, 24, 64, 256]),
        "mode": st.sampled_from(["refill", "mixed", "wcpb"]),
    },
    optional={
        "num_kv_blocks": st.sampled_from([150, 200, 300]),
        "max_prefill_stall_loops": st.sampled_from([1, 2, 3]),
        "max_context_with_decode": st.sampled_from([0, 16, 40]),
    },
)


def _engine_settings(drawn: dict) -> dict:
    kw = dict(drawn)
    mode = kw.pop("mode")
    kw["scheduling_mode"] = "refill" if mode == "refill" else "mixed"
    kw["wavefront_chunked_prefill"] = mode == "wcpb"
    return kw


_MODEL: list = []


def _model_dir(tmp_path_factory):
    if not _MODEL:
        _MODEL.append(write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5))
    return _MODEL[0]


def test_device_runs_equal_host_decisions_under_any_settings(tmp_path_factory):
    model_dir = _model_dir(tmp_path_factory)

    @fuzz(6)
    @given(
        drawn=SCHEDULING,
        exit_mode=st.sampled_from(list(MODES)),
        run_loops=st.sampled_from([2, 3, 5, 16]),
        seed=st.integers(0, 10**6),
        num=st.sampled_from([3, 6, 10]),
    )
    def check(drawn, exit_mode, run_loops, seed, num):
        kw = {**_engine_settings(drawn), "exit_mode": exit_mode, **MODES[exit_mode]}
        jobs = _arriving_jobs(seed, num)
        results = {}
        for loops in (0, run_loops):
            eng = make_engine(model_dir, device_decode_loops=loops, **kw)
            eng.eos_token_ids = tuple(range(0, 256, 11))
            results[loops] = _run(eng, jobs)
            assert kv_all_free(eng)
        _assert_same(eng, jobs, results[run_loops], results[0], exact=True)

    check()


@fuzz(4)  # (the packaged model: slower)
@given(
    drawn=SCHEDULING,
    exit_mode=st.sampled_from(["ouro", "ouro_delayed"]),
    k=st.integers(1, 4),
    draft_loops=st.integers(1, 3),
    run_loops=st.sampled_from([2, 3, 7, 16]),
    seed=st.integers(0, 10**6),
    num=st.sampled_from([3, 6, 9]),
)
def test_lanes_equal_host_decisions_under_any_settings(
    drawn, exit_mode, k, draft_loops, run_loops, seed, num
):
    kw = {**_engine_settings(drawn), "exit_mode": exit_mode}
    jobs = _text_jobs(seed, num)
    plain = make_engine(default_model_dir(), device_decode_loops=0, **kw)
    plain.eos_token_ids = (7, 11)
    want = _run(plain, jobs)
    spec = {"num_speculative_tokens": k, "speculative_draft_loops": draft_loops}
    eng = make_engine(default_model_dir(), device_decode_loops=run_loops, **spec, **kw)
    eng.eos_token_ids = (7, 11)
    _assert_same(eng, jobs, _run(eng, jobs), want, exact=True)
    assert kv_all_free(eng)
