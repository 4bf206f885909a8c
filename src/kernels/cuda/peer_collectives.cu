#include "kernels/cuda/peer_collectives.h"

#include <algorithm>
#include <cuda/atomic>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/peer_words.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWordsPerThread = static_cast<int>(kPeerBlockWords / kThreads);  // two 16-byte pieces of 2 words
static_assert(kWordsPerThread == 4, "a thread moves two pieces");

enum class Op { kSum, kGather, kBroadcast, kArgmax };

// Argmax candidates: the larger value, the lower id on ties; NaN never wins.
__device__ __forceinline__ void keep_better(float& best, int64_t& best_i, float v, int64_t i) {
  if (v > best || (v == best && i < best_i)) best = v, best_i = i;
}

// The piece of rank r's words [w, w + 2) for this call in rank q's inbox: r's slot there, the half
// that the call's parity picks.
__device__ __forceinline__ uint4* piece(const PeerArgs& a, int q, int r, uint64_t call, int64_t w) {
  const int slot = r < q ? r : r - 1;
  return a.inbox[q] + (2 * int64_t{slot} + static_cast<int64_t>(call & 1)) * (kPeerMaxWords / 2) + w / 2;
}

// Waits until both words of the piece carry `flag`.
__device__ __forceinline__ void load_piece(const uint4* p, uint32_t flag, const volatile int* stop, uint32_t& d0,
                                           uint32_t& d1) {
  const uint4 v = poll_piece(p, load_volatile16(p), flag, stop);
  d0 = v.x, d1 = v.z;
}

// Block b moves words [b * kPeerBlockWords, (b + 1) * kPeerBlockWords) of every rank's data in
// every call, whatever the size (it writes its whole region, zeros past the end), and meets block
// b of the other ranks only: no grid-wide synchronization. Its calls are numbered (calls[b], the
// same sequence on every rank); a word's flag is the call's number, and a call writes the half of
// the inbox slot that its parity picks. Before it writes a peer's half, a block waits until that
// peer has finished call - 2 (the last to use the half): every rank acknowledges every call to
// every peer at its end. An exchange would not need this (a rank that has the peer's words of call
// c - 1 knows the peer finished c - 2), but a broadcast's root waits for nobody.
// kGather: rank q's word w goes to dst[(w / row_words) * dst_row_words + q * row_words + w % row_words]
// (its part's rows side by side with the other ranks' in each row of dst).
template <Op op>
__global__ void __launch_bounds__(kThreads) peer_kernel(PeerArgs a, const uint32_t* src, uint32_t* dst,
                                                        int64_t words, int64_t row_words, int64_t dst_row_words) {
  const int b = blockIdx.x, rank = a.rank, n = a.n_ranks;
  pdl_begin();  // src is complete; the next kernel may be scheduled (it waits for this one to finish)
  const uint64_t call = a.calls[b] + 1;
  const uint32_t flag = static_cast<uint32_t>(call);  // a region's flags are those of call - 2 or newer: never equal
  const bool sends = op != Op::kBroadcast || rank == 0;
  const int64_t w0 = int64_t{b} * kPeerBlockWords + int64_t{threadIdx.x} * kWordsPerThread;
  uint32_t mine[kWordsPerThread] = {0, 0, 0, 0};
  if (sends) {
    if (w0 + kWordsPerThread <= words && aligned16(src + w0)) {
      const uint4 v = *reinterpret_cast<const uint4*>(src + w0);
      mine[0] = v.x, mine[1] = v.y, mine[2] = v.z, mine[3] = v.w;
    } else {
      for (int i = 0; i < kWordsPerThread; ++i)
        if (w0 + i < words) mine[i] = src[w0 + i];
    }
    if (threadIdx.x < n && threadIdx.x != rank) {
      ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> done(a.acks[rank][b * kPeerMaxRanks + threadIdx.x]);
      for (uint32_t polls = 1; done.load(::cuda::memory_order_acquire) + 2 < call; ++polls)
        if (polls % 4096 == 0 && *a.stop) break;
    }
  }
  __syncthreads();  // every thread has read calls[b]; the peers' halves are free
  if (threadIdx.x == 0) a.calls[b] = call;
  if (sends)
    for (int q = 0; q < n; ++q) {
      if (q == rank) continue;
      uint4* to = piece(a, q, rank, call, w0);
      store_piece(to, mine[0], mine[1], flag);
      store_piece(to + 1, mine[2], mine[3], flag);
    }
  // Rank q's words of this thread (this rank's own from `mine`).
  auto words_of = [&](int q, uint32_t (&w)[kWordsPerThread]) {
    if (q == rank) {
      for (int i = 0; i < kWordsPerThread; ++i) w[i] = mine[i];
      return;
    }
    const uint4* from = piece(a, rank, q, call, w0);
    if (w0 < words) load_piece(from, flag, a.stop, w[0], w[1]);
    if (w0 + 2 < words) load_piece(from + 1, flag, a.stop, w[2], w[3]);
  };
  if (op == Op::kSum) {
    float sum[2 * kWordsPerThread] = {};
    for (int q = 0; q < n; ++q) {
      uint32_t w[kWordsPerThread] = {0, 0, 0, 0};
      words_of(q, w);
      for (int i = 0; i < kWordsPerThread; ++i) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        sum[2 * i] += x.x;
        sum[2 * i + 1] += x.y;
      }
    }
    for (int i = 0; i < kWordsPerThread; ++i)
      if (w0 + i < words) {
        const __nv_bfloat162 y = __floats2bfloat162_rn(sum[2 * i], sum[2 * i + 1]);
        dst[w0 + i] = *reinterpret_cast<const uint32_t*>(&y);
      }
  } else if (op == Op::kGather) {
    for (int q = 0; q < n; ++q) {
      uint32_t w[kWordsPerThread] = {0, 0, 0, 0};
      words_of(q, w);
      for (int i = 0; i < kWordsPerThread; ++i)
        if (w0 + i < words) {
          const int64_t at = w0 + i, row = at / row_words;
          dst[row * dst_row_words + q * row_words + (at - row * row_words)] = w[i];
        }
    }
  } else if (op == Op::kArgmax) {
    // Each two words are a row's candidate (value, id as float32): dst[row] = the best id over the
    // ranks in rank order (Backend::argmax_of_candidates), 0 where no rank has a value.
    float best[2] = {-FLT_MAX, -FLT_MAX};
    int64_t best_i[2] = {INT64_MAX, INT64_MAX};
    for (int q = 0; q < n; ++q) {
      uint32_t w[kWordsPerThread] = {0, 0, 0, 0};
      words_of(q, w);
      for (int i = 0; i < 2; ++i)
        keep_better(best[i], best_i[i], __uint_as_float(w[2 * i]), static_cast<int64_t>(__uint_as_float(w[2 * i + 1])));
    }
    for (int i = 0; i < 2; ++i)
      if (w0 + 2 * i < words) dst[w0 / 2 + i] = static_cast<uint32_t>(best_i[i] != INT64_MAX ? best_i[i] : 0);
  } else if (rank != 0) {
    uint32_t w[kWordsPerThread] = {0, 0, 0, 0};
    words_of(0, w);
    for (int i = 0; i < kWordsPerThread; ++i)
      if (w0 + i < words) dst[w0 + i] = w[i];
  }
  // Every thread has its peers' words: the loads have returned their values (used above), so the
  // acknowledgement may be a relaxed store (a release at system scope would first wait for this
  // block's stores to the peers to be acknowledged over NVLink).
  __syncthreads();
  if (threadIdx.x < n && threadIdx.x != rank) {
    ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system> done(a.acks[threadIdx.x][b * kPeerMaxRanks + rank]);
    done.store(call, ::cuda::memory_order_relaxed);
  }
}

template <Op op>
void launch_op(const PeerArgs& a, const void* src, void* dst, int64_t bytes, cudaStream_t s, int64_t row_bytes = 4,
               int64_t dst_row_bytes = 4) {
  if (bytes == 0) return;
  const int64_t words = bytes / 4;
  const int64_t blocks = (words + kPeerBlockWords - 1) / kPeerBlockWords;  // at most kPeerMaxBlocks
  launch(peer_kernel<op>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), s, a,
         static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), words, row_bytes / 4, dst_row_bytes / 4);
}

// A block waits for the same block of the other ranks, so a call's blocks must all be on the GPU
// at once (with more, progress would rest on the order in which the GPU places blocks): at most
// as many as the kernels' occupancy allows on every SM (the ranks' GPUs are of one kind).
int64_t peer_collective_max_bytes() {
  static const int64_t bytes = [] {
    int device = 0, sms = 0, fewest = kPeerMaxBlocks;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    for (const void* k : {reinterpret_cast<const void*>(peer_kernel<Op::kSum>),
                          reinterpret_cast<const void*>(peer_kernel<Op::kGather>),
                          reinterpret_cast<const void*>(peer_kernel<Op::kBroadcast>),
                          reinterpret_cast<const void*>(peer_kernel<Op::kArgmax>)}) {
      int per_sm = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, kThreads, 0));
      fewest = std::min(fewest, per_sm * sms);
    }
    return std::min(kPeerMaxBytes, int64_t{fewest} * kPeerBlockWords * 4);
  }();
  return bytes;
}

constexpr int kPushThreads = 256;

// Word w of t (two bf16) = the sum over the ranks of their word w in rank order, in float32 (this
// rank's from t, the peers' from its push inbox, where their products stored them): a thread a
// word, so that a block's loads are all in flight at once.
__global__ void __launch_bounds__(kPushThreads) pushed_sum_kernel(PeerPush p, uint32_t* t, int64_t words) {
  pdl_begin();  // the product (and every earlier sum) is complete
  const int64_t w = int64_t{blockIdx.x} * kPushThreads + threadIdx.x;
  const uint32_t own = w < words ? t[w] : 0u;  // requested before the call's number, its round trip beside that one
  const ReceivedCall rc = receive_pushed_call(p);
  const uint32_t flag = static_cast<uint32_t>(rc.call);
  const int64_t half = static_cast<int64_t>(rc.call & 1) * kPushMaxWords;
  if (w < words) {
    float s0 = 0.0f, s1 = 0.0f;
    for (int q = 0; q < p.n_ranks; ++q) {
      const uint32_t d = q == p.rank ? own : load_flagged(p.from[q] + half + w, flag, p.stop);
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&d));
      s0 += x.x;
      s1 += x.y;
    }
    const __nv_bfloat162 y = __floats2bfloat162_rn(s0, s1);
    t[w] = *reinterpret_cast<const uint32_t*>(&y);
  }
  received_call_done(p, rc);
}

// The peers' words (the j-th peer: rank j, or j + 1 from this rank on) into their columns of all:
// a thread a word.
__global__ void __launch_bounds__(kPushThreads) pushed_gather_kernel(PeerPush p, uint32_t* all, int64_t rows,
                                                                     int64_t row_words, int64_t all_row_words) {
  pdl_begin();  // the product (and every earlier exchange) is complete
  const ReceivedCall rc = receive_pushed_call(p);
  const uint64_t call = rc.call;
  const int64_t words = rows * row_words;
  const int64_t i = int64_t{blockIdx.x} * kPushThreads + threadIdx.x;
  if (i < (p.n_ranks - 1) * words) {
    const int j = static_cast<int>(i / words), q = j < p.rank ? j : j + 1;
    const int64_t w = i % words, row = w / row_words;
    const uint32_t flag = static_cast<uint32_t>(call);
    const int64_t half = static_cast<int64_t>(call & 1) * kPushMaxWords;
    all[row * all_row_words + q * row_words + (w - row * row_words)] = load_flagged(p.from[q] + half + w, flag, p.stop);
  }
  received_call_done(p, rc);
}

}  // namespace

bool peer_push_fits(const void* out, int64_t rows, int64_t cols, int64_t stride) {
  return cols % 2 == 0 && stride % 2 == 0 && rows * cols / 2 <= kPushMaxWords && reinterpret_cast<uintptr_t>(out) % 4 == 0;
}

void launch_peer_pushed_sum(const PeerPush& p, bf16* t, int64_t n, cudaStream_t s) {
  const int64_t words = n / 2;
  if (words == 0) return;
  launch(pushed_sum_kernel, dim3(static_cast<unsigned>((words + kPushThreads - 1) / kPushThreads)), dim3(kPushThreads),
         s, p, reinterpret_cast<uint32_t*>(t), words);
}

void launch_peer_pushed_gather(const PeerPush& p, bf16* all, int64_t rows, int64_t cols, int64_t all_stride,
                               cudaStream_t s) {
  const int64_t words = (p.n_ranks - 1) * rows * (cols / 2);
  if (words == 0) return;
  launch(pushed_gather_kernel, dim3(static_cast<unsigned>((words + kPushThreads - 1) / kPushThreads)),
         dim3(kPushThreads), s, p, reinterpret_cast<uint32_t*>(all), rows, cols / 2, all_stride / 2);
}

bool peer_collective_fits(const void* p, int64_t bytes, int64_t max_bytes) {
  return bytes % 4 == 0 && bytes <= std::min(max_bytes, peer_collective_max_bytes()) &&
         reinterpret_cast<uintptr_t>(p) % 4 == 0;
}

void launch_peer_all_reduce(const PeerArgs& a, bf16* t, int64_t n, cudaStream_t s) {
  launch_op<Op::kSum>(a, t, t, 2 * n, s);
}

bool peer_all_gather_fits(const void* part, const void* all, int64_t rows, int64_t row_bytes, int64_t all_row_bytes) {
  return row_bytes % 4 == 0 && all_row_bytes % 4 == 0 && peer_collective_fits(part, rows * row_bytes, kPeerMaxBytes) &&
         reinterpret_cast<uintptr_t>(all) % 4 == 0;
}

void launch_peer_all_gather(const PeerArgs& a, const void* part, void* all, int64_t rows, int64_t row_bytes,
                            int64_t all_row_bytes, cudaStream_t s) {
  launch_op<Op::kGather>(a, part, all, rows * row_bytes, s, row_bytes, all_row_bytes);
}

void launch_peer_broadcast(const PeerArgs& a, void* t, int64_t bytes, cudaStream_t s) {
  launch_op<Op::kBroadcast>(a, t, t, bytes, s);
}

void launch_peer_argmax(const PeerArgs& a, const float* cand, int32_t* ids, int64_t rows, cudaStream_t s) {
  launch_op<Op::kArgmax>(a, cand, ids, rows * 8, s);
}

}  // namespace dflash::cuda
