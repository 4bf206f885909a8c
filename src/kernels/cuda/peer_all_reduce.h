// A one-kernel all-reduce over the GPUs of this process for small bf16 tensors (a decode step's
// [rows, n_embd] partial sums): each rank writes its tensor into every peer's inbox over NVLink
// (peer access), raises a flag in the peer's memory, waits for the peers' flags in its own, and
// sums its own tensor and its inbox in rank order in float32. Same bits on every rank; with two
// ranks, the same bits as NCCL's bf16 sum. Timings in bench/results/README.md ("Tensor
// parallelism").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

constexpr int kPeerMaxRanks = 8;
constexpr int64_t kPeerMaxBytes = int64_t{512} << 10;  // larger tensors go through NCCL
constexpr int64_t kPeerHalfElems = kPeerMaxBytes / 2;   // one call's slot half, in elements
// Elements a block sums (a 16-row step of 4096 features: 16 blocks), the same in every call.
constexpr int64_t kPeerBlockElems = 4096;
constexpr int kPeerMaxBlocks = static_cast<int>(kPeerHalfElems / kPeerBlockElems);

// One rank's view of the group's memory (all device pointers, peers' through peer access).
struct PeerAllReduceArgs {
  bf16* staging[kPeerMaxRanks];   // each rank's inbox: a slot per sender of two halves (calls alternate)
  uint32_t* flags[kPeerMaxRanks]; // each rank's flags, [block][from rank]: the last call the sender has staged
  uint32_t* calls = nullptr;      // this rank's count of calls per block
  const volatile int* stop = nullptr;  // host-mapped: nonzero once the group stopped (waits give up)
  int rank = 0, n_ranks = 0;
};

// t [n elements, contiguous] = the sum over the ranks of their t (every rank calls it in the same
// order with the same n <= kPeerMaxBytes / 2).
void launch_peer_all_reduce(const PeerAllReduceArgs& a, bf16* t, int64_t n, cudaStream_t s);

}  // namespace dflash::cuda
