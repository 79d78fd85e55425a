// An emulation of the CUDA features the native kernels and the CUDA probes use, for running them
// on the CPU in tests (tests/kernels/emulation.py): every thread of a cluster is a host thread;
// shuffles, __syncthreads and cluster barriers are std::barrier waits; shared memory is one arena
// per block (static, then dynamic), laid out alike in every block, so that map_shared_rank is an
// offset into another block's arena; cp.async copies at once; atomics are std::atomic_ref.
// Clusters run one after another; a cooperative launch runs its whole grid at once (its blocks
// may wait for each other). The kernel source includes it through `-include` with VRLT_EMULATE
// defined, and replaces `__shared__`, inline PTX and the early-launch instructions by the hooks
// below (VRLT_*).
#pragma once

#include <cuda_runtime.h>

#include <math.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

// the built-in variables, per host thread
inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 gridDim, blockDim;

namespace emu {

constexpr size_t kArena = 64 * 1024;  // shared memory per block

struct Cluster {
  explicit Cluster(int blocks, int threads, size_t dynamic)
      : size(blocks),
        all(blocks * threads),
        arenas(blocks, std::vector<unsigned char>(kArena + dynamic)),
        exchange(blocks * threads) {
    for (int b = 0; b < blocks; ++b) {
      block_bars.push_back(std::make_unique<std::barrier<>>(threads));
    }
    for (int w = 0; w < blocks * threads / 32; ++w) {
      warp_bars.push_back(std::make_unique<std::barrier<>>(32));
    }
  }
  int size;
  std::barrier<> all;
  std::vector<std::vector<unsigned char>> arenas;
  std::vector<std::unique_ptr<std::barrier<>>> block_bars, warp_bars;
  std::vector<uint32_t> exchange;  // one word per thread, for shuffles
};

inline thread_local Cluster* cluster_of = nullptr;
inline thread_local int rank = 0;           // the block's rank in its cluster
inline thread_local size_t cursor = 0;      // next free byte of the block's arena

template <typename T>
T* shared() {
  cursor = (cursor + alignof(T) - 1) / alignof(T) * alignof(T);
  T* at = reinterpret_cast<T*>(cluster_of->arenas[rank].data() + cursor);
  cursor += sizeof(T);
  return at;
}

inline int global_thread() { return rank * static_cast<int>(blockDim.x) + threadIdx.x; }

template <typename T>
T shfl_xor(T v, int offset) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const int me = global_thread(), warp = me / 32;
  std::barrier<>& bar = *cluster_of->warp_bars[warp];
  std::memcpy(&cluster_of->exchange[me], &v, 4);
  bar.arrive_and_wait();
  T got;
  std::memcpy(&got, &cluster_of->exchange[(me & ~31) | ((me & 31) ^ offset)], 4);
  bar.arrive_and_wait();
  return got;
}

// Runs `kernel` over the launch's grid, cluster by cluster (clusters along x).
template <typename P>
cudaError_t launch(const cudaLaunchConfig_t& cfg, void (*kernel)(P), const P& params) {
  const dim3 grid = cfg.gridDim, block = cfg.blockDim;
  unsigned cluster_x = 1;
  for (unsigned i = 0; i < cfg.numAttrs; ++i) {
    if (cfg.attrs[i].id == cudaLaunchAttributeClusterDimension) {
      cluster_x = cfg.attrs[i].val.clusterDim.x;
    }
    if (cfg.attrs[i].id == cudaLaunchAttributeCooperative && cfg.attrs[i].val.cooperative) {
      if (grid.y != 1 || grid.z != 1) return cudaErrorInvalidValue;
      cluster_x = grid.x;  // every block at once
    }
  }
  if (grid.x % cluster_x || block.y != 1 || block.z != 1 || block.x % 32) {
    return cudaErrorInvalidValue;
  }
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x0 = 0; x0 < grid.x; x0 += cluster_x) {
        Cluster cluster(cluster_x, block.x, cfg.dynamicSmemBytes);
        std::vector<std::thread> threads;
        for (unsigned r = 0; r < cluster_x; ++r) {
          for (unsigned t = 0; t < block.x; ++t) {
            threads.emplace_back([&, r, t] {
              cluster_of = &cluster;
              rank = r;
              cursor = 0;
              threadIdx = uint3{t, 0, 0};
              blockIdx = uint3{x0 + r, y, z};
              gridDim = grid;
              blockDim = block;
              kernel(params);
            });
          }
        }
        for (std::thread& th : threads) th.join();
      }
    }
  }
  return cudaSuccess;
}

}  // namespace emu

#define __launch_bounds__(...)
#define VRLT_SHARED(type, name) type& name = *emu::shared<type>()
#define VRLT_GDC(instruction) ((void)0)
#define VRLT_DYNAMIC_SMEM(name) \
  unsigned char* name = emu::cluster_of->arenas[emu::rank].data() + emu::kArena
#define VRLT_CP_ASYNC16(dst, src) std::memcpy((dst), (src), 16)
#define VRLT_CP_COMMIT() ((void)0)
#define VRLT_CP_WAIT(n) ((void)0)
#define VRLT_LOAD_ACQUIRE(ptr, out)                                                  \
  ((out) = std::atomic_ref<unsigned>(*(ptr)).load(std::memory_order_acquire),        \
   std::this_thread::yield())  // a spinning waiter lets the blocks it waits for run
#define VRLT_LOAD_L2(ptr) (*(ptr))

inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return std::atomic_ref<unsigned>(*address).fetch_add(value, std::memory_order_acq_rel);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float rsqrtf(float x) { return 1.f / sqrtf(x); }

inline void __syncthreads() { emu::cluster_of->block_bars[emu::rank]->arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned, T v, int offset) {
  return emu::shfl_xor(v, offset);
}

namespace cg {
struct cluster_group {
  void sync() { emu::cluster_of->all.arrive_and_wait(); }
  template <typename T>
  T* map_shared_rank(T* p, int r) {
    const unsigned char* mine = emu::cluster_of->arenas[emu::rank].data();
    const ptrdiff_t offset = reinterpret_cast<const unsigned char*>(p) - mine;
    return reinterpret_cast<T*>(emu::cluster_of->arenas[r].data() + offset);
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cg

extern "C" const char* cudaGetErrorString(cudaError_t) { return "an emulated launch failed"; }
