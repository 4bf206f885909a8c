// The one-way trip of a block of words between two GPUs over NVLink, by ping-pong, in four ways of
// flagging them (the TP exchange's question: is its trip latency or bytes?).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o peer_trip probe_h200x2_peer_trip.cu && ./peer_trip
// Kernels on GPU 0 and GPU 1 run at once; block b of each owns chunk b of the data. GPU 0's block
// stores its chunk into GPU 1's inbox and waits for GPU 1's block to store it back into GPU 0's;
// GPU 1's block waits, checks, then stores. Per trip: the run's time / (2 x iterations).
//   word8:  8-byte words {data, flag} (the engine's exchange today: 2 bytes on the wire a data byte)
//   piece16: 16-byte pieces {d, d, d, flag} (relies on a 16-byte store arriving whole)
//   line128: 128-byte lines of 31 data words and a flag, stored by 8 lanes in one warp store
//            (relies on such a line arriving whole, as NCCL's LL128 protocol does on NVLink)
//   fence:  plain 16-byte data stores, a system fence, then one flag a block
// Every received data word is checked against what was sent: "bad" counts words that differed
// once their flag was seen (a protocol whose assumption failed). "under load": the same with a
// kernel on each GPU reading a 2 GiB buffer at once on the other SM slots (as a product streaming
// its weights does while the ranks meet).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

enum Mode { kWord8, kPiece16, kLine128, kFence };
static const char* kModeName[] = {"word8", "piece16", "line128", "fence"};
constexpr int kThreads = 256;

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t value(uint32_t iter, uint32_t index) { return iter * 2654435761u ^ (index * 40503u + 7u); }

__device__ __forceinline__ void st16(void* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st8(void* p, uint32_t a, uint32_t b) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ uint2 ld8(const void* p) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

// Bytes of the inbox a block's chunk of `words` data words takes in each mode.
__host__ __device__ inline int64_t chunk_bytes(Mode m, int words) {
  switch (m) {
    case kWord8: return int64_t{words} * 8;
    case kPiece16: return int64_t{(words + 2) / 3} * 16;
    case kLine128: return int64_t{(words + 30) / 31} * 128;
    default: return int64_t{(words + 3) / 4} * 16 + 128;  // data, then the block's flag line
  }
}

template <Mode M>
__device__ void send(uint8_t* to, int words, uint32_t iter, uint32_t flag, int b) {
  const int t = threadIdx.x;
  const uint32_t base = static_cast<uint32_t>(b) * words;
  if constexpr (M == kWord8) {
    for (int i = t; i < words; i += kThreads) st8(to + 8 * int64_t{i}, value(iter, base + i), flag);
  } else if constexpr (M == kPiece16) {
    for (int p = t; 3 * p < words; p += kThreads) {
      const uint32_t i = 3 * p;
      st16(to + 16 * int64_t{p}, {value(iter, base + i), value(iter, base + i + 1), value(iter, base + i + 2), flag});
    }
  } else if constexpr (M == kLine128) {
    const int lines = (words + 30) / 31;
    for (int u = t; u < ((lines * 8 + 31) / 32) * 32; u += kThreads) {  // whole warps take part
      const int l = u / 8, part = u % 8;
      if (l >= lines) continue;
      const uint32_t i = 31 * l + 4 * part;
      uint4 v{value(iter, base + i), value(iter, base + i + 1), value(iter, base + i + 2),
              part == 7 ? flag : value(iter, base + i + 3)};
      st16(to + 128 * int64_t{l} + 16 * part, v);
    }
  } else {
    const int pieces = (words + 3) / 4;
    for (int p = t; p < pieces; p += kThreads) {
      const uint32_t i = 4 * p;
      uint4 v{value(iter, base + i), value(iter, base + i + 1), value(iter, base + i + 2), value(iter, base + i + 3)};
      *reinterpret_cast<uint4*>(to + 16 * int64_t{p}) = v;
    }
    __threadfence_system();
    __syncthreads();
    if (t == 0) st8(to + 16 * int64_t{pieces}, flag, flag);
  }
}

// Waits for the block's chunk of call `flag`, checks it; returns the words that differed.
template <Mode M>
__device__ int receive(const uint8_t* in, int words, uint32_t iter, uint32_t flag, int b) {
  const int t = threadIdx.x;
  const uint32_t base = static_cast<uint32_t>(b) * words;
  int bad = 0;
  if constexpr (M == kWord8) {
    for (int i = t; i < words; i += kThreads) {
      uint2 v;
      do v = ld8(in + 8 * int64_t{i});
      while (v.y != flag);
      bad += v.x != value(iter, base + i);
    }
  } else if constexpr (M == kPiece16) {
    for (int p = t; 3 * p < words; p += kThreads) {
      uint4 v;
      do v = ld16(in + 16 * int64_t{p});
      while (v.w != flag);
      const uint32_t i = 3 * p;
      bad += (v.x != value(iter, base + i)) + (i + 1 < words && v.y != value(iter, base + i + 1)) +
             (i + 2 < words && v.z != value(iter, base + i + 2));
    }
  } else if constexpr (M == kLine128) {
    const int lines = (words + 30) / 31;
    for (int u = t; u < ((lines * 8 + 31) / 32) * 32; u += kThreads) {
      const int l = u / 8, part = u % 8;
      const bool mine = l < lines;
      uint4 v{};
      for (;;) {
        if (mine) v = ld16(in + 128 * int64_t{l} + 16 * part);
        if (__all_sync(0xffffffffu, !mine || part != 7 || v.w == flag)) break;
      }
      if (!mine) continue;
      const uint32_t i = 31 * l + 4 * part;
      const uint32_t got[4] = {v.x, v.y, v.z, v.w};
      for (int e = 0; e < (part == 7 ? 3 : 4); ++e)
        if (i + e < static_cast<uint32_t>(words)) bad += got[e] != value(iter, base + i + e);
    }
  } else {
    const int pieces = (words + 3) / 4;
    if (t == 0) {
      uint2 f;
      do f = ld8(in + 16 * int64_t{pieces});
      while (f.x != flag);
    }
    __syncthreads();
    for (int p = t; p < pieces; p += kThreads) {
      const uint4 v = ld16(in + 16 * int64_t{p});
      const uint32_t i = 4 * p;
      const uint32_t got[4] = {v.x, v.y, v.z, v.w};
      for (int e = 0; e < 4; ++e)
        if (i + e < static_cast<uint32_t>(words)) bad += got[e] != value(iter, base + i + e);
    }
  }
  return bad;
}

// first: GPU 0's side (sends, then waits); else GPU 1's (waits, then sends back).
template <Mode M>
__global__ void __launch_bounds__(kThreads) pingpong(uint8_t* peer_inbox, const uint8_t* my_inbox, int words, int iters,
                                                     uint32_t flag_base, bool first, unsigned* bad_total,
                                                     unsigned long long* span) {
  const int b = blockIdx.x;
  const unsigned long long t0 = now();
  const int64_t off = chunk_bytes(M, words) * b;
  int bad = 0;
  for (int it = 0; it < iters; ++it) {
    const uint32_t flag = flag_base + it;
    if (first) {
      send<M>(peer_inbox + off, words, it, flag, b);
      bad += receive<M>(my_inbox + off, words, it, flag, b);
    } else {
      bad += receive<M>(my_inbox + off, words, it, flag, b);
      __syncthreads();  // the whole chunk is in before it goes back
      send<M>(peer_inbox + off, words, it, flag, b);
    }
    __syncthreads();
  }
  if (bad) atomicAdd(bad_total, static_cast<unsigned>(bad));
  if (threadIdx.x == 0 && b == 0) {
    span[0] = t0, span[1] = now();
  }
}

// Reads buf `passes` times (16 bytes a thread at a time, L2 only); span: its first start, last end.
// A fixed amount of work, so that nothing waits on another kernel running at once.
__global__ void __launch_bounds__(kThreads) streamer(const uint4* buf, int64_t n, int passes, unsigned long long* span) {
  if (threadIdx.x == 0) atomicMin(&span[0], now());
  const int64_t per = n / gridDim.x, first = per * blockIdx.x;
  uint32_t acc = 0;
  for (int p = 0; p < passes; ++p)
    for (int64_t i = first + threadIdx.x; i < first + per; i += 8 * kThreads) {
      uint4 v[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int64_t j = i + u * kThreads;
        v[u] = j < first + per ? __ldcg(buf + j) : uint4{};
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
    }
  if (acc == 0x12345678u) span[2] = acc;  // keeps the loads
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&span[1], now());
}

// Each GPU's buffers: its inbox, the bad-word count, the spans, the load's buffer and stream.
struct Side {
  uint8_t* inbox;
  unsigned* bad;
  unsigned long long* span;    // the ping-pong's start and end
  unsigned long long* loaded;  // the load's first start and last end
  uint4* buf;
  cudaStream_t load_stream;
};
constexpr int64_t kLoadBytes = int64_t{2} << 30;
constexpr int kLoadPasses = 4;

template <Mode M>
void run(Side side[2], int blocks, int words, int iters, uint32_t& flag_base, size_t bytes, bool load) {
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaMemset(side[g].inbox, 0, bytes));
    CK(cudaMemset(side[g].bad, 0, sizeof(unsigned)));
    const unsigned long long init[3] = {~0ull, 0, 0};
    CK(cudaMemcpy(side[g].loaded, init, sizeof(init), cudaMemcpyHostToDevice));
    CK(cudaDeviceSynchronize());
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int g : {1, 0}) {  // the load first; GPU 1 waits; then GPU 0 starts the round trips
    CK(cudaSetDevice(g));
    if (load) {
      streamer<<<sms * 3, kThreads, 0, side[g].load_stream>>>(side[g].buf, kLoadBytes / 16, kLoadPasses, side[g].loaded);
      CK(cudaGetLastError());
    }
  }
  for (int g : {1, 0}) {
    CK(cudaSetDevice(g));
    pingpong<M><<<blocks, kThreads>>>(side[1 - g].inbox, side[g].inbox, words, iters, flag_base, g == 0, side[g].bad,
                                      side[g].span);
    CK(cudaGetLastError());
  }
  unsigned nbad[2];
  unsigned long long span[2][2], loaded[2][3];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(&nbad[g], side[g].bad, sizeof(unsigned), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(span[g], side[g].span, sizeof(span[g]), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(loaded[g], side[g].loaded, sizeof(loaded[g]), cudaMemcpyDeviceToHost));
  }
  flag_base += iters + 1;
  const double ns = static_cast<double>(span[0][1] - span[0][0]);
  const int64_t data = int64_t{blocks} * words * 4, wire = chunk_bytes(M, words) * blocks;
  printf("%-8s blocks %4d data %7lld B wire %7lld B  trip %6.2f us  (%d round trips, bad words %u + %u)", kModeName[M],
         blocks, static_cast<long long>(data), static_cast<long long>(wire), ns / 1000.0 / (2.0 * iters), iters, nbad[0],
         nbad[1]);
  if (load) {  // the load's rate, and whether it covered the round trips on both GPUs
    const double load_ns = static_cast<double>(loaded[0][1] - loaded[0][0]);
    const bool covered = loaded[0][0] <= span[0][0] && loaded[0][1] >= span[0][1] && loaded[1][0] <= span[1][0] &&
                         loaded[1][1] >= span[1][1];
    printf("  load on GPU 0: %.0f GB/s, %s", static_cast<double>(kLoadBytes) * kLoadPasses / load_ns,
           covered ? "covering the round trips" : "NOT covering the round trips");
  }
  printf("\n");
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    fprintf(stderr, "needs two GPUs\n");
    return 1;
  }
  const size_t bytes = size_t{8} << 20;
  Side side[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaMalloc(&side[g].inbox, bytes));
    CK(cudaMalloc(&side[g].bad, sizeof(unsigned)));
    CK(cudaMalloc(&side[g].span, 2 * sizeof(unsigned long long)));
    CK(cudaMalloc(&side[g].loaded, 3 * sizeof(unsigned long long)));
    CK(cudaMalloc(&side[g].buf, kLoadBytes));
    CK(cudaMemset(side[g].buf, 1, kLoadBytes));
    CK(cudaStreamCreateWithFlags(&side[g].load_stream, cudaStreamNonBlocking));
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# %s x2, %d SMs\n", prop.name, prop.multiProcessorCount);
  uint32_t flag = 1;
  const int iters = 2000;
  // (blocks, data words a block): one word; 32 and 128 KiB of data in 128 blocks (the TP 2 16-row
  // exchange is 128 KiB: 16 rows x 4096 bf16), and 128 KiB in 16 blocks.
  const int shapes[][2] = {{1, 1}, {128, 64}, {128, 256}, {16, 2048}};
  for (bool load : {false, true}) {
    printf(load ? "## under load\n" : "## idle\n");
    const int n = load ? iters / 10 : iters;
    for (const auto& s : shapes) {
      run<kWord8>(side, s[0], s[1], n, flag, bytes, load);
      run<kPiece16>(side, s[0], s[1], n, flag, bytes, load);
      run<kLine128>(side, s[0], s[1], n, flag, bytes, load);
      run<kFence>(side, s[0], s[1], n, flag, bytes, load);
    }
  }
  return 0;
}
