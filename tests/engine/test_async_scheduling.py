"""Async scheduling (the default): a step is scheduled and queued before the tokens of the step
before are read back. It computes exactly what synchronous scheduling computes (tokens, exit
depths, logprobs, text, finish reasons) in every scheduling mode, also where requests stop on
EOS, stop tokens and stop strings one step after more work was queued for them; outputs come one
step later; nothing leaks."""

from __future__ import annotations

import random

import pytest

from tests.engine.harness import kv_all_free, make_engine, random_jobs
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams

MODES = {
    "split": dict(scheduling_mode="mixed", prefill_chunk_size=5, max_num_batched_tokens=13),
    "wcpb": dict(
        scheduling_mode="mixed",
        wavefront_chunked_prefill=True,
        prefill_chunk_size=4,
        max_num_batched_tokens=11,
    ),
    "refill": dict(scheduling_mode="refill", prefill_chunk_size=7, max_num_batched_tokens=9),
    "no_refill": dict(scheduling_mode="no_refill", prefill_chunk_size=4, max_num_batched_tokens=9),
}


STOP_PROMPT = [7, 8, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=8)


def _workload(seed: int, stop: str):
    """Random jobs (exit gates read or fixed depth, greedy and sampled, arrivals over several
    steps) where about half may stop on EOS or a stop token, some with logprobs, one with n = 2
    and one with the stop string `stop`."""
    rng = random.Random(seed)
    jobs = []
    for job in random_jobs(rng, 10, vocab=256, depth=4):
        p = job.params
        extra = dict(ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, None, 2]))
        if rng.random() < 0.4:
            extra["stop_token_ids"] = rng.sample(range(256), 40)
        fields = {k: getattr(p, k) for k in ("temperature", "top_k", "top_p", "seed")}
        fields.update(exit_threshold=p.exit_threshold, min_loops=p.min_loops)
        fields.update(max_loops=p.max_loops, max_tokens=p.max_tokens)
        jobs.append((job.req_id, job.prompt, SamplingParams(**fields, **extra), job.arrival_step))
    jobs.append(("n2", [3, 1, 4, 1, 5], SamplingParams(n=2, max_tokens=7, seed=9), 1))
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, stop=[stop])
    jobs.append(("s", STOP_PROMPT, params, 2))
    return jobs


def _fixed_depth_jobs(seed: int):
    """Four requests at fixed depth that may stop on EOS: once prefilled, decode-only steps run
    all four loops of a token and sample every step (a stop is read back after the next step
    sampled again)."""
    rng = random.Random(seed)
    return [
        (f"f{i}", rng.choices(range(256), k=rng.randint(1, 20)), params, 0)
        for i in range(4)
        for params in [SamplingParams(max_tokens=12, temperature=0.8, seed=i, exit_threshold=1.0)]
    ]


def _without_logprobs(runs):
    return [{r: [s[:5] for s in samples] for r, samples in out.items()} for out in runs]


def _logprobs(runs):
    """Every token's {id: logprob}, in a fixed order."""
    return [lp for out in runs for r in sorted(out) for s in out[r] for lp in (s[5] or [])]


def _count_samples(eng) -> list[int]:
    """Count the tokens the engine's steps sample from now on (into the returned list)."""
    count, execute = [0], eng.runner.execute

    def counting(batch):
        count[0] += len(batch.sample_req_ids)
        return execute(batch)

    eng.runner.execute = counting
    return count


def _run(eng, jobs):
    """Step through `jobs`: {request: (per sample: tokens, depths, finish, stop reason, text,
    logprobs)}, and {request: the step each output arrived in}."""
    pending = sorted(jobs, key=lambda j: j[3])
    final, arrivals, step = {}, {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            req_id, prompt, params, _ = pending.pop(0)
            eng.add_request(req_id, prompt, params)
        for out in eng.step():
            arrivals.setdefault(out.request_id, []).append(step)
            if out.finished:
                final[out.request_id] = [
                    (
                        tuple(c.token_ids), tuple(c.exit_depths), c.finish_reason, c.stop_reason,
                        c.text, c.logprobs,
                    )
                    for c in out.outputs
                ]  # fmt: skip
        step += 1
    return final, arrivals


@pytest.mark.parametrize(
    "mode,device_loops", [(m, 16) for m in MODES] + [("split", 0), ("refill", 0)]
)
def test_async_scheduling_computes_what_sync_computes(model_dir, mode, device_loops):
    # a stop string from the middle of the text STOP_PROMPT's greedy continuation begins with
    greedy = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    text = _run(make_engine(model_dir), [("s", STOP_PROMPT, greedy, 0)])[0]["s"][0][4]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    results, samples = {}, {}
    for async_scheduling in (False, True):
        eng = make_engine(
            model_dir, num_kv_blocks=512, max_num_seqs=4, async_scheduling=async_scheduling,
            device_decode_loops=device_loops, **MODES[mode],
        )  # fmt: skip
        eng.eos_token_ids = tuple(range(0, 256, 3))  # common: requests not ignoring EOS stop
        samples[async_scheduling] = _count_samples(eng)
        outs = []
        for jobs in (_workload(0, stop), _workload(1, stop), _fixed_depth_jobs(2)):
            outs.append(_run(eng, jobs)[0])
            assert kv_all_free(eng)
        results[async_scheduling] = outs
        eng.step()  # an idle step hands the last finished requests to the runner
        assert not eng.runner.reqs and not eng.has_unfinished_requests()
    sync, unsync = results[False], results[True]
    # logprobs to fp32 rounding: a step's rows differ between the two (a token is sampled in a
    # batch of other requests), and the coda's reductions round by batch
    assert _without_logprobs(unsync) == _without_logprobs(sync)
    for a, b in zip(_logprobs(unsync), _logprobs(sync), strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    # async scheduling sampled tokens for requests that had stopped (not read back, dropped);
    # (device runs read their tokens back at once, and count no samples of the plan)
    tokens = sum(len(s[0]) for out in sync for samples in out.values() for s in samples)
    assert device_loops or samples[False] == [tokens] and samples[True][0] > tokens
    finishes = [s[2:4] for out in sync for samples in out.values() for s in samples]
    stopped = [f for f in finishes if f[0] == "stop"]
    assert any(isinstance(r, int) for _, r in stopped), "no request stopped on a token"
    assert ("stop", stop) in finishes
    assert any(f[0] == "length" for f in finishes)


def test_outputs_come_one_step_later(model_dir):
    """At fixed depth and c = 1 each step samples a token: synchronous scheduling returns it
    from the same step, async scheduling from the next; the engine steps once more in all."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, exit_threshold=1.0)
    arrivals = {}
    for async_scheduling in (False, True):
        eng = make_engine(model_dir, async_scheduling=async_scheduling)
        final, arrived = _run(eng, [("a", [5, 6, 7, 8], params, 0)])
        assert len(final["a"][0][0]) == 5
        arrivals[async_scheduling] = arrived["a"]
    assert len(arrivals[False]) == 5
    assert arrivals[True] == [s + 1 for s in arrivals[False]]


def test_abort_with_a_step_in_flight(model_dir):
    """An abort between steps (its request's tokens of the step before not read yet) ends it
    at once; the tokens read later are dropped and the others finish as without it."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want, _ = _run(make_engine(model_dir), [("o", [9, 10, 11], greedy, 0)])
    eng = make_engine(model_dir)
    eng.add_request("o", [9, 10, 11], greedy)
    eng.add_request("v", [1, 2, 3, 4], greedy)
    got = {}
    for _ in range(3):  # "v" has sampled tokens that are not read back yet
        got.update({o.request_id: o for o in eng.step()})
    assert eng.scheduler.requests["v"].pending_exit_depths
    final = eng.abort_request("v")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != "v"
            got[out.request_id] = out
    assert (tuple(got["o"].outputs[0].token_ids),) == (want["o"][0][0],)
    assert kv_all_free(eng)
