"""Control messages between the front end and the engine processes (over multiprocessing
pipes, or authenticated sockets for engines on other hosts; KV blocks travel over
torch.distributed, `transport.py`). Plain frozen data.

A request's life: front end -> decode `Expect`; decode -> `Accepted` (or `Rejected`), and once
its blocks are reserved `Reserved`; front end -> prefill `Prefill`; prefill -> decode KV chunks
(transport); prefill -> front end `FirstToken`, relayed to the decode engine; decode ->
`Outputs` as tokens come. `Abort` ends a request on either side.

A data-parallel replica's request: front end -> replica `Generate`; replica -> `Accepted` (or
`Rejected`), then `Outputs` as tokens come.

An engine on another host connects first: remote engine -> front end `Join`; front end ->
remote engine `Assign`; then, as for every engine, `Ready` (or `StartFailed`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.core.sched.execution_batch import SampledToken
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams


@dataclass(frozen=True)
class Expect:
    """front end -> decode: validate a request and reserve blocks for its prompt."""

    handle: int  # the request's number on the KV links
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # the sampler seed both engines use
    prefill_rank: int  # the engine that prefills it


@dataclass(frozen=True)
class Generate:
    """front end -> replica: validate a request and run it to the end."""

    handle: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Accepted:
    """decode or replica -> front end: the request is valid (a decode engine's reservation may
    still wait for blocks)."""

    handle: int


@dataclass(frozen=True)
class Rejected:
    """engine -> front end: the request is invalid or failed; `message` says why."""

    handle: int
    message: str
    invalid: bool  # True: bad input (a 400), False: a failure while serving it


@dataclass(frozen=True)
class Reserved:
    """decode -> front end: blocks for the whole prompt are reserved; the first `skip_blocks`
    logical blocks came from the decode engine's prefix cache and need no transfer."""

    handle: int
    skip_blocks: int


@dataclass(frozen=True)
class Prefill:
    """front end -> prefill: run the prompt, send its blocks to `decode_rank` as chunks
    complete, and report the first token."""

    handle: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # max_tokens=1, the seed set
    decode_rank: int
    skip_blocks: int


@dataclass(frozen=True)
class FirstToken:
    """prefill -> front end -> decode: the first token, sampled after the last chunk was sent."""

    handle: int
    token: SampledToken
    prefill_done_at: float  # time.monotonic() when the last chunk finished its final depth


@dataclass(frozen=True)
class KVArrived:
    """decode -> front end: the request's last KV chunk arrived (its prefill engine may go)."""

    handle: int


@dataclass(frozen=True)
class Imported:
    """decode -> front end: the request decodes; when its first KV chunk arrived."""

    handle: int
    first_chunk_at: float  # time.monotonic() (one clock for every process of the host)
    num_chunks: int  # KV chunks received for it
    num_bytes: int  # their KV payloads' bytes


@dataclass(frozen=True)
class Outputs:
    """decode or replica -> front end: outputs of the last step, by handle."""

    items: tuple[tuple[int, RequestOutput], ...]


@dataclass(frozen=True)
class Abort:
    """front end -> engine: drop a request (its blocks are freed)."""

    handle: int


@dataclass(frozen=True)
class PeerDead:
    """front end -> prefill: the decode engine of `rank` died; drop its requests, send it no
    more KV."""

    rank: int


@dataclass(frozen=True)
class Status:
    """engine -> front end: gauges (sent when they change, at most every STATUS_INTERVAL_S;
    `Probe` asks for one at once)."""

    rank: int
    num_running: int
    num_waiting: int  # requests waiting for admission or for their blocks / KV
    num_free_blocks: int
    num_total_blocks: int


@dataclass(frozen=True)
class Probe:
    """front end -> engine: send a Status now."""


@dataclass(frozen=True)
class Ready:
    """engine -> front end: the engine loaded and joined the process group."""

    rank: int
    max_model_len: int
    num_loops: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    """engine -> front end: the engine could not start."""

    rank: int
    message: str


@dataclass(frozen=True)
class Shutdown:
    """front end -> engine: stop."""


@dataclass(frozen=True)
class Join:
    """remote engine -> front end, first over its control connection: which engine it is."""

    rank: int
    host: str


@dataclass(frozen=True)
class Assign:
    """front end -> remote engine: what to run (then the engine answers Ready or StartFailed).
    `place` is a role.Placement, `config` an EngineConfig, `disagg` a DisaggConfig."""

    place: object
    config: object
    disagg: object
