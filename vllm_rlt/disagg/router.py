"""The front end of a disaggregated server (`front_end.FrontEnd`): routes each request to the
least-loaded prefill and decode engine, relays the control messages of its life (protocol.py)
and streams its outputs from the decode side.

Faults (beyond `FrontEnd`'s): a request fails when its decode engine dies, or its prefill
engine before its first token and its last KV chunk came from there (a request whose KV stops
midway would wait for it forever); the prefill engines stop sending KV to a dead decode
engine.
With no prefill or no decode engine left, `error` is set and the server stops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm_rlt.config import EngineConfig
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.engines import EngineHandle
from vllm_rlt.disagg.front_end import Flight, FrontEnd
from vllm_rlt.disagg.prefill_role import prefill_params
from vllm_rlt.serve_config import DisaggConfig

PD_COUNTERS = {  # the transfer counters of `snapshot.stats`, each a /metrics counter
    "pd_transfers": "Requests whose KV the decode engines imported.",
    "pd_kv_transfer_chunks": "KV chunks received by the decode engines.",
    "pd_kv_transfer_bytes": "KV bytes received by the decode engines.",
    "pd_kv_transfer_skipped_blocks": "Prompt KV blocks not sent: the decode engine's prefix "
    "cache held them.",
    "pd_transfer_overlap_seconds": "Summed over requests: how long before the end of the "
    "prompt's prefill its first KV chunk reached the decode engine.",
}


@dataclass(kw_only=True)
class _PDFlight(Flight):
    seed: int
    prefill: EngineHandle
    decode: EngineHandle
    prefill_done: bool = False  # the first token came back: the prefill side is finished
    kv_arrived: bool = False  # the decode engine has all its KV
    transfer: dict[str, float] = field(default_factory=dict)  # see `PDRouter.transfers`

    def needs(self, engine: EngineHandle) -> bool:
        """Whether the request fails when `engine` dies: its decode engine, and its prefill
        engine until both its first token and all its KV came from there (KV chunks are
        still on their way after the first token)."""
        return self.decode is engine or (
            self.prefill is engine and not (self.prefill_done and self.kv_arrived)
        )


class PDRouter(FrontEnd):
    KIND = "a disaggregated server"
    GONE = "no prefill or no decode engine is left"

    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig,
        *,
        max_waiting_requests: int | None = None,
        record_transfers: bool = False,
    ):
        """Starts pd_prefill + pd_decode engine processes (see `FrontEnd`).
        `record_transfers`: keep, per finished request, when the prefill engine completed its
        prompt, when its first chunk reached the decode engine, in how many chunks its KV went and
        how many blocks the decode engine's prefix cache held (`transfers`; tests)."""
        self.transfers: dict[str, dict[str, float]] | None = {} if record_transfers else None
        self._seeds = random.Random(config.model.seed)
        self._transfer_stats = dict.fromkeys(PD_COUNTERS, 0)
        super().__init__(config, disagg, max_waiting_requests=max_waiting_requests)

    def _route(self, **request) -> _PDFlight:
        prefill, decode = self._least_loaded("prefill"), self._least_loaded("decode")
        params = request["params"]
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        flight = _PDFlight(seed=seed, prefill=prefill, decode=decode, **request)
        for e in (prefill, decode):
            e.load += 1
            e.routed += 1
        expect = msg.Expect(
            flight.handle, flight.request_id, flight.prompt, params, seed, prefill.place.rank
        )
        self._send(decode, expect)
        return flight

    def _forget(self, flight: _PDFlight, notify: bool, failed: bool) -> None:
        flight.decode.load -= 1
        if not flight.prefill_done:
            flight.prefill.load -= 1
            if notify:
                self._send(flight.prefill, msg.Abort(flight.handle))
        if notify:
            self._send(flight.decode, msg.Abort(flight.handle))
        if self.transfers is not None and not failed:
            self.transfers[flight.request_id] = flight.transfer

    def _num_waiting(self) -> int:
        return sum(not f.prefill_done for f in self._flights.values())

    def _depends_on(self, flight: _PDFlight, engine: EngineHandle) -> bool:
        return flight.needs(engine)

    def _survive(self, engine: EngineHandle) -> bool:
        if not engine.place.is_prefill:  # (a decode engine's receiving threads end by themselves)
            for e in self.engines:
                if e.place.is_prefill:
                    self._send(e, msg.PeerDead(engine.place.rank))
        return {e.place.is_prefill for e in self.engines if e.alive} == {True, False}

    def _on_request_message(self, flight: _PDFlight, m) -> None:
        if isinstance(m, msg.Reserved):
            flight.transfer["skip_blocks"] = m.skip_blocks
            params = prefill_params(flight.params, flight.seed)
            order = msg.Prefill(
                flight.handle, flight.request_id, flight.prompt, params,
                flight.decode.place.rank, m.skip_blocks,
            )  # fmt: skip
            self._send(flight.prefill, order)
        elif isinstance(m, msg.FirstToken):
            flight.prefill_done = True
            flight.prefill.load -= 1
            flight.transfer["prefill_done_at"] = m.prefill_done_at
            self._send(flight.decode, m)
        elif isinstance(m, msg.KVArrived):
            flight.kv_arrived = True
        elif isinstance(m, msg.Imported):
            flight.transfer["first_chunk_at"] = m.first_chunk_at
            flight.transfer["chunks"] = m.num_chunks
            self._count_transfer(flight.transfer, m)

    def _stats(self) -> dict[str, float]:
        return dict(self._transfer_stats)

    def _count_transfer(self, transfer: dict[str, float], m: msg.Imported) -> None:
        """Add an imported request's transfer to the counters `/metrics` reports (the overlap:
        how long before the end of its prefill its first KV chunk arrived; one clock per host)."""
        t = self._transfer_stats
        t["pd_transfers"] += 1
        t["pd_kv_transfer_chunks"] += m.num_chunks
        t["pd_kv_transfer_bytes"] += m.num_bytes
        t["pd_kv_transfer_skipped_blocks"] += transfer.get("skip_blocks", 0)
        overlap = transfer.get("prefill_done_at", m.first_chunk_at) - m.first_chunk_at
        t["pd_transfer_overlap_seconds"] += max(0.0, overlap)
        self._refresh_snapshot()
