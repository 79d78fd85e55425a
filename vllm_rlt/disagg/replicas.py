"""The front end of data-parallel replicas (`front_end.FrontEnd`): `data_parallel_size` whole
engines (`replica_role.ReplicaRole`), each request sent wholly to the least-loaded one (the
requests routed there and not finished) and streamed from it.

Faults (beyond `FrontEnd`'s): a replica's death fails exactly its requests; with no replica
left, `error` is set and the server stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.engines import EngineHandle
from vllm_rlt.disagg.front_end import Flight, FrontEnd


@dataclass(kw_only=True)
class _ReplicaFlight(Flight):
    replica: EngineHandle


class ReplicaRouter(FrontEnd):
    KIND = "a server of data-parallel replicas"
    GONE = "no replica is left"

    def _route(self, **request) -> _ReplicaFlight:
        flight = _ReplicaFlight(replica=self._least_loaded("replica"), **request)
        flight.replica.load += 1
        flight.replica.routed += 1
        order = msg.Generate(flight.handle, flight.request_id, flight.prompt, flight.params)
        self._send(flight.replica, order)
        return flight

    def _forget(self, flight: _ReplicaFlight, notify: bool, failed: bool) -> None:
        flight.replica.load -= 1
        if notify:
            self._send(flight.replica, msg.Abort(flight.handle))

    def _num_waiting(self) -> int:
        return sum(not f.started for f in self._flights.values())

    def _depends_on(self, flight: _ReplicaFlight, engine: EngineHandle) -> bool:
        return flight.replica is engine

    def _survive(self, engine: EngineHandle) -> bool:
        return any(e.alive for e in self.engines)
