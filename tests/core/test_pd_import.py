"""The decode side of prefill/decode disaggregation, without a model: `add_prefilled` takes in
a request whose prompt KV was imported, with its prefill fields at the whole prompt, its first
token at full depth, its blocks announced to the runner and published to the prefix cache; an
import preempted before the runner heard of it is withdrawn."""

from __future__ import annotations

from tests.core.test_scheduler import D, request, step
from vllm_rlt.config_sched import SchedulerConfig
from vllm_rlt.core.kv_cache_manager import KVCacheManager
from vllm_rlt.core.sched.execution_batch import RowKind, SampledToken
from vllm_rlt.core.sched.exit_policy import make_exit_policy
from vllm_rlt.core.sched.scheduler import Scheduler


def scheduler() -> Scheduler:
    kv = KVCacheManager(4096, 4, "last_exited", D, enable_prefix_caching=True)
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8, async_scheduling=False
    )
    return Scheduler(config, kv, make_exit_policy("ouro", None), D)


def imported(s, req_id: str, prompt_len: int, max_tokens: int = 4):
    req = request(req_id, prompt_len, max_tokens)
    s.kv.reserve(req_id, prompt_len)  # what the decode role does before the KV arrives
    s.add_prefilled(req, SampledToken(7, None, ()))
    return req


def test_an_import_starts_decoding_from_its_first_token():
    s = scheduler()
    req = imported(s, "a", 10)
    assert (req.num_prefilled_tokens, req.prefill_reclaimable_tokens) == (10, 10)
    assert (req.output_token_ids, req.output_exit_depths) == ([7], [D])
    batch = step(s)
    (new,) = batch.new_requests
    assert (new.request_id, new.resume_token) == ("a", 7)
    assert [r for r, _ in batch.block_tables] == ["a"]
    (task,) = batch.requests
    assert (task.kind, task.token_start, task.depth) == (RowKind.DECODE, 10, 0)
    # the prompt's full blocks are in the prefix cache: a later request finds them
    assert s.kv.find_prefix(list(range(10)), 9).num_tokens == 8


def test_an_import_that_ends_on_its_first_token_never_reaches_the_runner():
    s = scheduler()
    req = imported(s, "a", 6, max_tokens=1)
    assert req.status.finished and not s.requests
    assert s.kv.num_free_blocks == s.kv.num_total_blocks
    assert not step(s).new_requests


def test_an_import_preempted_before_the_runner_heard_of_it_is_withdrawn():
    s = scheduler()
    req = imported(s, "a", 6)
    s._preempt(req, False, None)
    batch = step(s)  # re-admitted (its prompt blocks found in the cache), announced once
    assert [n.request_id for n in batch.new_requests] == ["a"]
    assert "a" not in batch.finished_req_ids and s.num_preemptions == 0
