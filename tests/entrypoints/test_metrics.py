"""/metrics: vLLM's names with a `model_name` label, the looped-model metrics under `vllm_rlt:`,
and counts that agree with each other and with the responses' usage after mixed traffic
(n > 1, several prompts, streams, a client that leaves, rejected requests)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_utils import ServerThread, read_metrics, tiny_engine, wait_idle
from vllm_rlt.entrypoints.openai.api_server import build_app
from vllm_rlt.models.tiny import write_tiny_ouro

MODEL = "tiny-metrics"
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_ouro(tmp_path_factory.mktemp("metrics") / "tiny", seed=6)
    engine = tiny_engine(model_dir)
    with ServerThread(build_app(engine, MODEL)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
}
LOOPED_METRICS = {
    "vllm_rlt:exit_depth": "histogram",
    "vllm_rlt:kv_cache_usage_perc_by_plane": "gauge",
    "vllm_rlt:num_free_kv_blocks": "gauge",
    "vllm_rlt:num_total_kv_blocks": "gauge",
    "vllm_rlt:invocations": "counter",
    "vllm_rlt:rows": "counter",
    "vllm_rlt:tasks": "counter",
    "vllm_rlt:rows_per_invocation": "gauge",
    "vllm_rlt:tasks_per_invocation": "gauge",
    "vllm_rlt:loops_per_token": "gauge",
    "vllm_rlt:spec_acceptance_rate": "gauge",
    "vllm_rlt:spec_mean_accepted_length": "gauge",
}


def test_names_types_and_labels(server, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body=EXTRA)
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    for name, kind in {**VLLM_METRICS, **LOOPED_METRICS}.items():
        assert families[name].type == kind, name
        assert families[name].documentation, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL, sample
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}  # fmt: skip
    assert reasons == {"stop", "length", "abort", "error"}
    planes = {s.labels["plane"] for s in families["vllm_rlt:kv_cache_usage_perc_by_plane"].samples}
    assert planes == {"0", "1", "2", "3"}
    depths = [s.labels["le"] for s in families["vllm_rlt:exit_depth"].samples if "le" in s.labels]
    assert depths == ["1.0", "2.0", "3.0", "4.0", "+Inf"]


def _delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_counts_agree_after_mixed_traffic(server, client):
    wait_idle(server.engine)
    before = read_metrics(server.url)
    usage = []
    # 2 prompts x n=2 (4 samples), a stream of n=3, a chat of n=2, then a stream of n=2 that is left
    usage.append(client.completions.create(model=MODEL, prompt=["import os", "class A:"], n=2,
                 max_tokens=4, seed=1, extra_body=EXTRA).usage)  # fmt: skip
    stream = client.completions.create(
        model=MODEL, prompt="def f(x):", n=3, max_tokens=5, seed=2, stream=True,
        stream_options={"include_usage": True}, extra_body=EXTRA,
    )  # fmt: skip
    usage += [c.usage for c in stream if c.usage is not None]
    usage.append(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3, seed=3,
        extra_body=EXTRA).usage)  # fmt: skip
    with pytest.raises(openai.BadRequestError):  # rejected before the engine: never counted
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    # a client that leaves mid-stream: its 2 samples end as "abort"
    body = {"prompt": "x = 1", "n": 2, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: {"))
    wait_idle(server.engine)
    after = read_metrics(server.url)
    samples = 4 + 3 + 2 + 2
    finished = {
        reason: _delta(before, after, f'vllm:request_success_total{{finished_reason="{reason}"}}')
        for reason in ("stop", "length", "abort", "error")
    }
    assert finished == {"stop": 0, "length": 9, "abort": 2, "error": 0}
    for name in ("e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):  # fmt: skip
        assert _delta(before, after, f"vllm:{name}_count") == samples, name
    # a first-token time for every sample that got a token (the 2 left ones may have none)
    ttft = _delta(before, after, "vllm:time_to_first_token_seconds_count")
    assert samples - 2 <= ttft <= samples
    generated = _delta(before, after, "vllm:generation_tokens_total")
    counted = sum(u.completion_tokens for u in usage)
    assert counted == 2 * 2 * 4 + 3 * 5 + 2 * 3
    aborted = generated - counted
    assert 2 <= aborted < 2 * 200
    # first tokens + later tokens = all tokens, and every generated token has an exit depth
    itl = _delta(before, after, "vllm:inter_token_latency_seconds_count")
    assert itl + ttft == generated
    assert _delta(before, after, 'vllm_rlt:exit_depth_bucket{le="+Inf"}') == generated
    assert _delta(before, after, "vllm:request_generation_tokens_sum") == generated
    # prompt tokens: once per prompt, as the usage reports them
    prompt_tokens = _delta(before, after, "vllm:prompt_tokens_total")
    left_prompt = len(server.engine.tokenizer.encode("x = 1").ids)
    assert prompt_tokens == sum(u.prompt_tokens for u in usage) + left_prompt
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm_rlt:num_free_kv_blocks"] == after["vllm_rlt:num_total_kv_blocks"]
    assert _delta(before, after, "vllm_rlt:invocations_total") > 0


def test_speculative_decoding_metrics(tmp_path):
    """With speculation on, windows, drafted and accepted tokens count up, and the rates agree
    with the counters."""
    model_dir = write_tiny_ouro(tmp_path / "tiny", seed=6)
    engine = tiny_engine(model_dir, num_speculative_tokens=3, speculative_draft_loops=2)
    with ServerThread(build_app(engine, MODEL)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model=MODEL,
            prompt=["import os", "def f"],
            max_tokens=12,
            temperature=0,
            extra_body=EXTRA,
        )
        assert out.usage.completion_tokens == 24
        wait_idle(engine)
        m = read_metrics(srv.url)
    windows = m["vllm:spec_decode_num_drafts_total"]
    drafted = m["vllm:spec_decode_num_draft_tokens_total"]
    accepted = m["vllm:spec_decode_num_accepted_tokens_total"]
    assert windows > 0 and drafted >= windows and 0 <= accepted <= drafted
    assert m["vllm_rlt:spec_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert m["vllm_rlt:spec_mean_accepted_length"] == pytest.approx(1 + accepted / windows)
    # every token comes from a window except each sample's first (prefill) and plain decode steps
    assert accepted + windows <= m["vllm:generation_tokens_total"] - 2
