"""Which engines a disaggregated request depends on (`router._PDFlight.needs`): its decode
engine always; its prefill engine until both its first token and its last KV chunk came from
there. The chunks go out on a sender thread, so the first token can reach the front end first;
a request failed only on its first token would wait forever for KV that a dead prefill engine
never sends (the end-to-end fault test, `tests/entrypoints/test_pd_server.py`, timed out so
on a loaded machine)."""

from __future__ import annotations

from vllm_rlt.disagg.engines import EngineHandle
from vllm_rlt.disagg.role import Placement
from vllm_rlt.disagg.router import _PDFlight
from vllm_rlt.sampling_params import SamplingParams


def _engine(rank: int) -> EngineHandle:
    place = Placement(rank=rank, num_prefill=1, num_decode=1, port=1)
    return EngineHandle(place=place, process=None, conn=None)


def test_a_request_needs_its_prefill_engine_until_its_token_and_its_kv_came():
    prefill, decode, other = _engine(0), _engine(1), _engine(0)
    flight = _PDFlight(
        seed=0, prefill=prefill, decode=decode, handle=1, request_id="r", prompt=(1, 2),
        params=SamplingParams(), stream=None, accepted=None,
    )  # fmt: skip
    for token, kv in ((False, False), (True, False), (False, True)):
        flight.prefill_done, flight.kv_arrived = token, kv
        assert flight.needs(prefill) and flight.needs(decode) and not flight.needs(other)
    flight.prefill_done = flight.kv_arrived = True
    assert not flight.needs(prefill) and flight.needs(decode)
