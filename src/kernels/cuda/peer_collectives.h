// One-kernel collectives over the GPUs of this process for small tensors (a decode step's
// [rows, n_embd] partial sums, its logits, the draft's context): all-reduce (bf16 sum), all-gather,
// broadcast, and the argmax of a vocabulary split's candidates. Each rank stores its data straight
// into every peer's inbox over NVLink (peer access) in 8-byte words of 4 data bytes and a 4-byte
// flag (the call's number), so a receiver knows a word has arrived when its flag is the call's: no
// fence, no separate flag, one trip over NVLink. The all-reduce sums its own tensor and its inbox
// in rank order in float32: the same bits on every rank, and with two ranks those of NCCL's bf16
// sum. Timings in bench/results/README.md ("Tensor parallelism").
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace dflash::cuda {

constexpr int kPeerMaxRanks = 8;
constexpr int64_t kPeerMaxBytes = int64_t{4} << 20;           // a rank's data in one call; more goes through NCCL
// The peer all-reduce's limit: 2 MiB over two ranks, 512 KiB over more (each rank sends its whole
// tensor to every peer), NCCL's ring beyond. Two H200s, DFlash batch 16 (sums of 256 rows, 2 MiB):
// 9.54 -> 9.10 ms a step against NCCL; at 1 MiB the two take the same (19.4 and 20.1 us), at 4 MiB
// (DFlash batch 32) NCCL is slightly faster (bench/results, "the peer all-reduce up to 2 MiB").
// Over four H200s 1-2 MiB through the peer kernel nearly doubled the DFlash batch 8 / 16 steps
// (bench/results, "the peer all-reduce over four GPUs").
constexpr int64_t kPeerAllReduceMaxBytes = int64_t{512} << 10;
constexpr int64_t kPeerAllReduceTwoRanksMaxBytes = int64_t{2} << 20;
constexpr int64_t peer_all_reduce_max_bytes(int n_ranks) {
  return n_ranks == 2 ? kPeerAllReduceTwoRanksMaxBytes : kPeerAllReduceMaxBytes;
}
constexpr int64_t kPeerMaxWords = kPeerMaxBytes / 4;          // 4-byte data words
// Data words a block moves (8 KiB: a 16-row step of 4096 bf16 features takes 16 blocks), the same in every call.
constexpr int64_t kPeerBlockWords = 2048;
constexpr int kPeerMaxBlocks = static_cast<int>(kPeerMaxWords / kPeerBlockWords);
// A rank's inbox: a slot per peer of two halves (calls alternate), each of kPeerMaxWords words of 8 bytes.
constexpr int64_t kPeerInboxBytesPerPeer = 2 * kPeerMaxWords * 8;

// One rank's view of the group's memory (all device pointers, peers' through peer access).
struct PeerArgs {
  uint4* inbox[kPeerMaxRanks];     // each rank's inbox (kPeerInboxBytesPerPeer for each of its peers)
  uint64_t* acks[kPeerMaxRanks];   // each rank's [block][from rank]: the last call the peer has finished
  uint64_t* calls = nullptr;       // this rank's count of calls per block
  const volatile int* stop = nullptr;  // host-mapped: nonzero once the group stopped (waits give up)
  int rank = 0, n_ranks = 0;
};

// Pushed exchanges: the product on each rank stores its output's words into the peers' push
// inboxes as its blocks finish (launch_skinny_gemm_pushed), so that the words travel while the
// product still runs; then launch_peer_pushed_sum adds its own output and the peers' words in rank
// order (the all-reduce's float32 sum, the same bits), or launch_peer_pushed_gather puts the peers'
// words beside its own output (the all-gather of a vocabulary split's logits). Word w of a product
// of [rows, cols] is features 2 (w % (cols / 2)) and 2 (w % (cols / 2)) + 1 of token row
// w / (cols / 2). Their own inbox and call count: only exchanges (every rank sends) use them, so a
// rank that has its peers' words of call c - 1 knows they are done reading call c - 2's half of its
// slot there (it is the half that call c writes), and no acknowledgements are needed.
constexpr int64_t kPushMaxWords = kPeerMaxWords;  // 4-byte data words (2 bf16) a rank sends in one call
constexpr int64_t kPushInboxBytesPerPeer = 2 * kPushMaxWords * 8;
struct PeerPush {
  uint2* to[kPeerMaxRanks] = {};          // rank q's push inbox, this rank's slot there (null: this rank)
  const uint2* from[kPeerMaxRanks] = {};  // this rank's push inbox, rank q's slot
  uint64_t* calls = nullptr;              // this rank's count of pushed exchanges
  unsigned* done = nullptr;               // blocks of the exchange's receiving kernel that have finished
  const volatile int* stop = nullptr;     // as PeerArgs::stop
  int rank = 0, n_ranks = 0;              // n_ranks == 0: no push (a product's output stays local)
};
// Whether a product's [rows, cols] bf16 output can be exchanged this way (4-byte aligned words).
bool peer_push_fits(const void* out, int64_t rows, int64_t cols, int64_t stride);
// t [n bf16, contiguous] = the sum over the ranks of their t, which their products pushed.
void launch_peer_pushed_sum(const PeerPush& p, bf16* t, int64_t n, cudaStream_t s);
// all [rows, n_ranks * cols] (row stride all_stride): rank q's product [rows, cols], which it
// pushed, into columns q * cols, ... of every row; this rank's product is there already.
void launch_peer_pushed_gather(const PeerPush& p, bf16* all, int64_t rows, int64_t cols, int64_t all_stride,
                               cudaStream_t s);

// Every rank calls the same collectives in the same order with the same sizes. What fits: bytes a
// multiple of 4, at most max_bytes (kPeerMaxBytes, all-reduce: peer_all_reduce_max_bytes) and what the
// GPU holds at once (a block waits for the same block of the other ranks); pointers 4-byte aligned.
bool peer_collective_fits(const void* p, int64_t bytes, int64_t max_bytes);
// The same for launch_peer_all_gather's operands (rows of row_bytes, all's rows all_row_bytes apart).
bool peer_all_gather_fits(const void* part, const void* all, int64_t rows, int64_t row_bytes, int64_t all_row_bytes);
// t [n bf16, contiguous: 2n bytes] = the sum over the ranks of their t.
void launch_peer_all_reduce(const PeerArgs& a, bf16* t, int64_t n, cudaStream_t s);
// Row i of all (all_row_bytes apart) = row i of every rank's part (rows of row_bytes, contiguous) side
// by side, rank r's at byte r * row_bytes of the row. row_bytes and all_row_bytes: multiples of 4.
void launch_peer_all_gather(const PeerArgs& a, const void* part, void* all, int64_t rows, int64_t row_bytes,
                            int64_t all_row_bytes, cudaStream_t s);
// t = rank 0's t.
void launch_peer_broadcast(const PeerArgs& a, void* t, int64_t bytes, cudaStream_t s);
// ids [rows] on every rank = the argmax chosen from every rank's candidates (cand: [rows, 2]
// float32, contiguous; Backend::argmax_candidates), as Backend::argmax_of_candidates chooses.
void launch_peer_argmax(const PeerArgs& a, const float* cand, int32_t* ids, int64_t rows, cudaStream_t s);

}  // namespace dflash::cuda
