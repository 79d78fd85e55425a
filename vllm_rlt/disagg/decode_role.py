"""The decode side: reserves blocks for a request's whole prompt before any KV arrives, writes
the chunks into them as they come, and once the last chunk and the first token are both here
starts decoding it (`LLMEngine.import_prefilled`: its prefill fields start at the whole prompt).

Reservations are first come first served and wait while the free blocks (less a 1% watermark,
as at admission) do not hold the prompt. A prefix-cache hit is attached first; its blocks are
not transferred (`Reserved.skip_blocks`). A request whose KV is complete waits for a seat
(`max_num_seqs`) before it starts. An aborted request's reserved blocks are freed at once;
chunks still in flight for it are received and dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vllm_rlt.core.sched.execution_batch import SampledToken
from vllm_rlt.disagg import protocol as msg
from vllm_rlt.disagg.role import StreamingRole
from vllm_rlt.disagg.transport import KVReceiver
from vllm_rlt.engine.stats import EngineSnapshot
from vllm_rlt.request import Request


@dataclass
class _Import:
    expect: msg.Expect
    req: Request
    reserved: bool = False
    complete: bool = False  # the last chunk arrived
    first: SampledToken | None = None  # the first token, relayed from the prefill engine
    first_chunk_at: float | None = None
    num_chunks: int = 0  # KV chunks received
    num_bytes: int = 0  # their payloads' bytes


class DecodeRole(StreamingRole):
    def __init__(self, engine, place, conn, groups, via_host: bool):
        super().__init__(engine, place, conn)
        rank = place.rank
        peers = {p: g for (p, d), g in groups.items() if d == rank}
        handoff = engine.handoff
        self.receiver = KVReceiver(handoff.kv_cache, peers, handoff.num_planes, via_host)
        self.imports: dict[int, _Import] = {}
        self.to_reserve: deque[int] = deque()

    def num_waiting(self, snapshot: EngineSnapshot) -> int:
        return snapshot.num_waiting + len(self.imports)

    def handle(self, message) -> None:
        if isinstance(message, msg.Expect):
            self._expect(message)
        elif isinstance(message, msg.FirstToken):
            imp = self.imports.get(message.handle)
            if imp is not None:
                imp.first = message.token
        elif isinstance(message, msg.Abort):
            self._abort(message.handle)

    def _expect(self, expect: msg.Expect) -> None:
        try:
            req = self.engine.prefilled_request(
                expect.request_id, list(expect.prompt_token_ids), expect.params, expect.seed
            )
        except ValueError as err:
            self.conn.send(msg.Rejected(expect.handle, str(err), invalid=True))
            return
        self.imports[expect.handle] = _Import(expect, req)
        self.to_reserve.append(expect.handle)
        self.conn.send(msg.Accepted(expect.handle))

    def _abort(self, handle: int) -> None:
        imp = self.imports.pop(handle, None)
        if imp is not None:
            if imp.reserved:
                self.engine.handoff.release(imp.req.request_id)
            return
        self.abort_active(handle)

    def poll_links(self) -> None:
        self._reserve()
        for chunk in self.receiver.poll():
            imp = self.imports.get(chunk.handle)
            if imp is None:
                continue  # aborted meanwhile
            req_id = imp.req.request_id
            if chunk.num_blocks:
                end = chunk.first_block + chunk.num_blocks
                planes = self.engine.handoff.block_tables(req_id, chunk.first_block, end)
                self.receiver.write(chunk, planes)
            if imp.first_chunk_at is None:
                imp.first_chunk_at = chunk.arrived_at
            imp.num_chunks += 1
            if chunk.payload is not None:
                imp.num_bytes += chunk.payload.numel() * chunk.payload.element_size()
            if chunk.last:
                imp.complete = True
                self.conn.send(msg.KVArrived(chunk.handle))
        self._start()

    def _reserve(self) -> None:
        while self.to_reserve:
            imp = self.imports.get(self.to_reserve[0])
            if imp is None:
                self.to_reserve.popleft()
                continue
            skip = self.engine.handoff.reserve(imp.req)
            if skip is None:
                return
            self.to_reserve.popleft()
            imp.reserved = True
            self.conn.send(msg.Reserved(imp.expect.handle, skip))

    def _start(self) -> None:
        """Start decoding the requests whose KV and first token arrived, while seats allow."""
        for handle, imp in list(self.imports.items()):
            if not imp.complete or imp.first is None:
                continue
            if not self.engine.handoff.has_seat():
                return
            del self.imports[handle]
            self.conn.send(msg.Imported(handle, imp.first_chunk_at, imp.num_chunks, imp.num_bytes))
            self.active[imp.req.request_id] = handle
            self.after_step(self.engine.import_prefilled(imp.req, imp.first))
