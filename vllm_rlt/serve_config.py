"""Settings of `vllm-rlt serve` beyond one engine's (`vllm_rlt.config`): prefill/decode
disaggregation, data-parallel replicas."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.config_fields import check, check_choices_and_types, field_help

PD_TRANSPORTS = ("auto", "gloo", "nccl")
AUTHKEY_ENV = "VLLM_RLT_PD_AUTHKEY"  # the secret that front end and remote engines share


@dataclass(frozen=True)
class DisaggConfig:
    """Engine processes behind one front end (`vllm-rlt serve` only): prefill/decode
    disaggregation (docs/design/disaggregation.md) or data-parallel replicas."""

    data_parallel_size: int = field_help(
        "full engines (one process each, prefill and decode of their requests, each its own KV "
        "cache) behind one front end, each request served wholly by the least-loaded one "
        "(1: one engine in the server's process)",
        default=1,
    )

    pd_prefill: int = field_help(
        "prefill engines (one process each) of a disaggregated server; with pd_decode, the "
        "server runs pd_prefill + pd_decode engine processes behind one front end (0: one "
        "engine does both)",
        default=0,
    )
    pd_decode: int = field_help(
        "decode engines (one process each) of a disaggregated server", default=0
    )
    pd_transport: str = field_help(
        "torch.distributed backend of the KV transfers: nccl between GPUs (each engine on its "
        "own GPU), gloo otherwise (CUDA KV then passes through host memory); auto picks",
        choices=PD_TRANSPORTS,
        default="auto",
    )
    pd_master_addr: str = field_help(
        "rendezvous address of the engines' process group (torch.distributed MASTER_ADDR)",
        default="127.0.0.1",
    )
    pd_master_port: int = field_help(
        "rendezvous port of the engines' process group (MASTER_PORT; 0: a free port)", default=0
    )

    pd_remote_prefill: int = field_help(
        "of the pd_prefill engines, how many run on other hosts (the last ones by rank), each "
        "started there with `vllm-rlt pd-engine`; prefill engine 0 always runs here",
        default=0,
    )
    pd_remote_decode: int = field_help(
        "of the pd_decode engines, how many run on other hosts (the last ones by rank)",
        default=0,
    )
    pd_control_port: int = field_help(
        "port on pd_master_addr where the front end waits for its remote engines to connect "
        "(needed with remote engines; their control messages use it, authenticated by the "
        f"secret in ${AUTHKEY_ENV})",
        default=0,
    )

    def __post_init__(self) -> None:
        check_choices_and_types(self)
        p, d = self.pd_prefill, self.pd_decode
        dp = self.data_parallel_size
        check(dp >= 1, "data_parallel_size", dp, ">= 1")
        want = "1 when pd_prefill or pd_decode is set (replicas or disaggregation, not both)"
        check(dp == 1 or p == d == 0, "data_parallel_size", dp, want)
        check(p >= 0 and d >= 0, "pd_prefill and pd_decode", (p, d), ">= 0")
        check((p == 0) == (d == 0), "pd_prefill and pd_decode", (p, d), "both 0 or both >= 1")
        for name in ("pd_master_port", "pd_control_port"):
            port = getattr(self, name)
            check(0 <= port <= 65535, name, port, "in 0..65535")
        rp, rd = self.pd_remote_prefill, self.pd_remote_decode
        check(0 <= rp < max(p, 1), "pd_remote_prefill", rp, f"in 0..pd_prefill - 1 ({p - 1})")
        check(0 <= rd <= d, "pd_remote_decode", rd, f"in 0..pd_decode ({d})")
        if rp or rd:
            port = self.pd_control_port
            check(port > 0, "pd_control_port", port, ">= 1 when engines run on other hosts")

    def is_remote(self, rank: int) -> bool:
        """Whether PD engine `rank` (prefill engines first) runs on another host (a replica
        never does)."""
        if not self.enabled:
            return False
        if rank < self.pd_prefill:
            return rank >= self.pd_prefill - self.pd_remote_prefill
        return rank >= self.pd_prefill + self.pd_decode - self.pd_remote_decode

    @property
    def enabled(self) -> bool:
        return self.pd_prefill > 0


SERVE_SECTIONS = {"disagg": DisaggConfig}  # settings of `vllm-rlt serve`, not of one engine
