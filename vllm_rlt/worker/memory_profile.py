"""Device memory the engine needs besides the KV cache, measured on CUDA at start, after the
model and the persistent buffers are loaded and before the KV cache exists
(`engine/kv_sizing.py` gives the rest of `gpu_memory_utilization` to the KV cache).

Three parts: what is in use on the device (this process's weights and buffers, the CUDA
context, other processes), the peak of the largest invocation the engine can issue, and the
CUDA-graph pool. The first is read, the other two are measured over a scratch KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.attention.metadata import build_attention_metadata
from vllm_rlt.sampling_params import MAX_LOGPROBS
from vllm_rlt.worker.cuda_graph import CudaGraphRunner
from vllm_rlt.worker.edge_stages import EdgeSegment, edge_stages_for
from vllm_rlt.worker.graph_tables import GraphSpec
from vllm_rlt.worker.kv_cache import DeviceKVCache
from vllm_rlt.worker.sampler import SamplingTensors, sample


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int  # the device's memory
    in_use_bytes: int  # in use on the device before the profile (all processes)
    activation_bytes: int  # peak of the largest invocation and its sampling, above in_use
    graph_bytes: int  # CUDA graphs: static buffers and pool (estimate, `graph_bytes`)


def measure_device_memory(
    model: torch.nn.Module,
    max_num_rows: int,
    max_num_samples: int,
    block_size: int,
    tile_rows: int,
    graph_specs: tuple[GraphSpec, ...],
    max_context: int,
) -> DeviceMemory:
    """Read and measure the device memory of `model`'s engine: invocations of up to
    `max_num_rows` rows, up to `max_num_samples` sampled per step, the CUDA graphs of
    `graph_specs` (none: eager) over `max_context` positions."""
    device = model.lm_head.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    activation = activation_bytes(model, max_num_rows, max_num_samples, block_size, tile_rows)
    graphs = (
        graph_bytes(model, graph_specs, max_context, block_size, tile_rows) if graph_specs else 0
    )
    return DeviceMemory(total, total - free, activation, graphs)


@torch.inference_mode()
def activation_bytes(
    model: torch.nn.Module, num_rows: int, num_samples: int, block_size: int, tile_rows: int
) -> int:
    """Peak device memory of the largest invocation, eager: one prefill segment of `num_rows`
    rows (positions 0..num_rows - 1 of a scratch KV cache) through the prelude, the recurrent
    core and (a model with attention there) the coda's blocks, with coda and sampling (top-k,
    top-p, logprobs) of `num_samples` rows beside it. The caching allocator's peak above its
    reserve before the run, plus what the run left in use outside it (kernel modules, library
    workspaces). Attention temporaries that grow with the context (split-KV partials; the torch
    backend's scores) are measured at this context only."""
    device = model.lm_head.weight.device
    num_blocks = -(-num_rows // block_size)
    kv = DeviceKVCache.for_model(model, num_blocks, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    used_before = _used(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    tables = [tuple(range(num_blocks))]
    meta = build_attention_metadata([0], [num_rows], tables, block_size, device, tile_rows)
    tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
    # every plane (the loop's and the edge planes) on the same scratch blocks
    edges = edge_stages_for(model, kv, 0, tile_rows)
    planes = tables * (1 + model.num_edge_planes)
    prompt = [EdgeSegment(0, num_rows, planes, 0, 1.0)]
    hidden = edges.enter(tokens, meta.positions, prompt)
    rows = torch.zeros(num_samples, hidden.shape[1], dtype=hidden.dtype, device=device)
    n = num_samples
    params = SamplingTensors.build(
        [1.0] * n, [50] * n, [0.9] * n, [0.05] * n, [0] * n, [0] * n, MAX_LOGPROBS, device
    )
    samples = [EdgeSegment(i % num_rows, 1, planes, 0, 1.0) for i in range(n)]
    sampled = sample(edges.logits(rows, samples), params)
    out, gate = model.recurrent_core(hidden, meta, kv)
    edges.finish(out, list(range(num_rows)), prompt)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - reserved
    del kv, meta, tokens, hidden, rows, sampled, out, gate
    torch.cuda.empty_cache()
    return peak + max(0, _used(device) - used_before)


@torch.inference_mode()
def graph_bytes(
    model: torch.nn.Module,
    specs: tuple[GraphSpec, ...],
    max_context: int,
    block_size: int,
    tile_rows: int,
) -> int:
    """Estimate of the memory the engine's CUDA graphs take, measured: a capture of the largest
    graph alone (its static buffers and pool, over a scratch KV cache), plus the outputs each
    other graph keeps. The engine captures largest first into one pool; each graph's
    temporaries go back to the pool for the next, smaller graph, its outputs stay."""
    device = model.lm_head.weight.device
    largest = max(specs)
    kv = DeviceKVCache.for_model(model, 1, block_size)  # padding rows use its scratch block only
    torch.cuda.synchronize(device)
    used_before = _used(device)
    runner = CudaGraphRunner(model, kv, (largest,), max_context, tile_rows)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the eager warm-up's blocks: activations, measured apart
    measured = _used(device) - used_before
    del runner, kv
    torch.cuda.empty_cache()
    row_bytes = model.state_size * model.lm_head.weight.dtype.itemsize + 4  # + fp32 gate
    return measured + sum(s.num_rows for s in specs if s != largest) * row_bytes


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free
