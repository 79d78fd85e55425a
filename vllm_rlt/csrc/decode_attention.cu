// Paged decode attention in one launch: the KV splits of a row merge in a thread-block cluster.
//
// A decode row (one query position) attends to its plane's keys 0..pos through its block table.
// The Triton path (kernels/paged_attention.py) splits a short context into pieces to fill the
// GPU, writes each piece's partial to global memory, and merges them in a second kernel. Here
// the S pieces of one (row, KV head) are the S blocks of one cluster (Hopper): each block
// reduces its piece to a partial (running max, sum, unnormalised output) in shared memory, and
// after a cluster barrier every block merges a slice of the output from all S partials through
// distributed shared memory. No partials go to global memory and no second kernel waits.
//
// Layout (vllm_rlt/attention/metadata.py): tiles of one row each; tile t holds row
// tile_row_start[t] of segment tile_seg[t] (tile_num_rows[t] == 0: a padding tile, no work);
// the segment's block table lists the plane's blocks; caches are [blocks, block_size, Hkv, D]
// with D contiguous. A block of 4 warps walks its piece in steps of 4 x 32 / LANES positions:
// LANES lanes (D / 8 rounded up to a power of two; the lanes past D idle) hold one position's
// 8-element slices of K and V, and each lane keeps the
// online softmax of its positions for the G query heads of the KV head (GQA group), in fp32.
// Scores are in the log2 domain (qk_scale includes log2(e) and, over FP8, K's scale); V's
// scale multiplies the output.
//
// Built at first use by vllm_rlt/kernels/native.py (nvcc); called through a C ABI. With
// VRLT_EMULATE defined, the host compiler builds it over an emulation of the CUDA features it
// uses (tests/kernels/cuda_emu.h: threads, shuffles, barriers, clusters), for tests on the CPU.

#ifndef VRLT_EMULATE
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#define VRLT_SHARED(type, name) __shared__ type name
#define VRLT_GDC(instruction) asm volatile("griddepcontrol." instruction ";" ::: "memory")
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kVec = 8;     // elements of K, V and q per lane and position
constexpr float kNegInf = -__builtin_huge_valf();

struct Params {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* tile_ids;
  const int32_t* tile_seg;
  const int32_t* tile_row_start;
  const int32_t* tile_num_rows;
  const int32_t* block_tables;
  const int64_t* positions;
  int64_t stride_q_row, stride_q_head, stride_o_row, stride_o_head;
  int64_t stride_block, stride_slot, stride_kv_head, stride_bt;
  int block_shift;  // log2(block_size)
  float qk_scale;
  float v_scale;
};

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16* y) {
  *y = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void from_float(float x, __half* y) { *y = __float2half_rn(x); }

// 8 elements of a 16-bit type (one 16-byte load) or of e4m3 (one 8-byte load), as floats.
template <typename T>
struct Vec8 {
  using Raw = uint4;
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  __device__ static void to_float(const Raw& r, float* f) {
    const Pair* h = reinterpret_cast<const Pair*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = to_float2(h[i]);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
};

template <>
struct Vec8<__nv_fp8_e4m3> {
  using Raw = uint2;
  __device__ static void to_float(const Raw& r, float* f) {
    const __nv_fp8x2_storage_t* h = reinterpret_cast<const __nv_fp8x2_storage_t*>(&r);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // e4m3 -> fp16 is exact
      __half2 x = __half2(__nv_cvt_fp8x2_to_halfraw2(h[i], __NV_E4M3));
      float2 y = __half22float2(x);
      f[2 * i] = y.x;
      f[2 * i + 1] = y.y;
    }
  }
};

// A coherent load: q and this invocation's K/V were written by the kernels just before (no
// read-only cache path for them).
template <typename T>
__device__ __forceinline__ typename Vec8<T>::Raw load8(const T* base, int64_t offset) {
  return *reinterpret_cast<const typename Vec8<T>::Raw*>(base + offset);
}

__host__ __device__ constexpr int pow2_at_least(int x) {
  return x <= 1 ? 1 : 2 * pow2_at_least((x + 1) / 2);
}

// (m, l, acc) of another lane's positions merged into this lane's (log2 domain).
template <int G>
__device__ __forceinline__ void merge_lanes(float (&m)[G], float (&l)[G], float (&acc)[G][kVec],
                                            int offset) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float mo = __shfl_xor_sync(0xffffffffu, m[g], offset);
    const float lo = __shfl_xor_sync(0xffffffffu, l[g], offset);
    const float mn = fmaxf(m[g], mo);
    const float ca = mn == kNegInf ? 0.f : exp2f(m[g] - mn);
    const float cb = mn == kNegInf ? 0.f : exp2f(mo - mn);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], offset);
      acc[g][i] = acc[g][i] * ca + ao * cb;
    }
    l[g] = l[g] * ca + lo * cb;
    m[g] = mn;
  }
}

// A block's shared memory: its warps' partials, then the block's (read by the whole cluster).
template <int G, int D>
struct Smem {
  float warp_m[kWarps][G], warp_l[kWarps][G];
  float warp_acc[kWarps][G][D];
  float part_m[G], part_l[G];
  float part_acc[G][D];
};

template <typename Q, typename KV, int D, int G, bool CLUSTER>
__global__ void __launch_bounds__(kThreads)
    decode_attention_kernel(const Params p) {
  constexpr int LANES = pow2_at_least(D / kVec);  // lanes per position
  constexpr int PPW = 32 / LANES;        // positions per warp and step
  constexpr int STEP = kWarps * PPW;     // positions per block and step
  // positions per lane whose loads are in flight together (FP8: 8-byte loads, twice as many)
  constexpr int UNROLL = (G == 1 ? 8 : 4) * (sizeof(KV) == 1 ? 2 : 1);
  static_assert(D % kVec == 0 && LANES <= 32, "head_dim: a multiple of 8, at most 256");

  using Shared = Smem<G, D>;
  VRLT_SHARED(Shared, sm);

  // the tables are written before the invocation: read them while the kernel before finishes
  VRLT_GDC("launch_dependents");
  const int tile = p.tile_ids[blockIdx.z];
  const int nrows = p.tile_num_rows[tile];
  const int row = p.tile_row_start[tile];
  const int seg = p.tile_seg[tile];
  // q and this invocation's K/V come from the kernels before: every block waits (a no-op
  // without an early launch), so that the launch ends after them
  VRLT_GDC("wait");
  if (nrows == 0) return;  // a padding tile: the whole cluster leaves together

  const int kv_head = blockIdx.y;
  const int rank = blockIdx.x;  // the piece of the context; the block's rank in its cluster
  const int pieces = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / LANES, li = lane % LANES;
  const bool live = li * kVec < D;  // false only for the lanes past D

  const int context = static_cast<int>(p.positions[row]) + 1;
  const int per_piece = (context + pieces - 1) / pieces;
  const int begin = rank * per_piece;
  const int end = min(context, begin + per_piece);

  // this lane's slice of the group's queries, scaled into the log2 domain
  float q[G][kVec];
  const Q* q_row = static_cast<const Q*>(p.q) + row * p.stride_q_row;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t off = (kv_head * G + g) * p.stride_q_head + li * kVec;
    if (live) Vec8<Q>::to_float(load8(q_row, off), q[g]);
#pragma unroll
    for (int i = 0; i < kVec; ++i) q[g][i] = live ? q[g][i] * p.qk_scale : 0.f;
  }

  float m[G], l[G], acc[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[g][i] = 0.f;
  }

  const KV* k_cache = static_cast<const KV*>(p.k);
  const KV* v_cache = static_cast<const KV*>(p.v);
  const int32_t* table = p.block_tables + seg * p.stride_bt;
  const int block_mask = (1 << p.block_shift) - 1;
  const int64_t head_off = kv_head * p.stride_kv_head + li * kVec;

  // warp-uniform trip count: every lane takes part in the shuffles of every step
  for (int base = begin + warp * PPW; base < end; base += STEP * UNROLL) {
    typename Vec8<KV>::Raw k_raw[UNROLL], v_raw[UNROLL];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int pos = base + u * STEP + sub;
      ok[u] = pos < end;
      if (ok[u] && live) {
        const int64_t blk = table[pos >> p.block_shift];
        const int64_t off = blk * p.stride_block + (pos & block_mask) * p.stride_slot + head_off;
        k_raw[u] = load8(k_cache, off);
        v_raw[u] = load8(v_cache, off);
      }
    }
    float s[UNROLL][G];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[kVec];
      if (ok[u] && live) {
        Vec8<KV>::to_float(k_raw[u], kf);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) kf[i] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) dot = fmaf(q[g][i], kf[i], dot);
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[u][g] = ok[u] ? dot : kNegInf;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) mn = fmaxf(mn, s[u][g]);
      if (mn == kNegInf) continue;  // no position of this lane in the step
      const float c = exp2f(m[g] - mn);
      l[g] *= c;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[g][i] *= c;
      m[g] = mn;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (!ok[u]) continue;
      float vf[kVec];
      if (live) Vec8<KV>::to_float(v_raw[u], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pr = exp2f(s[u][g] - m[g]);
        l[g] += pr;
#pragma unroll
        for (int i = 0; live && i < kVec; ++i) acc[g][i] = fmaf(pr, vf[i], acc[g][i]);
      }
    }
  }

  // the warp's positions: lanes li, li + LANES, ... hold the same slice of dims
#pragma unroll
  for (int offset = LANES; offset < 32; offset <<= 1) merge_lanes<G>(m, l, acc, offset);
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (li == 0) {
        sm.warp_m[warp][g] = m[g];
        sm.warp_l[warp][g] = l[g];
      }
#pragma unroll
      for (int i = 0; live && i < kVec; ++i) sm.warp_acc[warp][g][li * kVec + i] = acc[g][i];
    }
  }
  __syncthreads();

  // the block's piece: the warps merged, one (head, dim) element per thread and pass
  for (int e = threadIdx.x; e < G * D; e += kThreads) {
    const int g = e / D, d = e % D;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm.warp_m[w][g]);
    float a = 0.f, sum = 0.f;
    if (mx != kNegInf) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(sm.warp_m[w][g] - mx);
        a = fmaf(c, sm.warp_acc[w][g][d], a);
        sum = fmaf(c, sm.warp_l[w][g], sum);
      }
    }
    if constexpr (!CLUSTER) {  // one piece: its output (piece 0 holds key 0: sum > 0)
      Q* out = static_cast<Q*>(p.out) + row * p.stride_o_row + (kv_head * G + g) * p.stride_o_head;
      from_float(a / sum * p.v_scale, &out[d]);
    } else {
      sm.part_acc[g][d] = a;
      if (d == 0) {
        sm.part_m[g] = mx;
        sm.part_l[g] = sum;
      }
    }
  }
  if constexpr (CLUSTER) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every piece's partial is in its block's shared memory
    // this block's slice of the G x D outputs, merged over the pieces
    const int slice = G * D / pieces;
    for (int e = rank * slice + threadIdx.x; e < (rank + 1) * slice; e += kThreads) {
      const int g = e / D, d = e % D;
      float mx = kNegInf;
      for (int r = 0; r < pieces; ++r) {
        mx = fmaxf(mx, *cluster.map_shared_rank(&sm.part_m[g], r));
      }
      float a = 0.f, sum = 0.f;
      for (int r = 0; r < pieces; ++r) {
        const float mr = *cluster.map_shared_rank(&sm.part_m[g], r);
        const float c = mr == kNegInf ? 0.f : exp2f(mr - mx);
        a = fmaf(c, *cluster.map_shared_rank(&sm.part_acc[g][d], r), a);
        sum = fmaf(c, *cluster.map_shared_rank(&sm.part_l[g], r), sum);
      }
      Q* out = static_cast<Q*>(p.out) + row * p.stride_o_row + (kv_head * G + g) * p.stride_o_head;
      from_float(a / sum * p.v_scale, &out[d]);
    }
    cluster.sync();  // no block leaves while another reads its shared memory
  }
}

template <typename Q, typename KV, int D, int G>
cudaError_t launch(const Params& p, int num_tiles, int num_kv_heads, int pieces, bool pdl,
                   cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(pieces, num_kv_heads, num_tiles);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (pieces > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = pieces;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  void (*kernel)(Params) = decode_attention_kernel<Q, KV, D, G, false>;
  if (pieces > 1) kernel = decode_attention_kernel<Q, KV, D, G, true>;
#ifdef VRLT_EMULATE
  return emu::launch(cfg, kernel, p);
#else
  return cudaLaunchKernelEx(&cfg, kernel, p);
#endif
}

template <typename Q, typename KV>
cudaError_t by_shape(const Params& p, int num_tiles, int num_kv_heads, int pieces, int head_dim,
                     int group, bool pdl, cudaStream_t stream) {
#define VRLT_CASE(D, G)                                                                    \
  if (head_dim == D && group == G)                                                         \
    return launch<Q, KV, D, G>(p, num_tiles, num_kv_heads, pieces, pdl, stream);
  VRLT_CASE(64, 1) VRLT_CASE(64, 2) VRLT_CASE(64, 4)
  VRLT_CASE(96, 1) VRLT_CASE(96, 2) VRLT_CASE(96, 4)
  VRLT_CASE(128, 1) VRLT_CASE(128, 2) VRLT_CASE(128, 4)
#undef VRLT_CASE
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// q_dtype: 0 bf16, 1 fp16 (the output's too); kv_fp8: the caches hold e4m3, else q's dtype.
// Returns a cudaError_t (0: launched).
int vrlt_decode_attention(void* out, const void* q, const void* k, const void* v,
                          const int32_t* tile_ids, const int32_t* tile_seg,
                          const int32_t* tile_row_start, const int32_t* tile_num_rows,
                          const int32_t* block_tables, const int64_t* positions,
                          int64_t stride_q_row, int64_t stride_q_head, int64_t stride_o_row,
                          int64_t stride_o_head, int64_t stride_block, int64_t stride_slot,
                          int64_t stride_kv_head, int64_t stride_bt, int num_tiles,
                          int num_kv_heads, int head_dim, int group, int block_shift, int pieces,
                          float qk_scale, float v_scale, int q_dtype, int kv_fp8, int pdl,
                          void* stream) {
  if (pieces < 1 || pieces > 8 || (pieces & (pieces - 1)) || num_tiles < 1) {
    return cudaErrorInvalidValue;
  }
  const Params p{out, q, k, v, tile_ids, tile_seg, tile_row_start, tile_num_rows, block_tables,
                 positions, stride_q_row, stride_q_head, stride_o_row, stride_o_head,
                 stride_block, stride_slot, stride_kv_head, stride_bt, block_shift, qk_scale,
                 v_scale};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (q_dtype == 0 && kv_fp8) {
    err = by_shape<__nv_bfloat16, __nv_fp8_e4m3>(p, num_tiles, num_kv_heads, pieces, head_dim,
                                                 group, pdl, s);
  } else if (q_dtype == 0) {
    err = by_shape<__nv_bfloat16, __nv_bfloat16>(p, num_tiles, num_kv_heads, pieces, head_dim,
                                                 group, pdl, s);
  } else if (kv_fp8) {
    err = by_shape<__half, __nv_fp8_e4m3>(p, num_tiles, num_kv_heads, pieces, head_dim, group,
                                          pdl, s);
  } else {
    err = by_shape<__half, __half>(p, num_tiles, num_kv_heads, pieces, head_dim, group, pdl, s);
  }
  return static_cast<int>(err);
}

const char* vrlt_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
