// What a step's kernel boundaries cost on one GPU, against barriers inside one persistent kernel
// (would a persistent layer kernel save the verification step's fixed time per kernel?).
//   nvcc -O3 -std=c++17 -arch=sm_90a -o step_boundaries probe_h200_step_boundaries.cu && ./step_boundaries
// Every form runs `n` dependent phases of a full grid (one block an SM, 256 threads); in each phase
// every block reads a word that every block of the previous phase wrote (so the dependency is
// real) and writes its own. Per phase: the whole run's time / n.
//   graph:      one kernel a phase, captured in a CUDA graph (launch order only)
//   graph+pdl:  the same with programmatic dependent launch (griddepcontrol: the next kernel is
//               placed while the previous one ends, and waits inside)
//   coop sync:  one cooperative kernel, cooperative_groups grid.sync() between phases
//   flag sync:  one kernel, a counter per phase (each block adds 1 with release, then waits with
//               acquire loads until it reads the grid's count)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace cg = cooperative_groups;

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

constexpr int kThreads = 256;

// Block b of phase p: reads word (b + 1) % blocks of the previous phase's buffer (written by another
// block), writes its own word of the next buffer.
__device__ __forceinline__ void phase_work(const unsigned* in, unsigned* out, int blocks) {
  if (threadIdx.x == 0) {
    const unsigned v = __ldcg(in + (blockIdx.x + 1) % blocks);
    __stcg(out + blockIdx.x, v + 1);
  }
}

template <bool kPdl>
__global__ void __launch_bounds__(kThreads) phase_kernel(const unsigned* in, unsigned* out, int blocks) {
  if constexpr (kPdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  phase_work(in, out, blocks);
  if constexpr (kPdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void __launch_bounds__(kThreads) coop_kernel(unsigned* buf, int blocks, int n) {
  cg::grid_group grid = cg::this_grid();
  for (int p = 0; p < n; ++p) {
    phase_work(buf + (p % 2) * blocks, buf + ((p + 1) % 2) * blocks, blocks);
    grid.sync();
  }
}

__global__ void __launch_bounds__(kThreads) flag_kernel(unsigned* buf, unsigned* counts, int blocks, int n) {
  for (int p = 0; p < n; ++p) {
    phase_work(buf + (p % 2) * blocks, buf + ((p + 1) % 2) * blocks, blocks);
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counts + p) : "memory");
      unsigned c;
      do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counts + p) : "memory");
      while (c < static_cast<unsigned>(blocks));
    }
    __syncthreads();
  }
}

// Microseconds a phase: the best of 5 timed runs of launch() (after one warm-up), over n phases.
template <typename Launch>
float time_runs(Launch&& launch, int n, cudaStream_t s) {
  launch();  // warm-up
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(e0, s));
    launch();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = ms < best ? ms : best;
  }
  return best * 1000.0f / n;
}

// One phase_kernel a phase, captured in a graph, with or without PDL.
template <bool kPdl>
float time_graph(unsigned* buf, int blocks, int n, cudaStream_t s) {
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int p = 0; p < n; ++p) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = blocks;
    cfg.blockDim = kThreads;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = kPdl ? 1 : 0;
    const unsigned* in = buf + (p % 2) * blocks;
    unsigned* out = buf + ((p + 1) % 2) * blocks;
    CK(cudaLaunchKernelEx(&cfg, phase_kernel<kPdl>, in, out, blocks));
  }
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  const float us = time_runs([&] { CK(cudaGraphLaunch(ge, s)); }, n, s);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return us;
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("# %s, %d SMs; us a phase (best of 5 runs)\n", prop.name, sms);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *buf, *counts;
  const int n = 2000;
  CK(cudaMalloc(&buf, 2 * 4 * sms * sizeof(unsigned)));
  CK(cudaMalloc(&counts, n * sizeof(unsigned)));
  CK(cudaMemset(buf, 0, 2 * 4 * sms * sizeof(unsigned)));
  for (int blocks : {sms, 2 * sms}) {
    printf("## %d blocks of %d threads, %d phases\n", blocks, kThreads, n);
    printf("graph       %6.2f us\n", time_graph<false>(buf, blocks, n, s));
    printf("graph+pdl   %6.2f us\n", time_graph<true>(buf, blocks, n, s));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, coop_kernel, kThreads, 0));
    if (per_sm * sms >= blocks) {
      void* args[] = {&buf, &blocks, const_cast<int*>(&n)};
      printf("coop sync   %6.2f us\n", time_runs([&] {
               CK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(coop_kernel), blocks, kThreads, args, 0, s));
             }, n, s));
      printf("flag sync   %6.2f us\n", time_runs([&] {
               CK(cudaMemsetAsync(counts, 0, n * sizeof(unsigned), s));
               flag_kernel<<<blocks, kThreads, 0, s>>>(buf, counts, blocks, n);
               CK(cudaGetLastError());
             }, n, s));
    }
  }
  return 0;
}
