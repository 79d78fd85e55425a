"""A data-parallel replica: a whole engine (prefill and decode of its requests, its own KV
cache) behind the front end, which sends it each request whole (`Generate`) and streams its
outputs."""

from __future__ import annotations

from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.role import StreamingRole


class ReplicaRole(StreamingRole):
    def handle(self, message) -> None:
        if isinstance(message, msg.Generate):
            self._generate(message)
        elif isinstance(message, msg.Abort):
            self.abort_active(message.handle)

    def _generate(self, order: msg.Generate) -> None:
        if not self.admit(order):
            return
        self.active[order.request_id] = order.handle
        self.conn.send(msg.Accepted(order.handle))
