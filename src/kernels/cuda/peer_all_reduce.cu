#include "kernels/cuda/peer_all_reduce.h"

#include <algorithm>
#include <cuda/atomic>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kThreads = 512;

// Block b handles elements [b * kPeerBlockElems, (b + 1) * kPeerBlockElems) of every rank's tensor
// in every call, whatever n, and meets block b of the other ranks only: no grid-wide
// synchronization. A block's region is its own in every call, so the reuse rule below holds block
// by block even when consecutive calls have different sizes (with regions that depended on n, a
// block could overwrite a stretch that another block of a peer's previous call was still reading). Each rank writes its slice into
// every peer's inbox (stores over NVLink, which need no round trip), raises its flag there, waits
// for the peers' flags in its own memory, and sums its own tensor and its inbox in rank order.
// A call's data goes to the half of the sender's inbox slot that its parity picks; a rank reaches
// call k + 2 (the same half) only after every peer has raised its flag for call k + 1, i.e. has
// finished reading call k (its kernels run in order).
__global__ void __launch_bounds__(kThreads) peer_all_reduce_kernel(PeerAllReduceArgs a, bf16* t, int64_t n) {
  __shared__ uint32_t call_s;
  const int b = blockIdx.x;
  const int64_t begin = b * kPeerBlockElems, end = min(n, begin + kPeerBlockElems);
  pdl_begin();  // t is complete; the next kernel may be scheduled (it waits for this one to finish)
  if (threadIdx.x == 0) {
    call_s = a.calls[b] + 1;
    a.calls[b] = call_s;
  }
  __syncthreads();
  const uint32_t call = call_s;
  // Sender r's slot in an inbox, this call's half.
  auto slot = [&](int q, int r) { return a.staging[q] + (2 * int64_t{r} + (call & 1)) * kPeerHalfElems; };
  const bool vec = n % 8 == 0 && aligned16(t);
  for (int64_t i = begin + threadIdx.x * 8; i < end; i += int64_t{kThreads} * 8) {
    for (int q = 0; q < a.n_ranks; ++q) {
      if (q == a.rank) continue;
      bf16* to = slot(q, a.rank);
      if (vec) {
        *reinterpret_cast<uint4*>(to + i) = *reinterpret_cast<const uint4*>(t + i);
      } else {
        for (int64_t j = i; j < min(end, i + 8); ++j) to[j] = t[j];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < a.n_ranks && threadIdx.x != a.rank) {
    const int q = threadIdx.x;
    // Release: this block's stores to q's inbox (made visible to this thread by the barrier) before the flag.
    ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> to_peer(a.flags[q][b * kPeerMaxRanks + a.rank]);
    to_peer.store(call, ::cuda::memory_order_release);
    ::cuda::atomic_ref<uint32_t, ::cuda::thread_scope_system> from_peer(a.flags[a.rank][b * kPeerMaxRanks + q]);
    // The stop flag lives in host memory (a read crosses PCIe): looked at once every 4096 polls.
    for (uint32_t polls = 1; from_peer.load(::cuda::memory_order_acquire) < call; ++polls)
      if (polls % 4096 == 0 && *a.stop) break;
  }
  __syncthreads();
  for (int64_t i = begin + threadIdx.x * 8; i < end; i += int64_t{kThreads} * 8) {
    if (vec) {
      float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int q = 0; q < a.n_ranks; ++q) {
        float f[8];
        // A peer's slice through L2 (written over NVLink after this SM may have cached the line).
        unpack8(q == a.rank ? *reinterpret_cast<const uint4*>(t + i)
                            : __ldcg(reinterpret_cast<const uint4*>(slot(a.rank, q) + i)),
                f);
        for (int j = 0; j < 8; ++j) sum[j] += f[j];
      }
      *reinterpret_cast<uint4*>(t + i) = pack8(sum);
    } else {
      for (int64_t j = i; j < min(end, i + 8); ++j) {
        float sum = 0;
        for (int q = 0; q < a.n_ranks; ++q) {
          const bf16* from = q == a.rank ? t : slot(a.rank, q);
          const unsigned short raw = __ldcg(reinterpret_cast<const unsigned short*>(from + j));
          sum += __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(&raw));
        }
        const __nv_bfloat16 r = __float2bfloat16(sum);
        t[j] = *reinterpret_cast<const bf16*>(&r);
      }
    }
  }
}

}  // namespace

void launch_peer_all_reduce(const PeerAllReduceArgs& a, bf16* t, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int64_t blocks = (n + kPeerBlockElems - 1) / kPeerBlockElems;  // n <= kPeerHalfElems: at most kPeerMaxBlocks
  launch(peer_all_reduce_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), s, a, t, n);
}

}  // namespace dflash::cuda
