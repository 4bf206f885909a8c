// What a chain of dependent kernels shaped like the 30B-A3B step costs when each kernel only streams
// its bytes: no arithmetic, no reductions beyond one word a block. The fraction of the floor such a
// chain reaches is about the best kernels with the same dependencies can reach (kernels that request
// more than 8 loads a thread before their wait could start a little faster).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o layer_chain probe_h200_layer_chain.cu && ./layer_chain
// A phase: a graph node launched with programmatic dependent launch (the engine's way). Its blocks
// (2 or 4 an SM of 256 threads, 16-byte loads, 8 in flight a thread) wait for the previous phase
// (griddepcontrol.wait), read a word that another block of the previous phase wrote and share it
// through shared memory (a dependent L2 round trip and a barrier, as the engine's kernels read
// their input rows), release the next phase, stream their share of the phase's bytes, reduce them
// in the block and write one word. "early": the first 8 loads a thread are issued before the wait
// (dense products prefetch their weights before waiting); "late": the loaded address depends on the
// word read after the wait (the routed gate/up products: which experts comes from the routing).
// Every phase reads its own buffer (no L2 reuse across phases or layers). The same chains also run
// as one persistent kernel with a grid barrier between phases (would a persistent layer kernel beat
// the chain of launches?).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

constexpr int kThreads = 256;
constexpr int kInFlight = 8;  // 16-byte loads in flight a thread

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A thread's first kInFlight loads of a phase (early phases issue them before their wait).
__device__ __forceinline__ void first_loads(const uint4* w, int64_t n_vec, int64_t first, int64_t stride,
                                            uint4 (&v)[kInFlight]) {
#pragma unroll
  for (int u = 0; u < kInFlight; ++u) {
    const int64_t i = first + u * stride;
    v[u] = i < n_vec ? load_stream(w + i) : make_uint4(0, 0, 0, 0);
  }
}

// The rest of a phase once the word d of the previous phase is read: the thread's xor of its bytes.
// The word is 0 at run time; the compiler cannot know, so a late phase's addresses wait for it.
__device__ __forceinline__ unsigned stream_rest(const uint4* w, int64_t n_vec, bool early, int64_t first,
                                                int64_t stride, uint4 (&v)[kInFlight], unsigned d) {
  unsigned acc = 0;
  const uint4* base = early ? w : w + (d & 1u);
  int64_t i0 = first;
  if (early) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    i0 += kInFlight * stride;
  }
  for (int64_t i = i0; i < n_vec; i += kInFlight * stride) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t j = i + u * stride;
      v[u] = j < n_vec ? load_stream(base + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

// The block's word: the threads' xors and d, written by thread 0.
__device__ __forceinline__ void write_word(unsigned acc, unsigned d, unsigned* out, unsigned* red) {
  for (int o = 16; o > 0; o /= 2) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned r = d;
    for (int j = 0; j < kThreads / 32; ++j) r ^= red[j];
    __stcg(out + blockIdx.x, r);
  }
}

// One phase a kernel. in: the previous phase's words (in_blocks of them); out: this phase's.
template <bool kEarly>
__global__ void __launch_bounds__(kThreads, 4) phase_kernel(const uint4* w, int64_t n_vec, const unsigned* in,
                                                         int in_blocks, unsigned* out) {
  __shared__ unsigned dep;
  __shared__ unsigned red[kThreads / 32];
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  uint4 v[kInFlight];
  if constexpr (kEarly) first_loads(w, n_vec, first, stride, v);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) dep = __ldcg(in + (blockIdx.x + 1) % in_blocks);
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const unsigned d = dep;
  write_word(stream_rest(w, n_vec, kEarly, first, stride, v, d), d, out, red);
}

// Every phase in one kernel whose blocks are all resident: between phases a grid barrier (a
// counter: each block adds 1 with release once its word is written, then waits with acquire loads
// for the grid's count). An early phase's first loads go out before the barrier that starts it.
struct PhaseDesc {
  int64_t at, n_vec;
  int early;
};
__global__ void __launch_bounds__(kThreads, 4) persistent_kernel(const uint4* pool, const PhaseDesc* phases, int n,
                                                              unsigned* words, unsigned* counter) {
  __shared__ unsigned dep;
  __shared__ unsigned red[kThreads / 32];
  const int blocks = static_cast<int>(gridDim.x);
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  uint4 v[kInFlight];
  if (phases[0].early) first_loads(pool + phases[0].at, phases[0].n_vec, first, stride, v);
  for (int p = 0; p < n; ++p) {
    const PhaseDesc ph = phases[p];
    if (p > 0 && threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
      const unsigned target = static_cast<unsigned>(blocks) * static_cast<unsigned>(p);
      unsigned c;
      do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counter) : "memory");
      while (c < target);
    }
    if (threadIdx.x == 0) dep = __ldcg(words + (p % 2) * blocks + (blockIdx.x + 1) % blocks);
    __syncthreads();
    const unsigned d = dep;
    const unsigned acc = stream_rest(pool + ph.at, ph.n_vec, ph.early != 0, first, stride, v, d);
    if (p + 1 < n && phases[p + 1].early) first_loads(pool + phases[p + 1].at, phases[p + 1].n_vec, first, stride, v);
    write_word(acc, d, words + ((p + 1) % 2) * blocks, red);
  }
}

struct Phase {
  int64_t bytes;
  bool early;
};

struct Chain {
  std::string name;
  std::vector<Phase> phases;
  int64_t bytes() const {
    int64_t b = 0;
    for (const Phase& p : phases) b += p.bytes;
    return b;
  }
};

// Milliseconds a replay: the median of 21 timed replays after 3 warm-up ones.
float time_graph(cudaGraphExec_t ge, cudaStream_t s) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  std::vector<float> ms;
  for (int i = 0; i < 21; ++i) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float t;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[ms.size() / 2];
}

// What record() puts on s, captured as a graph and timed by time_graph.
template <typename Record>
float time_captured(cudaStream_t s, Record&& record) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  record();
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  const float ms = time_graph(ge, s);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return ms;
}

// The chain as one graph of PDL launches, each phase on its own part of `pool`.
float time_chain(const Chain& c, const uint4* pool, int64_t pool_vec, unsigned* words, int blocks, cudaStream_t s) {
  return time_captured(s, [&] {
    int64_t at = 0;
    for (size_t p = 0; p < c.phases.size(); ++p) {
      const int64_t n_vec = c.phases[p].bytes / 16;
      if (at + n_vec > pool_vec) at = 0;  // never: main sizes the pool for the largest chain
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = blocks;
      cfg.blockDim = kThreads;
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      const unsigned* in = words + (p % 2) * blocks;
      unsigned* out = words + ((p + 1) % 2) * blocks;
      if (c.phases[p].early) CK(cudaLaunchKernelEx(&cfg, phase_kernel<true>, pool + at, n_vec, in, blocks, out));
      else CK(cudaLaunchKernelEx(&cfg, phase_kernel<false>, pool + at, n_vec, in, blocks, out));
      at += n_vec;
    }
  });
}

// The chain as one persistent_kernel launch (after zeroing the counter), timed like a graph.
float time_persistent(const Chain& c, const uint4* pool, unsigned* words, int blocks, cudaStream_t s) {
  std::vector<PhaseDesc> desc;
  int64_t at = 0;
  for (const Phase& p : c.phases) {
    desc.push_back({at, p.bytes / 16, p.early ? 1 : 0});
    at += p.bytes / 16;
  }
  PhaseDesc* d;
  unsigned* counter;
  CK(cudaMalloc(&d, desc.size() * sizeof(PhaseDesc)));
  CK(cudaMalloc(&counter, sizeof(unsigned)));
  CK(cudaMemcpy(d, desc.data(), desc.size() * sizeof(PhaseDesc), cudaMemcpyHostToDevice));
  const float ms = time_captured(s, [&] {
    CK(cudaMemsetAsync(counter, 0, sizeof(unsigned), s));
    persistent_kernel<<<blocks, kThreads, 0, s>>>(pool, d, static_cast<int>(desc.size()), words, counter);
    CK(cudaGetLastError());
  });
  CK(cudaFree(d));
  CK(cudaFree(counter));
  return ms;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // The 30B-A3B shape (hidden 2048, 32 / 4 heads of 128, experts of 768, vocab 151936), bf16.
  const int64_t qkv = 2048LL * 5120 * 2, o = 4096LL * 2048 * 2, router = 128LL * 2048 * 2,
                expert = 3LL * 768 * 2048 * 2, attn = 512LL * 4 * 128 * 2 * 2 + 4 * 128 * 2 * 2,
                lm_head = 151936LL * 2048 * 2, draft_mlp = 3LL * 6144 * 2048 * 2;
  const int layers = 48;
  auto repeat = [&](std::vector<Phase> layer, int n, std::vector<Phase> tail) {
    std::vector<Phase> out;
    for (int i = 0; i < n; ++i) out.insert(out.end(), layer.begin(), layer.end());
    out.insert(out.end(), tail.begin(), tail.end());
    return out;
  };
  const std::vector<Phase> head = {{lm_head, true}, {0, true}};  // lm_head, argmax
  std::vector<Chain> chains;
  // The plain batch-1 step as the engine runs it: q/k/v (normalizing), attention, split combine, o,
  // router (normalizing), one-token gate/up (8 experts, after the routing), down.
  chains.push_back({"plain, 7 phases a layer (the engine's)",
                    repeat({{qkv, true}, {attn, true}, {0, true}, {o, true}, {router, true},
                            {8 * expert * 2 / 3, false}, {8 * expert / 3, true}},
                           layers, head)});
  chains.push_back({"plain, 7 phases, nothing before the wait",
                    repeat({{qkv, false}, {attn, false}, {0, false}, {o, false}, {router, false},
                            {8 * expert * 2 / 3, false}, {8 * expert / 3, false}},
                           layers, head)});
  chains.push_back({"plain, 5 phases (no combine, router in o)",
                    repeat({{qkv, true}, {attn, true}, {o + router, true}, {8 * expert * 2 / 3, false},
                            {8 * expert / 3, true}},
                           layers, head)});
  chains.push_back({"plain, 3 phases (q/k/v+attention, o+router, experts)",
                    repeat({{qkv + attn, true}, {o + router, true}, {8 * expert, false}}, layers, head)});
  chains.push_back({"plain, 1 phase a layer", repeat({{qkv + attn + o + router + 8 * expert, true}}, layers, head)});
  // The DFlash step at batch 1 (19.7 experts a layer at 48 layers): the draft (context projection,
  // 5 dense layers of 16 rows with RMSNorm kernels, lm_head, argmax), then the verification layers
  // (RMSNorm, q/k/v, attention, combine, o, RMSNorm, router, routing, SwiGLU, down), lm_head, argmax.
  {
    std::vector<Phase> p = repeat({{0, true}, {qkv, true}, {attn / 2, true}, {0, true}, {o, true}, {0, true},
                                   {draft_mlp * 2 / 3, true}, {draft_mlp / 3, true}},
               5, {});
    p.insert(p.begin(), {{qkv, true}, {0, true}});
    p.insert(p.end(), head.begin(), head.end());
    const int64_t swiglu = 197 * expert * 2 / 30, down = 197 * expert / 30;  // 19.7 experts
    std::vector<Phase> v = repeat({{0, true}, {qkv, true}, {attn, true}, {0, true}, {o, true}, {0, true},
                                   {router, true}, {0, true}, {swiglu, false}, {down, true}},
                                  layers, head);
    p.insert(p.end(), v.begin(), v.end());
    chains.push_back({"DFlash, the engine's phases", p});
  }

  int64_t most = 0;
  for (const Chain& c : chains) most = std::max(most, c.bytes());
  const int64_t pool_vec = most / 16 + 1;
  uint4* pool;
  unsigned* words;
  CK(cudaMalloc(&pool, pool_vec * 16));
  CK(cudaMemset(pool, 0, pool_vec * 16));
  CK(cudaMalloc(&words, 2 * 4 * sms * sizeof(unsigned)));
  CK(cudaMemset(words, 0, 2 * 4 * sms * sizeof(unsigned)));

  // The rates a floor is taken at: a 1 GiB device copy (read + write bytes, as dflash bench-step
  // counts it) and one phase of this kernel reading 1 GiB.
  const int64_t gib = int64_t{1} << 30;
  float copy_ms;
  {
    // Eager copies, as dflash bench-step times them (a copy captured in a graph ran slower).
    std::vector<float> ms;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 12; ++i) {
      CK(cudaEventRecord(e0, s));
      CK(cudaMemcpyAsync(reinterpret_cast<char*>(pool) + gib, pool, gib, cudaMemcpyDeviceToDevice, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (i >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    copy_ms = ms[ms.size() / 2];
  }
  const double copy_gbps = 2.0 * gib / (copy_ms * 1e-3) / 1e9;
  printf("# %s, %d SMs; copy rate %.0f GB/s (read + write, eager cudaMemcpyAsync of 1 GiB)\n", prop.name, sms,
         copy_gbps);
  // Blocks a phase: 2 an SM leaves room for the next phase's 2 (4 of 256 threads fit an SM), so that
  // its early loads go out while this phase streams; 4 an SM fills the SM.
  for (int per_sm : {2, 4}) {
    const int blocks = per_sm * sms;
    const double read_gbps =
        gib / (time_chain({"read", {{gib, true}}}, pool, pool_vec, words, blocks, s) * 1e-3) / 1e9;
    printf("## %d blocks of %d threads a phase; one phase reading 1 GiB: %.0f GB/s\n", blocks, kThreads, read_gbps);
    printf("%-56s %7s %9s %9s %9s %9s %10s\n", "chain", "phases", "GB", "ms", "floor_ms", "fraction", "us/phase+");
    auto row = [&](const std::string& name, const Chain& c, double ms) {
      const double floor_ms = c.bytes() / (copy_gbps * 1e9) * 1e3;
      // Time beyond the bytes at the read rate, per phase.
      const double extra = (ms - c.bytes() / (read_gbps * 1e9) * 1e3) * 1e3 / c.phases.size();
      printf("%-56s %7zu %9.3f %9.3f %9.3f %9.3f %10.2f\n", name.c_str(), c.phases.size(), c.bytes() / 1e9, ms,
             floor_ms, floor_ms / ms, extra);
    };
    for (const Chain& c : chains) row(c.name, c, time_chain(c, pool, pool_vec, words, blocks, s));
    // The same phases in one persistent kernel (its blocks must all be resident: 4 an SM fit).
    for (const Chain& c : chains)
      if (c.phases.size() > 1) row("persistent: " + c.name, c, time_persistent(c, pool, words, blocks, s));
  }
  return 0;
}
