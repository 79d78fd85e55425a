"""The plan the scheduler hands the runner each step: plain frozen data, no torch.

A step runs, in order: the skipped-depth KV copies, the coda + sampling of `sample_req_ids`,
then `loop_count` recurrent-core invocations over `requests`, each after the draft samples of
speculative windows (`drafts`) due before it, then the acceptance of the windows verified
(`verifies`). Each invocation advances every live row one depth; a prefill task's rows drop out
after their last depth (D-1, or the task's `loops` - 1), a task of a wavefront step of several
invocations runs in its own invocation only (`ScheduledRequest.invocation`), and a drafting
window's row moves to the window's next position at depth 0 after each position's draft loops,
and after the last one's to the verify rows of every position (`ExecutionBatch.live`). Decode
and window rows run every invocation of their batch: the scheduler gives a batch with such rows
more than one loop only when none of them reaches a decision before the last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum


class RowKind(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    SPEC = "spec"  # rows of a speculative window (draft or verify, docs/design/speculative.md)


@dataclass(frozen=True)
class ScheduledRequest:
    """One contiguous row range of one request at one depth (a task). A request may appear
    several times in one batch (several tasks at different depths)."""

    request_id: str  # the request the rows belong to
    kind: RowKind  # PREFILL (prompt positions) or DECODE (the request's newest token)
    token_start: int  # position of the first row
    num_tokens: int  # rows (consecutive positions)
    depth: int  # 0-based depth of the rows in the first invocation (0 = enter via the prelude)
    # row offset into the request's prefill hidden-state ring (slot * chunk_size + offset in
    # the chunk); None = the runner derives it from token_start on the chunk grid. SPEC rows:
    # the window offset of token_start (the window's rows live at the start of the ring)
    prefill_hidden_row_offset: int | None = None
    # decode rows: the exit policy needs this loop's gate logit (the runner reads it back)
    reads_gate: bool = False
    # a drafting window's row: the draft loops of each position (d); after them the row moves
    # on to the next position at depth 0 within the step. 0: the rows keep their positions
    draft_loops: int = 0
    # a drafting window's positions (K + 1): after the last one's draft loops its row becomes
    # the window's verify rows, every position from depth d on, within the step
    window_rows: int = 0
    # prefill rows: the loops they run in all, after which they drop out (0: the model's depth
    # D; a Huginn request's prompt runs its max_loops)
    loops: int = 0
    # a task of a wavefront step of several invocations (docs/design/wcpb.md §2): it runs one
    # loop, at `depth`, in this invocation of the batch only (-1: from the first invocation on,
    # one depth further in each)
    invocation: int = -1

    @property
    def most_rows(self) -> int:
        """The most rows the task has in one invocation (a drafting row: its verify rows)."""
        return max(self.num_tokens, self.window_rows)

    def at(self, invocation: int) -> ScheduledRequest:
        """A drafting row as it runs in invocation `invocation` (0-based) of its batch:
        `(depth + invocation) // draft_loops` positions (and ring rows) further, at depth
        `(depth + invocation) % draft_loops`; past the window's last position, its verify rows."""
        moved, depth = divmod(self.depth + invocation, self.draft_loops)
        offset = self.prefill_hidden_row_offset + moved
        if offset < self.window_rows:
            return replace(
                self, token_start=self.token_start + moved, depth=depth,
                prefill_hidden_row_offset=offset,
            )  # fmt: skip
        verify_loops = (offset - self.window_rows) * self.draft_loops + depth
        return replace(
            self,
            token_start=self.token_start - self.prefill_hidden_row_offset,
            num_tokens=self.window_rows,
            depth=self.draft_loops + verify_loops,
            prefill_hidden_row_offset=0,
            draft_loops=0,
            window_rows=0,
        )

    def state_span(self) -> StateSpan:
        """Where these rows' hidden state lives (decode rows: the request's decode row)."""
        offset = self.prefill_hidden_row_offset if self.kind is not RowKind.DECODE else None
        return StateSpan(self.request_id, self.token_start, self.num_tokens, offset)


@dataclass(frozen=True)
class StateSpan:
    """Where a row range's hidden state lives: the runner's gather/scatter unit."""

    request_id: str  # owner of the rows
    token_start: int  # first position
    num_tokens: int  # rows
    # ring row of token_start for prompt rows and speculative windows (the prefill planner's
    # `row_offset`, the one place the ring's geometry is computed); None: a decode row, which
    # lives in the request's decode row
    prefill_hidden_row_offset: int | None


@dataclass(frozen=True)
class NewRequestData:
    """What the runner mirrors about a request it has not seen before."""

    request_id: str  # id used by every later plan
    prompt_token_ids: tuple[int, ...]  # the prompt (prefill rows take their tokens from here)
    ring_slots: int  # chunks the request's prefill hidden-state ring holds (1 or depth D)
    chunk_size: int  # rows per ring slot
    temperature: float  # sampling settings, as in SamplingParams
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off
    min_p: float  # 0 = off
    seed: int  # always set: the scheduler draws one for unseeded requests
    num_logprobs: int  # top alternatives to return per token; -1 = none
    num_prompt_logprobs: int  # the same for the prompt's tokens (scored at full depth); -1 = none
    init_scale: float  # scale of a random initial recurrent state (Huginn); 0 = zero state
    # a resumed request (preempted, now recomputing): the newest token sampled before, which its
    # first decode row takes (prompt_token_ids then holds the prompt and the output tokens fed
    # back before it)
    resume_token: int | None = None
    # loops each fed-back output position runs (they follow the prompt in prompt_token_ids)
    resumed_loops: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] | None = None  # as in SamplingParams
    presence_penalty: float = 0.0  # penalties, as in SamplingParams (off: 0, 0, 1)
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class DraftSample:
    """A draft token sampled before an invocation of a step: the coda of a window position's
    state after the draft loops gives the token of the next position, which enters at depth 0
    in that invocation (docs/design/speculative.md)."""

    request_id: str  # the window's request
    offset: int  # window offset of the drafted token (1..num_drafts); from offset - 1's state
    index: int  # output index the token would take (the sampler's counter)
    invocation: int = 0  # taken before this invocation of the step (0: after the samples)


@dataclass(frozen=True)
class VerifySample:
    """A window whose verify loops end in this step: after the invocations, the coda of its
    positions' final states accepts a prefix of the drafts plus one token of the target."""

    request_id: str  # the window's request
    num_drafts: int  # drafted tokens (window rows: num_drafts + 1)
    index: int  # output index of the first drafted token (the window's first token's + 1)


@dataclass(frozen=True)
class RunRow:
    """What the device needs of one decode row of a device run (`DecodeRun`) to decide its
    token's exit after every loop, sample the next token and feed it back on its own."""

    loops_done: int  # loops the row's token completed (0: it enters at the first invocation)
    remaining: float  # the exit rule's running product of (1 - sigmoid(gate)) so far
    exit_at: int  # the loop count it exits at: trace, or ouro_delayed once fired (0: not set)
    position: int  # the token's position
    num_sampled: int  # output tokens sampled so far: the next sample's output index
    max_tokens: int  # the request's max_tokens: the row samples no further
    min_loops: int  # the request's exit settings
    max_loops: int
    threshold: float
    stop_token_ids: tuple[int, ...]  # a sampled one ends the row (EOS unless ignored, stop ids)
    # trace mode: exit loops of the tokens of output index num_sampled, num_sampled + 1, ...
    trace: tuple[int, ...] = ()
    speculates: bool = False  # it drafts in a run with lanes (greedy, no logprobs)


@dataclass(frozen=True)
class DecodeRun:
    """Decode rows that cross token boundaries on the device for a whole step
    (docs/design/runner.md §7): before every invocation the rows whose token exited are sampled
    (coda and sampler) and their next token enters at depth 0; after it every row's exit rule
    runs on its gate, and an exit fills its skipped KV planes. The host reads the tokens back
    once, after the step (`RunRowResult`). The run's rows are the batch's first tasks; prefill
    tasks after them (a run beside prefill) run as in any batch, the run's rows riding their
    invocations."""

    exit_mode: str  # ouro, ouro_delayed or trace (make_exit_policy's modes)
    rows: tuple[RunRow, ...]  # one per decode task of the batch (its first tasks), in plan order
    # loop_count + 1 entries: whether a row may have exited before invocation i (the last entry:
    # after the last invocation); the coda and sampler run only there
    sample_at: tuple[bool, ...]
    # the rows are the last run's, in its order, and go on from the state it leaves on the
    # device (planned before the host read it back): the device takes only their block tables,
    # `num_sampled` and `trace` (counted from it: the tokens of both runs)
    carried: bool = False
    # a carried run: its last `joined` rows are not the last run's but start here, loaded as a
    # fresh run's (requests whose prompt the last run rode to its end)
    joined: int = 0
    # speculation with the exit gate (docs/design/speculative.md §3): each row has `lanes`
    # device rows, one per position in flight (1: no speculation); a lane whose token ran
    # `draft_loops` loops drafts the next position's token, verified when the token exits
    lanes: int = 1
    draft_loops: int = 0


@dataclass(frozen=True)
class ExecutionBatch:
    requests: tuple[ScheduledRequest, ...]  # tasks of the first invocation
    loop_count: int  # invocations before control returns to the scheduler
    new_requests: tuple[NewRequestData, ...] = ()  # requests the runner sees first here
    # (request_id, per-plane block tables) for requests whose tables changed
    block_tables: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    kv_copies: tuple[tuple[int, int], ...] = ()  # (src, dst) flat slots, all layers, K and V
    # requests whose next token is sampled at the start of this step (coda of their state);
    # a DECODE row at depth 0 of such a request takes that token
    sample_req_ids: tuple[str, ...] = ()
    sample_indices: tuple[int, ...] = ()  # output index of each sample (the sampler's counter)
    drafts: tuple[DraftSample, ...] = ()  # draft tokens, each before its invocation
    verifies: tuple[VerifySample, ...] = ()  # windows accepted after the invocations
    finished_req_ids: tuple[str, ...] = ()  # requests the runner forgets before this step
    decode_run: DecodeRun | None = None  # a device run over the decode tasks, loop_count long

    @property
    def num_rows(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def live(self, invocation: int, num_loops: int) -> tuple[tuple[ScheduledRequest, int], ...]:
        """(task, depth) of the tasks with rows in invocation `invocation` (0-based) of a
        depth-`num_loops` model: every task at `depth + invocation` until its final depth
        (decode rows never get that far in one batch); a task of a wavefront step in its own
        invocation; a drafting row moved on to the position it runs there
        (`ScheduledRequest.at`); a device run's rows in every invocation, at the depth they were
        planned at (the device knows the rest)."""
        riders = len(self.decode_run.rows) if self.decode_run is not None else 0
        rows = [(t, t.depth) for t in self.requests[:riders]]
        for t in self.requests[riders:]:
            if t.invocation >= 0:
                if t.invocation == invocation:
                    rows.append((t, t.depth))
            elif t.draft_loops:
                t = t.at(invocation)
                rows.append((t, t.depth))
            elif t.depth + invocation < (t.loops or num_loops):
                rows.append((t, t.depth + invocation))
        return tuple(rows)


@dataclass(frozen=True)
class SampledToken:
    token_id: int  # the sampled token
    logprob: float | None  # its logprob under the raw model distribution (None if not asked)
    top_logprobs: tuple[tuple[int, float], ...]  # (token id, logprob) best first

    def logprobs(self) -> dict[int, float]:
        """{token id: logprob} of this token and its top alternatives (as outputs report)."""
        return {self.token_id: self.logprob, **dict(self.top_logprobs)}


@dataclass(frozen=True)
class RunRowResult:
    """What a device run did with one row (host data): the tokens it sampled, each with the
    loops of the token whose exit sampled it, and where the row's newest token stands."""

    sampled: tuple[tuple[SampledToken, int], ...]  # (token, exit depth) oldest first
    loops_done: int  # the newest token's loops (or, `ready`, the loops it exited after)
    remaining: float  # its exit rule's running product
    exit_at: int  # 0: not set
    ready: bool  # it exited and waits for the coda (the next step samples it)
    # a run with lanes: its drafts, the drafts accepted, the tokens it took while drafting
    spec_counts: tuple[int, int, int] = (0, 0, 0)


def split_kinds(tasks) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """(decode and window tasks, prefill tasks) of `tasks`, in order."""
    decode = [t for t in tasks if t.kind is not RowKind.PREFILL]
    return decode, [t for t in tasks if t.kind is RowKind.PREFILL]


def by_request(tasks, kind: RowKind | None = None) -> dict[str, list[ScheduledRequest]]:
    """`tasks` (of `kind`, or all) grouped by request, in order."""
    out: dict[str, list[ScheduledRequest]] = {}
    for t in tasks:
        if kind is None or t.kind is kind:
            out.setdefault(t.request_id, []).append(t)
    return out


@dataclass(frozen=True)
class StepOutput:
    """The runner's answer to a plan (`ModelRunner.execute`), the only one: what the host has at
    launch, and callables that wait for the rest. The scheduler takes it in `Scheduler.update`
    right after the launch, and calls the callables when their results are due (this step, or
    with async scheduling the next; a device run's before the next plan, or once the run that
    goes on from it is queued)."""

    # gate logits of the decode rows that `reads_gate` (of their single invocation), in plan
    # order: read at launch, because the next plan needs their exit decisions
    decode_gate_logits: tuple[float, ...]
    # waits for the samples taken at the step's start and its verified windows: request_id ->
    # its sampled token; a window verified in it (its VerifySample) -> the accepted tokens (a
    # request may have both: its first token opens a window verified at once)
    read_tokens: Callable[[], dict[str | VerifySample, SampledToken | tuple[SampledToken, ...]]]
    # waits for a device run's tokens and final row states, one per task (None: no run)
    read_run: Callable[[], tuple[RunRowResult, ...]] | None = None
    # waits for the prompt tokens scored in the step (`SamplingParams.prompt_logprobs`):
    # request_id -> (position, the prompt's token there with its logprobs)
    read_prompt_logprobs: Callable[[], dict[str, list[tuple[int, SampledToken]]]] = dict
