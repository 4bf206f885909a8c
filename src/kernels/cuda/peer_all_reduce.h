// A one-kernel all-reduce over the GPUs of this process for small bf16 tensors (a decode step's
// [rows, n_embd] partial sums): each rank copies its tensor to its staging buffer, tells every
// peer through a flag in the peer's memory, waits for theirs, and sums every rank's buffer in rank
// order in float32 over NVLink (peer access). On two H100s a [1..32, 4096] tensor takes 7.6-9 us
// this way, 12.7-15.8 us through NCCL (bench/results/bench_step_h100x2_qwen3-8b-shape_tp2.txt).
// Same bits on every rank; with two ranks, the same bits as NCCL's bf16 sum.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

constexpr int kPeerMaxRanks = 8;
constexpr int kPeerMaxBlocks = 32;
constexpr int64_t kPeerMaxBytes = int64_t{512} << 10;  // larger tensors go through NCCL

// One rank's view of the group's memory (all device pointers, peers' through peer access).
struct PeerAllReduceArgs {
  bf16* staging[kPeerMaxRanks];   // each rank's staging buffer: two halves of kPeerMaxBytes (calls alternate)
  uint32_t* flags[kPeerMaxRanks]; // each rank's flags, [block][from rank]: the last call the sender has staged
  uint32_t* calls = nullptr;      // this rank's count of calls per block
  const volatile int* stop = nullptr;  // host-mapped: nonzero once the group stopped (waits give up)
  int rank = 0, n_ranks = 0;
};

// t [n elements, contiguous] = the sum over the ranks of their t (every rank calls it in the same
// order with the same n <= kPeerMaxBytes / 2).
void launch_peer_all_reduce(const PeerAllReduceArgs& a, bf16* t, int64_t n, cudaStream_t s);

}  // namespace dflash::cuda
