"""KV cache sizing at start: explicit settings override, the CPU default scales with the host's
available memory, on CUDA the KV cache gets what gpu_memory_utilization leaves (the arithmetic
with a given measurement on the CPU, the measurement itself on the GPU), and the start log line
gives blocks, positions per plane and the maximum concurrency; the engine's own start line its
scheduling, CUDA graphs and exit settings."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import write_tiny_huginn
from vllm_rlt.config import CacheConfig, ConfigError
from vllm_rlt.engine import kv_sizing
from vllm_rlt.engine.kv_sizing import GIB, plan_kv_blocks, resolve_max_model_len
from vllm_rlt.entrypoints.llm import LLM
from vllm_rlt.models.loader import read_config
from vllm_rlt.models.tiny import default_model_dir
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.worker import memory_profile
from vllm_rlt.worker.memory_profile import DeviceMemory

# the packaged model: 1 layer, 8 KV heads of 48, 4 loops; fp32 blocks of 16 positions
CONFIG = read_config(default_model_dir())
BLOCK_BYTES = 1 * 2 * 16 * 8 * 48 * 4
CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def _no_measure() -> DeviceMemory:
    raise AssertionError("an explicit size must not profile the device")


def _plan(device=CPU, measure=_no_measure, **cache):
    return plan_kv_blocks(CacheConfig(**cache), CONFIG, 4, torch.float32, device, measure)


@pytest.fixture
def gpu_free(monkeypatch):
    """torch.cuda.mem_get_info on a machine without one: 80 GiB total, 70 free."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))


@pytest.fixture
def meminfo(monkeypatch, tmp_path):
    """Sets the host's MemAvailable (in GiB) that the sizing reads."""

    def set_available(gib: float) -> None:
        path = tmp_path / "meminfo"
        path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {int(gib * 2**20)} kB\n")
        monkeypatch.setattr(kv_sizing, "MEMINFO", str(path))

    return set_available


# ---- explicit settings -----------------------------------------------------------------------
@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_num_kv_blocks_and_kv_cache_memory_gb_override(device, gpu_free, meminfo):
    meminfo(2.0)
    assert _plan(device, num_kv_blocks=64).num_blocks == 64
    blocks = _plan(device, kv_cache_memory_gb=0.5, gpu_memory_utilization=0.3)
    assert blocks.num_blocks == GIB // 2 // BLOCK_BYTES
    assert blocks.setting == "kv_cache_memory_gb=0.5" and blocks.name == "kv_cache_memory_gb"
    both = _plan(device, num_kv_blocks=8, kv_cache_memory_gb=0.5)
    assert both.num_blocks == 8 and both.name == "num_kv_blocks"


# ---- the CPU default -------------------------------------------------------------------------
def test_the_cpu_default_is_a_tenth_of_available_memory_capped(meminfo):
    meminfo(2.0)  # a tenth: 0.2 GiB
    small = _plan()
    assert small.num_blocks == int(0.2 * GIB) // BLOCK_BYTES
    assert small.setting == "kv_cache_memory_gb=0.20 by default"
    meminfo(4.0)
    assert _plan().num_blocks == int(0.4 * GIB) // BLOCK_BYTES
    meminfo(64.0)  # a tenth would be 6.4 GiB: capped
    assert _plan().num_blocks == kv_sizing.CPU_KV_CAP_BYTES // BLOCK_BYTES
    meminfo(0.0005)  # too little for a block in every plane
    with pytest.raises(ConfigError, match="too few for one request.*raise kv_cache_memory_gb"):
        _plan()


def test_an_engine_on_the_cpu_takes_the_default_and_logs_it(meminfo, caplog):
    meminfo(0.5)
    with caplog.at_level(logging.INFO, logger="vllm_rlt.engine.kv_sizing"):
        llm = LLM(device="cpu", max_model_len=512)
    num_blocks = int(0.05 * GIB) // BLOCK_BYTES  # 1092 blocks: 273 per plane
    assert llm.engine.kv_manager.num_total_blocks == num_blocks
    line = (
        f"KV cache: {num_blocks} blocks (kv_cache_memory_gb=0.05 by default), 4368 positions "
        "per plane x 4 planes; maximum concurrency for 512 tokens per request: 8.53x"
    )
    assert line in caplog.messages


def test_the_start_log_line_with_explicit_blocks(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_rlt.engine.kv_sizing"):
        LLM(device="cpu", num_kv_blocks=64, max_model_len=64)
        LLM(device="cpu", num_kv_blocks=64)  # max_model_len: what one request can hold
    assert [m for m in caplog.messages if m.startswith("KV cache:")] == [
        "KV cache: 64 blocks (num_kv_blocks=64), 256 positions per plane x 4 planes; maximum "
        f"concurrency for {n} tokens per request: {x}"
        for n, x in ((64, "4.00x"), (257, "1.00x"))
    ]


def test_the_start_log_line_of_the_engine_settings(caplog):
    with caplog.at_level(logging.INFO, logger="vllm_rlt.engine.llm_engine"):
        LLM(device="cpu", num_kv_blocks=64)
        LLM(device="cpu", num_kv_blocks=64, wavefront_chunked_prefill=True, prefill_chunk_size=32,
            max_num_seqs=4, device_decode_loops=0, exit_threshold=1.0)  # fmt: skip
    assert [m for m in caplog.messages if m.startswith("engine:")] == [
        "engine: mixed scheduling, WCPB off, chunk 1024, budget 1024 tokens, 8 sequences; CUDA "
        "graphs off; exits ouro at threshold 0.6, device runs of up to 16 invocations; native "
        "kernels off (no CUDA device)",
        "engine: mixed scheduling, WCPB on, chunk 32, budget 1024 tokens, 4 sequences; CUDA "
        "graphs off; exits ouro at threshold 1.0, decided on the host; native kernels off (no "
        "CUDA device)",
    ]


# ---- gpu_memory_utilization --------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, 2])
def test_gpu_memory_utilization_must_be_in_0_1(value):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(device="cpu", gpu_memory_utilization=value)
    with pytest.raises(ConfigError, match="gpu_memory_utilization must be float"):
        CacheConfig(gpu_memory_utilization="0.5")
    assert CacheConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


MEASURED = DeviceMemory(80 * GIB, 10 * GIB, 2 * GIB, GIB)  # total, in use, activations, graphs


def test_cuda_kv_gets_what_gpu_memory_utilization_leaves(gpu_free):
    calls = []

    def measure() -> DeviceMemory:
        calls.append(1)
        return MEASURED

    blocks = _plan(CUDA, measure)
    assert calls == [1]
    assert blocks.num_blocks == (72 - 10 - 2 - 1) * GIB // BLOCK_BYTES  # 0.9 x 80 GiB - the rest
    assert blocks.setting == "gpu_memory_utilization=0.9"
    half = _plan(CUDA, lambda: MEASURED, gpu_memory_utilization=0.5)
    assert half.num_blocks == (40 - 13) * GIB // BLOCK_BYTES


def test_cuda_without_room_for_kv_names_gpu_memory_utilization_and_the_numbers(gpu_free):
    with pytest.raises(ConfigError) as info:
        _plan(CUDA, lambda: MEASURED, gpu_memory_utilization=0.15)  # 12 GiB < 13 GiB
    message = str(info.value)
    assert message.startswith("gpu_memory_utilization=0.15 leaves no memory for the KV cache")
    for part in ("0.15 x 80.00 GiB = 12.00 GiB", "in use", "10.00 GiB", "activation peak 2.00",
                 "CUDA graphs 1.00 GiB", "raise gpu_memory_utilization"):  # fmt: skip
        assert part in message
    tight = DeviceMemory(80 * GIB, 10 * GIB, GIB, GIB - 1000)  # 1000 bytes for the KV cache
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.15 gives 0 KV blocks"):
        _plan(CUDA, lambda: tight, gpu_memory_utilization=0.15)


def test_a_max_model_len_the_measured_cache_cannot_hold_names_gpu_memory_utilization(gpu_free):
    one_gib = DeviceMemory(80 * GIB, 10 * GIB, 2 * GIB, 59 * GIB)  # 1 GiB left for the KV cache
    blocks = _plan(CUDA, lambda: one_gib)
    positions = blocks.num_blocks // 4 * 16
    with pytest.raises(ConfigError) as info:
        resolve_max_model_len(10**6, 10**7, positions, blocks)
    message = str(info.value)
    assert "gpu_memory_utilization=0.9" in message and f"at most {positions}" in message
    assert "raise gpu_memory_utilization or lower max_model_len" in message


# ---- the measurement ---------------------------------------------------------------------------
@pytest.mark.parametrize("huginn", [False, True], ids=["ouro", "huginn"])
def test_the_activation_profile_runs_the_largest_invocation(monkeypatch, tmp_path, huginn):
    """On the CPU with torch.cuda's counters faked: the profile runs prelude, recurrent core,
    coda and sampling over the sizes it is given, and reports the allocator's peak above its
    reserve plus what stayed in use outside it."""
    model_dir = str(write_tiny_huginn(tmp_path / "h")) if huginn else None
    llm = LLM(model_dir, device="cpu", num_kv_blocks=64)
    model = llm.engine.model
    rows = []
    real_core = model.recurrent_core
    monkeypatch.setattr(
        model, "recurrent_core", lambda h, m, kv: rows.append(h.shape[0]) or real_core(h, m, kv)
    )
    used = iter([3 * GIB, 3 * GIB + 5000])  # free drops by 5000 bytes over the run
    fake = {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_reserved": lambda device=None: GIB,
        "max_memory_reserved": lambda device=None: GIB + 123,
        "mem_get_info": lambda device=None: (80 * GIB - next(used), 80 * GIB),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    got = memory_profile.activation_bytes(model, 100, 8, 16, 64)
    assert got == 123 + 5000 and rows == [100]
    sampled = []
    monkeypatch.setattr(model, "coda", lambda h: sampled.append(h.shape[0]) or model.lm_head(h))
    used = iter([GIB, GIB, GIB])
    mem = memory_profile.measure_device_memory(model, 37, 5, 4, 16, (), 512)
    assert mem == DeviceMemory(80 * GIB, GIB, 123, 0) and rows[-1] == 37 and sampled == [5]


# ---- on the GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("shape,utilization", [(None, 0.9), ("ouro-1.4b", 0.5)])
def test_cuda_defaults_give_the_kv_cache_the_rest_of_the_memory(tmp_path, shape, utilization):
    """An engine built with the default sizing leaves about (1 - utilization) of the device
    free, and then serves a step of the largest size without running out of memory."""
    from benchmarks.model_shapes import write_shape

    model = str(write_shape(shape, tmp_path / "m")) if shape else None
    dummy = {"load_format": "dummy"} if shape else {}
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(model, device="cuda", gpu_memory_utilization=utilization, **dummy)
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    slack = GIB  # what the estimates may leave unused (they double-count conservatively)
    assert (1 - utilization) * total - slack / 2 < free < (1 - utilization) * total + slack
    eng = llm.engine
    assert eng.kv_manager.num_total_blocks > 1000
    budget = eng.config.scheduler.max_num_batched_tokens
    n = eng.config.scheduler.max_num_seqs
    prompt = list(range(1, budget // n + 1))
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=20, temperature=1.0)
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
