// Probe: a decode invocation's projections, norms and attention (Ouro's layers but for RoPE, the
// KV write and the exit gate) in one persistent kernel that keeps the weight stream going across
// its grid barriers (docs/design/runner.md §4; benchmarks/probes/persistent_chain.py builds,
// checks and times it).
//
// One block per SM, launched cooperatively, runs P projections y_p = x_p @ W_p^T (bf16, fp32
// sums) of R rows one after another (every N and K a multiple of 8). Each projection's input is
// built, after a grid barrier, from the output before it, as the layer does (`mode`):
//   SLICE   x = the first K columns of y_{p-1};
//   ATTEND  x = attention of q (the first heads x 128 columns of y_{p-1}, the q/k/v output) over
//           a cache of `ctx` positions per row (two more barriers: the blocks share the tasks
//           (row, head, piece) and store partials, then merge them per (row, head));
//   SWIGLU  x = silu(gate) * up of y_{p-1} = [gate | up];
//   ADD_NORM h_out = h_in + norm_a(y_{p-1}), x = norm_b(h_out) (the sandwich step; block 0
//           stores h_out, every block computes it);
//   NORM    x = norm_b(h_in) (the first projection).
// Block b owns an even share of each W_p's rows and streams them as tiles of 8 rows x 1024
// columns through a ring of STAGES tiles in shared memory (cp.async). The ring runs ahead
// through the block's tiles of all projections: while a block waits at the barrier after
// projection p, the first tiles of its share of W_{p+1} (no kernel writes them) are already on
// their way, so a barrier costs the latency of reading the inputs from the L2, not a cold
// weight stream. Each of 8 warps takes one row of a tile; its lanes run along K.
//
// With VRLT_EMULATE defined the host compiler builds it over tests/kernels/cuda_emu.h.

#ifndef VRLT_EMULATE
#define VRLT_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define VRLT_CP_ASYNC16(dst, src)                                                        \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(                       \
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),                \
               "l"(src))
#define VRLT_CP_COMMIT() asm volatile("cp.async.commit_group;")
#define VRLT_CP_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n))
#define VRLT_LOAD_ACQUIRE(ptr, out) \
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(out) : "l"(ptr) : "memory")
#define VRLT_LOAD_L2(ptr) __ldcg(ptr)
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kWarps;  // one weight row per warp
constexpr int kTileK = 1024;       // columns per tile
constexpr int kStages = 8;         // tiles in the ring
constexpr int kTileBytes = kTileRows * kTileK * 2;
constexpr int kHeadDim = 128;  // attention: 16 lanes x 8 dims per position, 2 positions per warp
constexpr int kPartial = kHeadDim + 2;  // a piece's partial: output, running max, sum
constexpr float kNegInf = -__builtin_huge_valf();

enum Mode { SLICE = 0, SWIGLU = 1, ADD_NORM = 2, NORM = 3, ATTEND = 4 };

struct Chain {
  const __nv_bfloat16* const* w;       // [P] weights [N_p, K_p], rows contiguous
  __nv_bfloat16* const* y;             // [P] outputs [R, N_p]
  const int* n;                        // [P]
  const int* k;                        // [P]
  const int* mode;                     // [P] how x_p is built
  const __nv_bfloat16* const* h_in;    // [P] residual stream [R, K_p] (ADD_NORM, NORM)
  __nv_bfloat16* const* h_out;         // [P] residual after the step (ADD_NORM)
  const __nv_bfloat16* const* norm_a;  // [P] weights [K_p] (ADD_NORM)
  const __nv_bfloat16* const* norm_b;  // [P] weights [K_p] (ADD_NORM, NORM)
  const __nv_bfloat16* const* k_cache;  // [P] [R, ctx, heads, 128] (ATTEND)
  const __nv_bfloat16* const* v_cache;  // [P] likewise
  float* const* part;                   // [P] [R, heads, pieces, kPartial] (ATTEND)
  __nv_bfloat16* const* attn;           // [P] attention output [R, heads x 128] (ATTEND)
  unsigned* counter;                    // grid barrier arrivals: zero at launch
  int num_proj;
  float eps;
  int heads, ctx, pieces;
};

// Where a block is in its tiles: projection, row group of its share, K chunk.
struct Cursor {
  int p = 0, group = 0, chunk = 0;
  int row0 = 0, rows = 0, groups = 0, chunks = 0;  // this block's share of W_p

  // the first projection from `proj` on that has rows here
  __device__ void enter(const Chain& c, int proj) {
    group = chunk = 0;
    for (p = proj; p < c.num_proj; ++p) {
      const int n = c.n[p], per = (n + gridDim.x - 1) / gridDim.x;
      row0 = min(n, static_cast<int>(blockIdx.x) * per);
      rows = min(n, row0 + per) - row0;
      groups = (rows + kTileRows - 1) / kTileRows;
      chunks = (c.k[p] + kTileK - 1) / kTileK;
      if (groups > 0) return;
    }
  }
  __device__ bool done(const Chain& c) const { return p >= c.num_proj; }
  __device__ bool last_chunk() const { return chunk == chunks - 1; }
  __device__ void advance(const Chain& c) {
    if (++chunk < chunks) return;
    chunk = 0;
    if (++group < groups) return;
    enter(c, p + 1);
  }
};

// The tile under `at` into ring slot `slot` (rows past the share and columns past K are not
// loaded; the consumer never reads them).
__device__ void issue(const Chain& c, const Cursor& at, unsigned char* ring, int slot) {
  if (!at.done(c)) {
    const int k = c.k[at.p], k0 = at.chunk * kTileK, width = min(kTileK, k - k0);
    const int r0 = at.group * kTileRows, rows = min(kTileRows, at.rows - r0);
    const __nv_bfloat16* w = c.w[at.p] + static_cast<int64_t>(at.row0 + r0) * k + k0;
    unsigned char* dst = ring + slot * kTileBytes;
    for (int i = threadIdx.x; i < kTileRows * kTileK / 8; i += kThreads) {
      const int r = i / (kTileK / 8), col = (i % (kTileK / 8)) * 8;
      if (r < rows && col < width) {
        VRLT_CP_ASYNC16(dst + (r * kTileK + col) * 2, w + static_cast<int64_t>(r) * k + col);
      }
    }
  }
  VRLT_CP_COMMIT();  // one group per tile, empty past the last: the wait count stays exact
}

// The sum over the block of each row's partial (one per thread), to every thread.
template <int R>
__device__ void block_sums(float (&v)[R], float* scratch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    for (int o = 16; o > 0; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
    if (lane == 0) scratch[warp * R + r] = v[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    v[r] = 0.f;
    for (int w = 0; w < kWarps; ++w) v[r] += scratch[w * R + r];
  }
  __syncthreads();  // scratch is free again
}

// 8 bf16 as floats: from the L2 (written by other blocks in this launch), or from anywhere else
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8], bool l2) {
  const uint4 raw = l2 ? VRLT_LOAD_L2(reinterpret_cast<const uint4*>(p))
                       : *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&f)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// rsqrt(mean(x^2) + eps) of each of the R rows whose slices this thread holds in `v` (zeros
// where it holds none), over K columns
template <int R>
__device__ void rms_scales(const float (&v)[R][8], int k, float eps, float (&scale)[R],
                           float* scratch) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    scale[r] = 0.f;
    for (int i = 0; i < 8; ++i) scale[r] += v[r][i] * v[r][i];
  }
  block_sums<R>(scale, scratch);
#pragma unroll
  for (int r = 0; r < R; ++r) scale[r] = rsqrtf(scale[r] / k + eps);
}

// x of projection p into shared memory (R x K_p, bf16), built from the outputs before it: every
// thread loads all it needs in one round, then computes (the norms: one 8-column slice of each
// row per thread: K <= kThreads x 8).
template <int R>
__device__ void load_x(const Chain& c, int p, __nv_bfloat16* xs, float* scratch) {
  const int k = c.k[p], mode = c.mode[p];
  const __nv_bfloat16* y = mode == ATTEND ? c.attn[p] : p > 0 ? c.y[p - 1] : nullptr;
  const int64_t stride = mode == ATTEND ? k : p > 0 ? c.n[p - 1] : 0;
  if (mode == SLICE || mode == SWIGLU || mode == ATTEND) {
    for (int d = threadIdx.x * 8; d < k; d += kThreads * 8) {
      float v[R][8], u[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        load8(y + r * stride + d, v[r], true);
        if (mode == SWIGLU) load8(y + r * stride + d + k, u[r], true);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (mode == SWIGLU) {
          for (int i = 0; i < 8; ++i) v[r][i] = v[r][i] / (1.f + expf(-v[r][i])) * u[r][i];
        }
        store8(xs + r * k + d, v[r]);
      }
    }
    return;
  }
  // NORM: x = norm_b(h_in); ADD_NORM: h_out = h_in + norm_a(y) (stored in bf16), x = norm_b(h_out)
  const int d = threadIdx.x * 8;
  const bool mine = d < k;
  float h[R][8] = {}, yv[R][8] = {}, wa[8] = {}, wb[8] = {}, scale[R];
  if (mine) {
    load8(c.norm_b[p] + d, wb, false);
#pragma unroll
    for (int r = 0; r < R; ++r) load8(c.h_in[p] + r * k + d, h[r], true);
    if (mode == ADD_NORM) {
      load8(c.norm_a[p] + d, wa, false);
#pragma unroll
      for (int r = 0; r < R; ++r) load8(y + r * stride + d, yv[r], true);
    }
  }
  if (mode == ADD_NORM) {
    rms_scales<R>(yv, k, c.eps, scale, scratch);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 8; ++i) {  // the residual stream is stored in bf16
        h[r][i] = __bfloat162float(__float2bfloat16_rn(h[r][i] + yv[r][i] * scale[r] * wa[i]));
      }
      if (mine && blockIdx.x == 0) store8(c.h_out[p] + r * k + d, h[r]);
    }
  }
  rms_scales<R>(h, k, c.eps, scale, scratch);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) h[r][i] *= scale[r] * wb[i];
    if (mine) store8(xs + r * k + d, h[r]);
  }
}

__device__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's y, before its arrival
    atomicAdd(counter, 1u);
    unsigned seen = 0;
    do {
      VRLT_LOAD_ACQUIRE(counter, seen);
    } while (seen < target);
  }
  __syncthreads();
}

// Projection p's attention (ATTEND): the tasks (row, head, piece) shared over the blocks, each
// storing its piece's partial in part[p] (log2 domain). 8 warps walk a piece, 2 positions per
// warp and step, 16 lanes of 8 dims per position, 4 positions of each lane's loads in flight;
// `work`: kWarps x kPartial floats.
template <int R>
__device__ void attend(const Chain& c, int p, float* work) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / 16, li = lane % 16;
  const int heads = c.heads, ctx = c.ctx, pieces = c.pieces, per = (ctx + pieces - 1) / pieces;
  const __nv_bfloat16* y = c.y[p - 1];
  const int64_t stride = c.n[p - 1], pos_stride = static_cast<int64_t>(heads) * kHeadDim;
  const float scale = rsqrtf(static_cast<float>(kHeadDim)) * 1.4426950408889634f;
  for (int task = blockIdx.x; task < R * heads * pieces; task += gridDim.x) {
    const int r = task / (heads * pieces), h = task / pieces % heads, s = task % pieces;
    const int begin = s * per, end = min(ctx, begin + per);
    float q[8], acc[8] = {}, m = kNegInf, l = 0.f;
    load8(y + r * stride + h * kHeadDim + li * 8, q, true);
    for (int i = 0; i < 8; ++i) q[i] *= scale;
    const int64_t head0 = r * ctx * pos_stride + h * kHeadDim + li * 8;
    constexpr int U = 4, STEP = kWarps * 2;  // positions of each lane in flight; of the block
    for (int base = begin + warp * 2; base < end; base += STEP * U) {  // warp-uniform
      float kf[U][8], vf[U][8], sc[U];
      bool ok[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int pos = base + u * STEP + sub;
        ok[u] = pos < end;
        if (ok[u]) {
          load8(c.k_cache[p] + head0 + pos * pos_stride, kf[u], false);
          load8(c.v_cache[p] + head0 + pos * pos_stride, vf[u], false);
        }
      }
      float mn = m;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float dot = 0.f;
        for (int i = 0; ok[u] && i < 8; ++i) dot += q[i] * kf[u][i];
        for (int o = 8; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        sc[u] = ok[u] ? dot : kNegInf;
        mn = fmaxf(mn, sc[u]);
      }
      if (mn == kNegInf) continue;  // no position of this lane in the step
      const float cm = exp2f(m - mn);
      l *= cm;
      for (int i = 0; i < 8; ++i) acc[i] *= cm;
      m = mn;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (!ok[u]) continue;
        const float pr = exp2f(sc[u] - m);
        l += pr;
        for (int i = 0; i < 8; ++i) acc[i] += pr * vf[u][i];
      }
    }
    {  // the warp's two positions per step
      const float mo = __shfl_xor_sync(0xffffffffu, m, 16), lo = __shfl_xor_sync(0xffffffffu, l, 16);
      const float mn = fmaxf(m, mo);
      const float ca = mn == kNegInf ? 0.f : exp2f(m - mn), cb = mn == kNegInf ? 0.f : exp2f(mo - mn);
      for (int i = 0; i < 8; ++i) {
        acc[i] = acc[i] * ca + __shfl_xor_sync(0xffffffffu, acc[i], 16) * cb;
      }
      l = l * ca + lo * cb;
      m = mn;
    }
    float* mine = work + warp * kPartial;
    if (sub == 0) {
      for (int i = 0; i < 8; ++i) mine[li * 8 + i] = acc[i];
      if (li == 0) {
        mine[kHeadDim] = m;
        mine[kHeadDim + 1] = l;
      }
    }
    __syncthreads();
    if (threadIdx.x < kHeadDim) {  // the block's piece: its warps merged
      float mx = kNegInf, a = 0.f, sum = 0.f;
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, work[w * kPartial + kHeadDim]);
      for (int w = 0; mx != kNegInf && w < kWarps; ++w) {
        const float cw = exp2f(work[w * kPartial + kHeadDim] - mx);
        a += cw * work[w * kPartial + threadIdx.x];
        sum += cw * work[w * kPartial + kHeadDim + 1];
      }
      float* out = c.part[p] + static_cast<int64_t>(task) * kPartial;
      out[threadIdx.x] = a;
      if (threadIdx.x == 0) {
        out[kHeadDim] = mx;
        out[kHeadDim + 1] = sum;
      }
    }
    __syncthreads();  // `work` is free again
  }
}

// Projection p's attention output (ATTEND): each (row, head)'s pieces merged, shared over blocks.
template <int R>
__device__ void merge(const Chain& c, int p) {
  const int heads = c.heads, pieces = c.pieces, d = threadIdx.x;
  for (int pair = blockIdx.x; pair < R * heads && d < kHeadDim; pair += gridDim.x) {
    const float* part = c.part[p] + static_cast<int64_t>(pair) * pieces * kPartial;
    float mx = kNegInf, a = 0.f, sum = 0.f;
    for (int s = 0; s < pieces; ++s) mx = fmaxf(mx, VRLT_LOAD_L2(part + s * kPartial + kHeadDim));
    for (int s = 0; s < pieces; ++s) {  // piece 0 holds position 0: mx is finite
      const float ms = VRLT_LOAD_L2(part + s * kPartial + kHeadDim);
      const float cs = ms == kNegInf ? 0.f : exp2f(ms - mx);
      a += cs * VRLT_LOAD_L2(part + s * kPartial + d);
      sum += cs * VRLT_LOAD_L2(part + s * kPartial + kHeadDim + 1);
    }
    c.attn[p][static_cast<int64_t>(pair) * kHeadDim + d] = __float2bfloat16_rn(a / sum);
  }
}

// What runs between projections p and p + 1 in every block: a grid barrier, and for an ATTEND
// projection its attention and merge, each followed by one.
template <int R>
__device__ void between(const Chain& c, int p, int& barriers, float* work) {
  grid_barrier(c.counter, ++barriers * gridDim.x);
  if (c.mode[p + 1] == ATTEND) {
    attend<R>(c, p + 1, work);
    grid_barrier(c.counter, ++barriers * gridDim.x);
    merge<R>(c, p + 1);
    grid_barrier(c.counter, ++barriers * gridDim.x);
  }
}

template <int R>
__global__ void __launch_bounds__(kThreads, 1) persistent_chain_kernel(const Chain c) {
  VRLT_DYNAMIC_SMEM(smem);
  unsigned char* ring = smem;
  float* scratch = reinterpret_cast<float*>(smem + kStages * kTileBytes);  // kWarps x R
  float* work = scratch + kWarps * R;  // attention: kWarps x kPartial
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(work + kWarps * kPartial);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Cursor produce, consume;
  produce.enter(c, 0);
  consume.enter(c, 0);
  for (int s = 0; s < kStages - 1; ++s) {
    issue(c, produce, ring, s);
    if (!produce.done(c)) produce.advance(c);
  }
  load_x<R>(c, 0, xs, scratch);
  int x_of = 0;  // the projection whose x is in xs
  int barriers = 0;  // grid barriers passed
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  for (int t = 0; !consume.done(c); ++t) {
    if (consume.p != x_of) {  // the projections before it are complete everywhere
      for (int p = x_of; p < consume.p; ++p) between<R>(c, p, barriers, work);
      x_of = consume.p;
      load_x<R>(c, x_of, xs, scratch);
    }
    VRLT_CP_WAIT(kStages - 2);  // tile t has landed (this thread's copies)
    __syncthreads();            // everyone's copies; slot (t - 1) % kStages is free
    issue(c, produce, ring, (t + kStages - 1) % kStages);
    if (!produce.done(c)) produce.advance(c);

    const int k = c.k[consume.p], k0 = consume.chunk * kTileK, width = min(kTileK, k - k0);
    const int row = consume.group * kTileRows + warp;  // within the share
    if (row < consume.rows) {
      const __nv_bfloat16* wt =
          reinterpret_cast<const __nv_bfloat16*>(ring + (t % kStages) * kTileBytes) + warp * kTileK;
      for (int col = lane * 8; col < width; col += 32 * 8) {
        const uint4 wraw = *reinterpret_cast<const uint4*>(wt + col);
        const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wraw);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const uint4 xraw = *reinterpret_cast<const uint4*>(xs + r * k + k0 + col);
          const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xraw);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 a = __bfloat1622float2(w2[i]), b = __bfloat1622float2(x2[i]);
            acc[r] = fmaf(a.x, b.x, fmaf(a.y, b.y, acc[r]));
          }
        }
      }
      if (consume.last_chunk()) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float v = acc[r];
          for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
          if (lane == 0) {
            c.y[consume.p][static_cast<int64_t>(r) * c.n[consume.p] + consume.row0 + row] =
                __float2bfloat16_rn(v);
          }
          acc[r] = 0.f;
        }
      }
    }
    consume.advance(c);
  }
  // the projections this block holds no rows of, at the end: their barriers still count
  for (int p = x_of; p < c.num_proj - 1; ++p) between<R>(c, p, barriers, work);
}

template <int R>
cudaError_t launch(const Chain& c, int max_k, int blocks, cudaStream_t stream) {
  const int smem = kStages * kTileBytes + kWarps * (R + kPartial) * 4 + R * max_k * 2;
  void (*kernel)(Chain) = persistent_chain_kernel<R>;
#ifndef VRLT_EMULATE
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
#endif
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;  // every block resident: the barriers need it
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
#ifdef VRLT_EMULATE
  return emu::launch(cfg, kernel, c);
#else
  return cudaLaunchKernelEx(&cfg, kernel, c);
#endif
}

}  // namespace

extern "C" {

// rows: 1, 2, 4 or 8; tables: the [P] arrays of Chain, in its order from w to attn; counter:
// zero (the launch leaves it at blocks x its grid barriers: P - 1, and 2 more per ATTEND).
int vrlt_persistent_chain(const void* const* tables, const int* n, const int* k, const int* mode,
                          unsigned* counter, int num_proj, float eps, int heads, int ctx,
                          int pieces, int max_k, int rows, int blocks, void* stream) {
  using B = __nv_bfloat16;
  const Chain c{static_cast<const B* const*>(tables[0]), static_cast<B* const*>(tables[1]),
                n, k, mode,
                static_cast<const B* const*>(tables[2]), static_cast<B* const*>(tables[3]),
                static_cast<const B* const*>(tables[4]), static_cast<const B* const*>(tables[5]),
                static_cast<const B* const*>(tables[6]), static_cast<const B* const*>(tables[7]),
                static_cast<float* const*>(tables[8]), static_cast<B* const*>(tables[9]),
                counter, num_proj, eps, heads, ctx, pieces};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (rows) {
    case 1: return launch<1>(c, max_k, blocks, s);
    case 2: return launch<2>(c, max_k, blocks, s);
    case 4: return launch<4>(c, max_k, blocks, s);
    case 8: return launch<8>(c, max_k, blocks, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // extern "C"
