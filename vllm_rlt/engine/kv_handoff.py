"""What prefill/decode disaggregation asks of an engine's KV (`LLMEngine.handoff`): on the
prefill side, which prompt blocks are complete and where they lie; on the decode side, blocks
reserved for an arriving prompt (less what its prefix cache holds), where the arriving blocks
go, and a seat to decode in. The roles of `vllm_rlt/disagg/` use this and nothing deeper."""

from __future__ import annotations

from vllm_rlt.core.kv_cache_manager import KVCacheManager, KVCapacityError
from vllm_rlt.core.sched.scheduler import Scheduler
from vllm_rlt.request import Request, RequestStatus
from vllm_rlt.worker.kv_cache import DeviceKVCache

# an import leaves 1 / this of the pool of the pool's blocks free for the requests already decoding
IMPORT_WATERMARK_DIVISOR = 100


class KVHandoff:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, kv_cache: DeviceKVCache):
        self._scheduler, self._kv = scheduler, kv
        self.kv_cache = kv_cache  # the device tensors the KV links read and write
        self.num_planes = kv.num_planes  # planes of every block table
        self.block_size = kv.block_size

    def completed_blocks(self, req_id: str) -> tuple[int, int] | None:
        """(blocks whose positions finished every depth, blocks of the whole prompt) of a
        running prefill; None while it waits or after a preemption (what was sent stays valid,
        the rest comes after its recompute)."""
        req = self._scheduler.requests.get(req_id)
        if req is None or req.status is not RequestStatus.RUNNING:
            return None
        prompt_len = req.num_prompt_tokens
        total = -(-prompt_len // self.block_size)
        done = min(req.prefill_reclaimable_tokens, prompt_len)
        return (total if done == prompt_len else done // self.block_size), total

    def block_tables(self, req_id: str, first: int, end: int) -> list[list[int]]:
        """Physical blocks first..end-1 of `req_id`, one list per plane."""
        return [list(self._kv.block_table(req_id, p)[first:end]) for p in range(self.num_planes)]

    def reserve(self, req: Request) -> int | None:
        """Blocks for every prompt position of an arriving `req` in every plane, starting from
        what the prefix cache holds of it; the whole blocks found there (the sender skips them),
        or None when the pool has no room now."""
        kv, n = self._kv, req.num_prompt_tokens
        hit = kv.find_prefix(req.prompt_token_ids, n - 1)
        watermark = kv.num_total_blocks // IMPORT_WATERMARK_DIVISOR
        if kv.blocks_for(n) - kv.blocks_for(hit.num_tokens) + watermark > kv.num_free_blocks:
            return None
        kv.attach(req.request_id, hit)
        try:
            kv.reserve(req.request_id, n)
        except KVCapacityError:  # cached blocks of the hit were among the free ones
            kv.free(req.request_id)
            return None
        return hit.num_tokens // self.block_size

    def release(self, req_id: str) -> None:
        """Free what `reserve` took for a request that will not be imported."""
        self._kv.free(req_id)

    def has_seat(self) -> bool:
        """Whether a request imported now would decode at once (max_num_seqs)."""
        return len(self._scheduler.running) < self._scheduler.config.max_num_seqs
