"""Sampling settings inside device runs, fp32 (on CUDA too, through captured runs): min-p and
logit biases as the run loads them, penalties counting the tokens each sample phase takes, and
random biases and penalties against host-decided decoding in every exit mode."""

from __future__ import annotations

import pytest

from tests.engine.harness import Job, kv_all_free, make_engine
from tests.engine.test_device_runs import MODES, TARGETS, _assert_same, _count_runs, _jobs, _run
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=5)


@pytest.mark.parametrize("device,backend", TARGETS)
def test_min_p_and_logit_bias_hold_inside_device_runs(model_dir, device, backend):
    """The sampling settings a run loads: a +100 bias gives every token of a hot sample inside
    the runs, a -100 bias never appears, and min_p 1 at a high temperature is greedy decoding."""
    eng = make_engine(model_dir, device, backend, device_decode_loops=16)
    runs = _count_runs(eng)
    hot = {"max_tokens": 24, "temperature": 2.0, "seed": 4, "ignore_eos": True,
           "exit_threshold": 0.5}  # fmt: skip
    jobs = [
        Job("forced", [3, 4, 5], SamplingParams(**hot, logit_bias={9: 100.0})),
        Job("banned", [3, 4, 5], SamplingParams(**hot, logit_bias={t: -100.0 for t in range(128)})),
        Job("pinned", [3, 4, 5], SamplingParams(**hot, min_p=1.0)),
        Job("greedy", [3, 4, 5], SamplingParams(**{**hot, "temperature": 0.0})),
    ]
    got = _run(eng, jobs)
    assert runs[0] and kv_all_free(eng)
    assert got["forced"][0] == (9,) * 24
    assert min(got["banned"][0]) >= 128
    assert got["pinned"][0] == got["greedy"][0]


@pytest.mark.parametrize("device,backend", TARGETS)
def test_penalties_count_the_tokens_taken_inside_device_runs(model_dir, device, backend):
    """A +5 bias makes a token every greedy token; frequency and presence penalties of 2 take
    4 off it at its first occurrence and 2 at each after, so it stops recurring within a run
    only if each sample phase counts what the one before took; the host path agrees."""
    greedy = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "exit_threshold": 0.5,
              "logit_bias": {9: 5.0}}  # fmt: skip
    penalized = {**greedy, "presence_penalty": 2.0, "frequency_penalty": 2.0}
    repeated = {**greedy, "repetition_penalty": 50.0}
    jobs = [Job("plain", [3, 4, 5], SamplingParams(**greedy)),
            Job("penalized", [3, 4, 5], SamplingParams(**penalized)),
            Job("repeated", [9, 9, 3], SamplingParams(**repeated))]  # fmt: skip
    eng = make_engine(model_dir, device, backend, device_decode_loops=16)
    runs = _count_runs(eng)
    got = _run(eng, jobs)
    assert runs[0] and kv_all_free(eng)
    assert got["plain"][0] == (9,) * 24
    assert 1 <= got["penalized"][0].count(9) <= 3
    assert got["repeated"][0].count(9) < 24  # 9 is in its prompt: divided by 50 from the start
    if device == "cpu":  # (on CUDA the two paths may part at a near-tie)
        assert got == _run(make_engine(model_dir, device_decode_loops=0), jobs)


@pytest.mark.parametrize("mode", list(MODES))
def test_logit_biases_and_penalties_in_device_runs_compute_what_the_host_path_computes(
    model_dir, mode
):
    jobs = _jobs(len(mode) + 40, num=10, extras=True)
    assert any(j.params.logit_bias for j in jobs) and any(j.params.penalized for j in jobs)
    results = {}
    for loops in (0, 16):
        eng = make_engine(model_dir, max_num_seqs=8, exit_mode=mode, device_decode_loops=loops,
                          **MODES[mode])  # fmt: skip
        eng.eos_token_ids = tuple(range(0, 256, 11))
        runs = _count_runs(eng)
        results[loops] = _run(eng, jobs)
        assert kv_all_free(eng) and bool(runs[0]) == bool(loops)
    _assert_same(eng, jobs, results[16], results[0], exact=True)
