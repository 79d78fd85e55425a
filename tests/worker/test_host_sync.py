"""The host waits for the GPU only where a decision needs device data: at fixed depth a decode
step that samples no token (depths 1..D-1 of a token) queues its work and returns at once."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.engine.harness import make_engine
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


def _syncs(engine) -> tuple[int, int]:
    """Run one step under CUDA's sync debug mode: (synchronising calls, tokens it produced)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            outs = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # only the sync reports: the first switch to "warn" also warns that the mode is a prototype
    # which "does not yet detect all synchronizing operations"
    syncs = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    return syncs, sum(len(o.outputs[0].token_ids) > 0 for o in outs)


def _cuda_engine(tmp_path, **kw):
    """An fp32 engine with Triton attention on CUDA over a tiny random Ouro."""
    model = write_tiny_ouro(tmp_path / "m", seed=3)
    return make_engine(model, "cuda", "triton", block_size=16, num_kv_blocks=256, **kw)


def _run_counting_waits(engine) -> tuple[int, int]:
    """Step until every request finished: (steps without a wait, steps with one); a step may
    wait only to read back the tokens it produced."""
    quiet = waiting = 0
    while engine.has_unfinished_requests():
        syncs, produced = _syncs(engine)
        if syncs == 0:
            quiet += 1
        else:
            waiting += 1
            assert produced or not engine.has_unfinished_requests(), "a step waited for nothing"
    return quiet, waiting


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_fixed_depth_decode_steps_wait_only_when_they_sample(tmp_path, enforce_eager):
    engine = _cuda_engine(tmp_path, enforce_eager=enforce_eager)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, exit_threshold=1.0)
    engine.add_request("warm", list(range(1, 40)), params)  # kernels compiled, pinned pool grown
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("a", list(range(1, 40)), params)
    quiet, waiting = _run_counting_waits(engine)
    assert quiet >= 2 * waiting, (quiet, waiting)  # D = 4: three of four steps do not wait


@pytest.mark.gpu
def test_prefill_steps_replay_mixed_graphs_without_waiting(tmp_path):
    """WCPB steps whose invocations carry prefill chunks replay mixed graphs, and a step that
    samples nothing queues its work and returns without waiting for the GPU."""
    engine = _cuda_engine(
        tmp_path, wavefront_chunked_prefill=True, prefill_chunk_size=16, max_num_batched_tokens=40
    )
    graphs = engine.runner.graphs
    specs, prepare = [], graphs.prepare

    def recording_prepare(*args):
        inv = prepare(*args)
        specs.append(inv and inv.spec)
        return inv

    graphs.prepare = recording_prepare
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, exit_threshold=1.0)
    engine.add_request("warm", list(range(1, 90)), params)  # kernels compiled, pinned blocks cached
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("a", list(range(1, 120)), params)
    engine.add_request("b", list(range(5, 70)), params)
    quiet, waiting = _run_counting_waits(engine)
    assert quiet >= 2 * waiting, (quiet, waiting)
    assert any(spec is not None and spec.num_chunk_slots for spec in specs), "no mixed graph ran"


@pytest.mark.gpu
def test_sampling_steps_wait_for_the_sample_not_for_the_invocations(tmp_path):
    """Synchronous scheduling: a step that samples reads back its tokens as soon as they exist:
    the recurrent-core work queued after the sampling is still running when the step returns."""
    engine = _cuda_engine(tmp_path, async_scheduling=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, exit_threshold=1.0)
    engine.add_request("a", list(range(1, 40)), params)
    invoke = engine.runner._invoke

    def slow_invoke(*args):
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU time ahead of every invocation
        return invoke(*args)

    engine.runner._invoke = slow_invoke
    checked = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        sampled = any(o.outputs[0].token_ids for o in outs)
        if sampled and engine.has_unfinished_requests():  # this step also queued an invocation
            assert not torch.cuda.current_stream().query(), "the step waited for its invocation"
            checked += 1
        torch.cuda.synchronize()
    assert checked >= 4
