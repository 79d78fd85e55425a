// Probe: a persistent chain of few-row projections that keeps the weight stream going across its
// grid barriers (docs/design/runner.md §4; benchmarks/probes/persistent_chain.py times it).
//
// One block per SM, launched cooperatively, runs P projections y_p = x_p @ W_p^T (bf16, fp32
// sums) of R rows one after another (every N and K a multiple of 8); x_{p+1} is the first K_{p+1}
// columns of y_p, so every
// projection waits for the one before it, as a decode layer's do. Block b owns an even share of
// each W_p's rows and streams them as tiles of 8 rows x 1024 columns through a ring of STAGES
// tiles in shared memory (cp.async). The ring runs ahead through the block's tiles of all
// projections: while a block waits at the barrier after projection p, the first tiles of its
// share of W_{p+1} (no kernel writes them) are already on their way, so the barrier costs the
// latency of reading x_{p+1} from the L2, not a cold weight stream. Each of 8 warps takes one
// row of a tile; its lanes run along K.
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

struct Chain {
  const __nv_bfloat16* const* w;  // [P] weights [N_p, K_p], rows contiguous
  __nv_bfloat16* const* y;        // [P] outputs [R, N_p]
  const int* n;                   // [P]
  const int* k;                   // [P]
  const __nv_bfloat16* x0;        // [R, K_0]
  unsigned* counter;              // grid barrier arrivals: zero at launch
  int num_proj;
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
  __device__ bool last_of_projection() const { return group == groups - 1 && last_chunk(); }
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

// x of projection p into shared memory: rows of R x K_p from the kernel's input or y_{p-1}, in
// 16-byte loads from the L2 (other blocks wrote y_{p-1}; K and N are multiples of 8).
template <int R>
__device__ void load_x(const Chain& c, int p, __nv_bfloat16* xs) {
  const int k8 = c.k[p] / 8;
  const __nv_bfloat16* src = p == 0 ? c.x0 : c.y[p - 1];
  const int stride = p == 0 ? c.k[p] : c.n[p - 1];
  for (int i = threadIdx.x; i < R * k8; i += kThreads) {
    const int64_t at = static_cast<int64_t>(i / k8) * stride + (i % k8) * 8;
    reinterpret_cast<uint4*>(xs)[i] = VRLT_LOAD_L2(reinterpret_cast<const uint4*>(src + at));
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

template <int R>
__global__ void __launch_bounds__(kThreads) persistent_chain_kernel(const Chain c) {
  VRLT_DYNAMIC_SMEM(smem);
  unsigned char* ring = smem;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + kStages * kTileBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  Cursor produce, consume;
  produce.enter(c, 0);
  consume.enter(c, 0);
  for (int s = 0; s < kStages - 1; ++s) {
    issue(c, produce, ring, s);
    if (!produce.done(c)) produce.advance(c);
  }
  load_x<R>(c, 0, xs);
  int x_of = 0;  // the projection whose x is in xs
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  for (int t = 0; !consume.done(c); ++t) {
    if (consume.p != x_of) {  // the projections before it are complete everywhere
      for (int p = x_of; p < consume.p; ++p) grid_barrier(c.counter, (p + 1) * gridDim.x);
      x_of = consume.p;
      load_x<R>(c, x_of, xs);
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
  for (int p = x_of; p < c.num_proj - 1; ++p) grid_barrier(c.counter, (p + 1) * gridDim.x);
}

template <int R>
cudaError_t launch(const Chain& c, int max_k, int blocks, cudaStream_t stream) {
  const int smem = kStages * kTileBytes + R * max_k * 2;
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

// rows: 1, 2, 4 or 8; counter: zero (the launch leaves it at blocks x (num_proj - 1)).
int vrlt_persistent_chain(const void* w, void* y, const int* n, const int* k, const void* x0,
                          unsigned* counter, int num_proj, int max_k, int rows, int blocks,
                          void* stream) {
  const Chain c{static_cast<const __nv_bfloat16* const*>(w), static_cast<__nv_bfloat16* const*>(y),
                n, k, static_cast<const __nv_bfloat16*>(x0), counter, num_proj};
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
