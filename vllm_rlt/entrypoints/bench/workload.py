"""Workload profiles: serial, concurrent, Poisson arrival with a concurrency cap.

Prompts are seeded random token ids; the output length is forced (ignore EOS) so every mode does
the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROFILES = ("serial", "concurrent", "arrival")


@dataclass(frozen=True)
class RequestSpec:
    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float  # offset from the benchmark start at which the request is sent


@dataclass(frozen=True)
class Workload:
    profile: str  # serial | concurrent | arrival
    concurrency: int  # requests in flight at most (serial: 1)
    requests: tuple[RequestSpec, ...]


def build_workload(
    profile: str,
    num_requests: int,
    input_lens: list[int],
    output_len: int,
    vocab_size: int,
    *,
    concurrency: int = 8,
    rate: float = 2.0,
    seed: int = 0,
    cycle: bool = False,
) -> Workload:
    """`input_lens`: one length (fixed) or several (uniform mix; `cycle`: request i gets
    `input_lens[i % len(input_lens)]`, e.g. every 10th prompt long). `rate`: requests per second
    for the arrival profile (exponential gaps); other profiles send everything at t=0 and let
    the concurrency cap pace them."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    counts = {"num_requests": num_requests, "concurrency": concurrency, "rate": rate}
    check_positive(input_lens=min(input_lens), output_len=output_len, **counts)
    rng = np.random.default_rng(seed)
    if cycle:
        lens = np.resize(np.asarray(input_lens), num_requests)
    else:
        lens = rng.choice(np.asarray(input_lens), size=num_requests)
    if profile == "arrival":
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    else:
        arrivals = np.zeros(num_requests)
    specs = tuple(
        RequestSpec(rng.integers(0, vocab_size, int(n)).tolist(), output_len, float(t))
        for n, t in zip(lens, arrivals, strict=True)
    )
    return Workload(profile, 1 if profile == "serial" else concurrency, specs)


def check_positive(**values: float) -> None:
    """ValueError naming the first of `values` that is not > 0."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
