"""Exit policies: after each loop of a decode token, stop or loop again
(docs/design/architecture.md §9).

Each policy sees the token's gate logit for the loop just run and updates the token's running
state. Gate arithmetic runs in Python floats (fp64) on the fp32 gate logits the runner returns.
`reads_gate` tells the scheduler whether the next loop's gate logit matters at all: when no row
of a step needs it (fixed depth, traces), the runner skips reading gates back and the host does
not wait for the GPU.
"""

from __future__ import annotations

import math
import zlib
from typing import Protocol

from vllm_rlt.request import DecodeToken, ExitSettings


class ExitPolicy(Protocol):
    name: str  # the exit_mode it implements (the device runs evaluate the same rule by name)

    def start(self, token: DecodeToken, settings: ExitSettings, request_id: str) -> None:
        """Called when a decode token enters depth 0."""
        ...

    def reads_gate(self, token: DecodeToken, settings: ExitSettings) -> bool:
        """Whether `should_exit` after the token's next loop needs that loop's gate logit."""
        ...

    def loops_to_decision(self, token: DecodeToken, settings: ExitSettings) -> int:
        """Loops the token runs before `should_exit` can answer True (1 when it reads gates):
        the scheduler may run that many loops without returning."""
        ...

    def should_exit(
        self, token: DecodeToken, settings: ExitSettings, gate_logit: float | None
    ) -> bool:
        """Called once the token completed `token.loops_done` loops (already incremented);
        `gate_logit` is None when `reads_gate` said it is not needed."""
        ...

    def fixed_loops(self, settings: ExitSettings) -> int | None:
        """The loops every token of a request with `settings` runs, or None when they vary
        (gates, traces)."""
        ...


def _fires(token: DecodeToken, settings: ExitSettings, gate_logit: float) -> bool:
    """Ouro's Q-exit rule: the exit CDF 1 - prod(1 - sigmoid(g_r)) reaches the threshold."""
    token.remaining *= 1.0 - _sigmoid(gate_logit)
    if settings.threshold >= 1.0 or token.loops_done < settings.min_loops:
        return False
    return 1.0 - token.remaining >= settings.threshold


class OuroExit:
    """Exit at max_loops, or once the CDF reaches the threshold after at least min_loops."""

    name = "ouro"

    def start(self, token: DecodeToken, settings: ExitSettings, request_id: str) -> None:
        pass

    def reads_gate(self, token: DecodeToken, settings: ExitSettings) -> bool:
        return settings.threshold < 1.0  # the CDF accumulates from the first loop on

    def last_loop(self, token: DecodeToken, settings: ExitSettings) -> int:
        """The loop count at which the token exits unless a gate decides earlier."""
        return settings.max_loops

    def loops_to_decision(self, token: DecodeToken, settings: ExitSettings) -> int:
        if self.reads_gate(token, settings):
            return 1
        return max(self.last_loop(token, settings) - token.loops_done, 1)

    def should_exit(
        self, token: DecodeToken, settings: ExitSettings, gate_logit: float | None
    ) -> bool:
        fired = gate_logit is not None and _fires(token, settings, gate_logit)
        return fired or token.loops_done >= self.last_loop(token, settings)

    def fixed_loops(self, settings: ExitSettings) -> int | None:
        return settings.max_loops if settings.threshold >= 1.0 else None


class OuroDelayedExit(OuroExit):
    """Like `ouro`, but the token runs one more loop after the rule fires (within max_loops)."""

    name = "ouro_delayed"

    def reads_gate(self, token: DecodeToken, settings: ExitSettings) -> bool:
        return token.exit_at is None and settings.threshold < 1.0

    def last_loop(self, token: DecodeToken, settings: ExitSettings) -> int:
        return settings.max_loops if token.exit_at is None else token.exit_at

    def should_exit(
        self, token: DecodeToken, settings: ExitSettings, gate_logit: float | None
    ) -> bool:
        pending = token.exit_at is None and gate_logit is not None
        if pending and _fires(token, settings, gate_logit):
            token.exit_at = min(token.loops_done + 1, settings.max_loops)
        return token.loops_done >= self.last_loop(token, settings)


class TraceExit:
    """Replay given loop counts: `settings.trace[i]` for decode position i (clamped to the
    request's loop bounds); positions past the trace, or without one, draw from `seed`."""

    name = "trace"

    def __init__(self, seed: int | None):
        self.seed = seed

    def start(self, token: DecodeToken, settings: ExitSettings, request_id: str) -> None:
        if settings.trace is not None and token.index < len(settings.trace):
            loops = settings.trace[token.index]
        elif self.seed is not None:
            span = settings.max_loops - settings.min_loops + 1
            key = zlib.crc32(request_id.encode())
            loops = settings.min_loops + _mix(self.seed, key, token.index) % span
        else:
            loops = settings.max_loops
        token.exit_at = min(max(loops, settings.min_loops), settings.max_loops)

    def reads_gate(self, token: DecodeToken, settings: ExitSettings) -> bool:
        return False

    def loops_to_decision(self, token: DecodeToken, settings: ExitSettings) -> int:
        return max(token.exit_at - token.loops_done, 1)

    def should_exit(
        self, token: DecodeToken, settings: ExitSettings, gate_logit: float | None
    ) -> bool:
        return token.loops_done >= token.exit_at

    def fixed_loops(self, settings: ExitSettings) -> int | None:
        return settings.max_loops if settings.min_loops == settings.max_loops else None


def make_exit_policy(mode: str, trace_seed: int | None) -> ExitPolicy:
    if mode == "ouro":
        return OuroExit()
    if mode == "ouro_delayed":
        return OuroDelayedExit()
    if mode == "trace":
        return TraceExit(trace_seed)
    raise ValueError(f"exit_mode must be one of ouro, ouro_delayed, trace; got {mode!r}")


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def _mix(*values: int) -> int:
    """A small deterministic integer hash (stable across processes)."""
    h = 0x9E3779B9
    for v in values:
        h = ((h ^ (v & 0xFFFFFFFF)) * 0x85EBCA6B + 0xC2B2AE35) & 0xFFFFFFFF
        h ^= h >> 15
    return h
