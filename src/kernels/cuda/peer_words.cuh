// The peer collectives' flagged words (peer_collectives.h): 4 data bytes and a 4-byte flag, the
// call's number, stored together in 8 bytes over NVLink, so that a receiver that sees the flag
// has the data (an aligned 8-byte store arrives whole). A 16-byte piece holds two words,
// {data, flag, data, flag}; its halves may arrive apart.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/peer_collectives.h"

namespace dflash::cuda {

__device__ __forceinline__ void store_flagged(uint2* p, uint32_t word, uint32_t flag) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(word), "r"(flag) : "memory");
}

// One 16-byte store of two flagged words.
__device__ __forceinline__ void store_piece(uint4* p, uint32_t d0, uint32_t d1, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(flag), "r"(d1), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 load_volatile16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// The piece at p once both of its words carry `flag`, starting from v (an earlier load of it, so
// that a caller may have many loads in flight before it waits). The stop flag lives in host
// memory (a read crosses PCIe): looked at once every 4096 polls; the words are then meaningless.
__device__ __forceinline__ uint4 poll_piece(const uint4* p, uint4 v, uint32_t flag, const volatile int* stop) {
  for (uint32_t polls = 1; !(v.y == flag && v.w == flag); ++polls) {
    if (polls % 4096 == 0 && *stop) break;
    v = load_volatile16(p);
  }
  return v;
}

// Waits until the word at p carries `flag` (stop as poll_piece).
__device__ __forceinline__ uint32_t load_flagged(const uint2* p, uint32_t flag, const volatile int* stop) {
  for (uint32_t polls = 1;; ++polls) {
    uint32_t x, f;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(x), "=r"(f) : "l"(p) : "memory");
    if (f == flag || (polls % 4096 == 0 && *stop)) return x;
  }
}

// The number of the pushed exchange that a producing kernel sends (after its wait: the kernel
// that received the previous exchange has advanced the count by then).
__device__ __forceinline__ uint64_t push_call(const PeerPush& p) {
  return *reinterpret_cast<const volatile uint64_t*>(p.calls) + 1;
}

// Word `index` of this rank's output in call `call` of a pushed exchange (peer_collectives.h:
// word w holds features 2w and 2w + 1 of the flattened [rows, cols] output), flagged, into every
// peer's push inbox.
__device__ __forceinline__ void push_word(const PeerPush& p, uint64_t call, int64_t index, uint32_t word) {
  const int64_t at = static_cast<int64_t>(call & 1) * kPushMaxWords + index;
  for (int q = 0; q < p.n_ranks; ++q)
    if (q != p.rank) store_flagged(p.to[q] + at, word, static_cast<uint32_t>(call));
}

// A pushed exchange's call number as a receiving kernel's block has it: thread 0 reads the
// number, then counts the block in (`arrived`: the blocks counted before it; thread 0's only).
struct ReceivedCall {
  uint64_t call;
  unsigned arrived;
};

// Read by every block of a kernel that receives a pushed exchange (the whole block must call
// this). The block is counted only after the barrier, which the number's read has completed by,
// so no block can advance the number before every block has it; the count's answer is awaited
// only in received_call_done, so its round trip goes under the block's own work.
__device__ __forceinline__ ReceivedCall receive_pushed_call(const PeerPush& p) {
  __shared__ uint64_t call_s;
  if (threadIdx.x == 0) call_s = *reinterpret_cast<const volatile uint64_t*>(p.calls) + 1;
  __syncthreads();
  const unsigned arrived = threadIdx.x == 0 ? atomicAdd(p.done, 1u) : 0u;
  return {call_s, arrived};
}

// At the end of a receiving block: the last block counted advances the number, so that the next
// product (which waits for this kernel) reads its successor.
__device__ __forceinline__ void received_call_done(const PeerPush& p, const ReceivedCall& c) {
  if (threadIdx.x == 0 && c.arrived == gridDim.x - 1) {
    *p.done = 0;
    *reinterpret_cast<volatile uint64_t*>(p.calls) = c.call;
  }
}

}  // namespace dflash::cuda
