"""Request: host-side state of one sequence (no tensors). Only the scheduler mutates it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vllm_rlt.sampling_params import SamplingParams


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # an error attributable to this request ended it (engine log)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class PrefillPiece:
    """Rows of one chunk that entered depth 0 together; they stay together through every depth."""

    token_start: int  # first prompt position
    num_tokens: int  # rows
    depth: int  # next depth to run (num_loops = all depths done)


@dataclass
class DecodeToken:
    """The newest token while it loops: its position and the exit policy's running state."""

    position: int  # the token's position
    index: int  # which decode position of the request (0 = the first output token's)
    loops_done: int = 0  # loops completed so far
    remaining: float = 1.0  # probability mass not yet exited, prod(1 - sigmoid(gate))
    exit_at: int | None = None  # delayed policies: the loop count at which to exit
    prefill_rows_ridden: int = 0  # prefill rows of the invocations it ran in so far


@dataclass
class SpecWindow:
    """A speculative window (docs/design/speculative.md): the newest sampled token at `start`
    and `num_drafts` drafted tokens after it. Each position runs the draft loops in turn (the
    draft token of the next position is sampled from that state); then all positions run the
    remaining loops together (verify), and the runner accepts a prefix of the drafts."""

    start: int  # position of the window's first token (the newest sampled one)
    index: int  # output index of that token (the sampler's counter)
    num_drafts: int  # drafted tokens (K of this window, >= 1)
    offset: int = 0  # position now drafting, from `start` (num_drafts + 1: verifying)
    loops_done: int = 0  # loops the current rows completed (verify: counted from the draft's)
    verified: bool = False  # verify done: the accepted tokens await read-back

    @property
    def verifying(self) -> bool:
        return self.offset > self.num_drafts

    @property
    def started(self) -> bool:
        """Whether its rows have run a loop (a window that has not is a fresh one)."""
        return self.offset > 0 or self.loops_done > 0  # (a verified one is past every offset)


@dataclass
class ExitSettings:
    min_loops: int  # resolved per request, 1 <= min_loops <= max_loops <= D
    max_loops: int
    threshold: float  # exit CDF threshold; 1.0 = fixed depth
    trace: tuple[int, ...] | None = None  # trace mode: loops of each decode position
    # loops every prompt position runs; None: the model's depth D (Ouro, whose prompts run
    # full depth). Huginn: max_loops, its reference's num_steps for the whole request
    prompt_loops: int | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    exit: ExitSettings
    seed: int  # the sampler seed (drawn by the engine when the request gave none)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # prefill progress (docs/design/architecture.md §5); after a preemption the prefill recomputes
    # the prompt and the positions of the first `resume_tokens` output tokens
    resume_tokens: int = 0
    num_prefilled_tokens: int = 0  # frontier: prompt positions that entered prefill
    prefill_reclaimable_tokens: int = 0  # start of the oldest resident chunk
    pieces: list[PrefillPiece] = field(default_factory=list)  # resident pieces, oldest first
    # decode progress
    decode: DecodeToken | None = None  # the token currently looping
    spec: SpecWindow | None = None  # speculative decoding: the window in flight (instead)
    ready_loops: int | None = None  # a state awaits the coda; it came from this many loops
    # tokens sampled on the device whose ids the host has not read yet (async scheduling reads
    # them one step later): their exit depths, oldest first
    pending_exit_depths: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_exit_depths: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs (of the first sample only): per prompt position, its token's
    # {token id: logprob} with the top alternatives (None for the first, or not yet scored)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, read back or not."""
        return len(self.output_token_ids) + len(self.pending_exit_depths)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_sampled

    @property
    def prefill_len(self) -> int:
        """Positions the current prefill covers (the prompt, and when resumed the fed-back output
        tokens before the newest one)."""
        return len(self.prompt_token_ids) + self.resume_tokens

    @property
    def in_prefill(self) -> bool:
        return self.prefill_reclaimable_tokens < self.prefill_len

    def prefill_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids[: self.resume_tokens]

    def prompt_loops(self, num_loops: int) -> int:
        """Loops each prompt position runs in a depth-`num_loops` model (`ExitSettings`)."""
        return self.exit.prompt_loops or num_loops

    def position_loops(self, position: int, num_loops: int) -> int:
        """Loops a prefill position runs: the prompt's (`prompt_loops`); for a recomputed output
        position, the loops it ran before (the exit depth of the token sampled from it)."""
        i = position - len(self.prompt_token_ids)
        return self.prompt_loops(num_loops) if i < 0 else self.output_exit_depths[i + 1]

    @property
    def max_positions(self) -> int:
        """Positions the request may write: the prompt and every fed-back output token."""
        return len(self.prompt_token_ids) + self.sampling_params.max_tokens - 1

    @property
    def is_last_sample(self) -> bool:
        """The next sampled token reaches max_tokens (it is never fed back)."""
        return self.num_sampled + 1 >= self.sampling_params.max_tokens
