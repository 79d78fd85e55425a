"""Engine behaviour: abort in every state, KV always freed, bad input rejected while other
requests keep running, stops, n > 1, logprobs, and the offline LLM API."""

from __future__ import annotations

import random

import pytest

from tests.engine.harness import Job, kv_all_free, make_engine, run_batched
from vllm_rlt.attention.metadata import TILE_ROWS
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.tiny import write_tiny_ouro
from vllm_rlt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_ouro(tmp_path_factory.mktemp("m"), vocab_size=256, seed=8)


def engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 512)
    return make_engine(model_dir, **kw)


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, exit_threshold=0.5)
OTHERS = [
    Job("o1", [5, 9, 13, 20, 31, 7, 8], GREEDY),
    Job("o2", [44, 45, 46], SamplingParams(max_tokens=9, temperature=0.9, seed=4, ignore_eos=True)),
]


def _state_reached(eng: LLMEngine, req_id: str, state: str) -> bool:
    req = eng.scheduler.requests.get(req_id)
    if req is None:
        return False
    return {
        "waiting": req.status.value == "waiting",
        "mid-prefill": req.num_prefilled_tokens > 0 and req.in_prefill,
        "mid-loop": req.decode is not None and req.decode.loops_done > 0,
        "before-coda": req.ready_loops is not None and len(req.output_token_ids) > 0,
    }[state]


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "mid-loop", "before-coda"])
def test_abort_in_any_state_frees_everything(model_dir, state):
    """Abort the victim once it reaches `state`; the others finish exactly as without it."""
    want = run_batched(engine(model_dir, max_num_seqs=2), OTHERS)
    seqs = 1 if state == "waiting" else 3
    # a state waits for its coda between steps only when the host decides exits (a device run
    # samples an exited token in the same step)
    loops = 0 if state == "before-coda" else 16
    eng = engine(model_dir, max_num_seqs=seqs, prefill_chunk_size=4, max_num_batched_tokens=6,
                 device_decode_loops=loops)  # fmt: skip
    victim = Job("v", list(range(40, 70)), SamplingParams(max_tokens=20, exit_threshold=0.6))
    eng.add_request("v", victim.prompt, victim.params)
    for job in OTHERS:
        eng.add_request(job.req_id, job.prompt, job.params)
    results, aborted = {}, False
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        if not aborted and _state_reached(eng, "v", state):
            final = eng.abort_request("v")
            aborted = True
            assert "v" not in eng.scheduler.requests
            assert final.finished and final.outputs[0].finish_reason == "abort"
            assert eng.abort_request("v") is None
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
    assert aborted, f"the victim never reached {state}"
    assert {
        k: (tuple(v.token_ids), tuple(v.exit_depths)) for k, v in results.items() if k != "v"
    } == want
    assert kv_all_free(eng)
    assert eng.step() == []  # an idle step delivers the last finished ids to the runner
    assert not eng.runner.reqs  # which drops its mirrors and hidden-state slots


@pytest.mark.parametrize(
    "prompt,params,needle",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 9999], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_loops=5), "max_loops"),
        ([1, 2], SamplingParams(min_loops=5), "min_loops"),
        # the KV cache's 512 positions per request cap max_model_len at 513 (< the model's 1024)
        ([1, 2], SamplingParams(max_tokens=1020), r"= 1022 exceeds max_model_len \(513\)"),
        ([1, 2], SamplingParams(max_tokens=512), r"= 514 exceeds max_model_len \(513\)"),
        ("ab\ud800", SamplingParams(), "prompt is not valid Unicode"),
        ([1, 2], SamplingParams(top_k=2**63), r"top_k must be .* \(the vocabulary\)"),
        ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids has ids outside"),
    ],
)
def test_bad_input_is_rejected_and_others_keep_running(model_dir, prompt, params, needle):
    eng = engine(model_dir, num_kv_blocks=512)  # 512 blocks / 4 planes * 4 = 512 positions
    eng.add_request("ok", [3, 4, 5], GREEDY)
    eng.step()
    with pytest.raises(ValueError, match=needle):
        eng.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", [1], GREEDY)
    results = run_batched(eng, [])
    assert len(results["ok"][0]) == 6
    assert kv_all_free(eng)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_fault_in_one_requests_processing_ends_that_request_only(model_dir, async_scheduling):
    """The victim's output processing raises once it has three tokens: it ends with finish_reason
    "error" and its KV freed; the others finish exactly as without it, and the engine goes on."""
    want = run_batched(engine(model_dir, max_num_seqs=3), OTHERS)
    eng = engine(model_dir, max_num_seqs=3, async_scheduling=async_scheduling)
    victim = [60, 61, 62, 63]
    process = eng.outputs.process

    def faulty(req):
        if req.prompt_token_ids == victim and len(req.output_token_ids) >= 3:
            raise RuntimeError("detokenizer fault")
        return process(req)

    eng.outputs.process = faulty
    eng.add_request("v", victim, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for job in OTHERS:
        eng.add_request(job.req_id, job.prompt, job.params)
    finals = _finish(eng)
    assert finals["v"].outputs[0].finish_reason == "error"
    assert len(finals["v"].outputs[0].token_ids) < 12
    got = {
        k: (tuple(o.outputs[0].token_ids), tuple(o.outputs[0].exit_depths))
        for k, o in finals.items()
    }
    assert {k: v for k, v in got.items() if k != "v"} == want
    assert kv_all_free(eng)
    eng.add_request("after", OTHERS[0].prompt, OTHERS[0].params)
    assert _finish(eng)["after"].outputs[0].token_ids == list(want["o1"][0])


@pytest.mark.parametrize(
    "field,value", [("max_tokens", 0), ("exit_threshold", 1.5), ("temperature", -1.0)]
)
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_tokens_strings_eos_and_lengths(model_dir):
    eng = engine(model_dir)
    base = run_batched(eng, [Job("b", [7, 8, 9], GREEDY)])["b"][0]
    stop_tok = base[3]
    params = SamplingParams(
        max_tokens=6, temperature=0, exit_threshold=0.5, ignore_eos=True, stop_token_ids=[stop_tok]
    )
    eng.add_request("s", [7, 8, 9], params)
    out = _finish(eng)["s"].outputs[0]
    first = base.index(stop_tok)
    assert out.token_ids == list(base[: first + 1]) and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    text = eng.tokenizer.decode(list(base), skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    eng.add_request(
        "t",
        [7, 8, 9],
        SamplingParams(
            max_tokens=6, temperature=0, exit_threshold=0.5, ignore_eos=True, stop=[stop]
        ),
    )
    out = _finish(eng)["t"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and text.startswith(out.text)
    eng.add_request("l", [7, 8, 9], GREEDY)
    assert _finish(eng)["l"].outputs[0].finish_reason == "length"
    assert kv_all_free(eng)


def test_eos_stops_unless_ignored(model_dir):
    eng = engine(model_dir)
    base = run_batched(eng, [Job("b", [7, 8, 9], GREEDY)])["b"][0]
    eng.eos_token_ids = (base[2],)
    params = SamplingParams(max_tokens=6, temperature=0, exit_threshold=0.5)
    eng.add_request("e", [7, 8, 9], params)
    out = _finish(eng)["e"].outputs[0]
    assert out.token_ids == list(base[: base.index(base[2]) + 1])
    assert out.finish_reason == "stop" and out.stop_reason == base[2]
    eng.add_request("i", [7, 8, 9], GREEDY)  # ignore_eos
    assert _finish(eng)["i"].outputs[0].token_ids == list(base)


def test_n_samples_logprobs_and_exit_depths(model_dir):
    eng = engine(model_dir)
    params = SamplingParams(
        n=3, max_tokens=5, temperature=1.0, seed=11, logprobs=3, ignore_eos=True
    )
    eng.add_request("n", [1, 2, 3, 4], params)
    out = _finish(eng)["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds 11, 12, 13 differ
    for c in out.outputs:
        assert len(c.token_ids) == 5 and len(c.exit_depths) == 5 and c.exit_depths[0] == 4
        assert len(c.logprobs) == 5
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in lp and len(lp) >= 3 and all(v <= 0 for v in lp.values())
    assert kv_all_free(eng)


def test_llm_generate_keeps_input_order(model_dir):
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=512, block_size=4, max_num_seqs=2)
    prompts = ["def f(x):", [9, 10, 11], "import os", "class A:"]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (3, 1, 4, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 4, 2]
    assert outs[0].prompt == "def f(x):" and outs[1].prompt_token_ids == [9, 10, 11]
    assert all(o.finished for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(str(model_dir), max_num_sequences=3)


def test_priority_queue_admits_lower_priority_value_first(model_dir):
    eng = engine(model_dir, max_num_seqs=1, queue_policy="priority")
    for req_id, prio in (("late", 5), ("urgent", 0), ("mid", 2)):
        eng.add_request(
            req_id, [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), priority=prio
        )
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["urgent", "mid", "late"]


def test_stats_count_rows_and_loops(model_dir):
    eng = engine(model_dir, prefill_chunk_size=4, max_num_batched_tokens=8)
    rng = random.Random(0)
    jobs = [Job(f"r{i}", rng.choices(range(256), k=9), GREEDY) for i in range(3)]
    run_batched(eng, jobs)
    s = eng.stats.as_dict()
    assert s["generated_tokens"] == 18
    assert 1 <= s["loops_per_token"] <= 4
    assert s["prefill_rows"] == 3 * 9 * 4  # every prompt position at every depth
    assert s["rows_per_invocation"] > 1 and s["tasks_per_invocation"] >= 1
    depth_rows = [s[f"rows_at_depth_{d}"] for d in range(4)]
    assert sum(depth_rows) == s["rows"] and depth_rows[0] >= depth_rows[3]


def test_prefill_tiles_are_as_tall_as_a_chunk(model_dir):
    """Eager invocations (and the CUDA graphs) cut prefill segments into attention tiles of the
    chunk size rounded up to a power of two, at most TILE_ROWS."""
    assert engine(model_dir, prefill_chunk_size=3, max_num_batched_tokens=8).runner.tile_rows == 4
    eng = engine(model_dir, prefill_chunk_size=100, max_num_batched_tokens=256)
    assert eng.runner.tile_rows == TILE_ROWS == 64


def test_layer_kernels_setting_reaches_the_model(model_dir):
    """`layer_kernels` picks the model's LayerKernels strategy; an unknown one names the
    setting and the choices."""
    assert engine(model_dir).model.layer_kernels == "auto"
    assert engine(model_dir, layer_kernels="fused").model.layer_kernels == "fused"
    with pytest.raises(ValueError, match="layer_kernels must be one of .*'skinny'"):
        engine(model_dir, layer_kernels="cudnn")


def _finish(eng):
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return done
