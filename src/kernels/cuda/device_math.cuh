// Small device helpers shared by the kernels: bf16 rounding, warp reductions
// (butterflies: every lane ends with the same result, in a fixed order), the
// tensor-core tile product and asynchronous copies to shared memory.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

// A kernel's dynamic shared memory, 128-byte aligned. Static __shared__ variables come first, and
// with 16-byte alignment a 4-byte one moved every ring stage 16 bytes off the 128-byte lines: each
// 512-byte cp.async of a stage then straddled five lines, and the SM read every row piece's sectors
// from L2 twice (Nsight Compute: twice the ideal sectors; the routed skinny gate/up at 16 rows 61 ->
// 52 us on an H100, at 32 rows 249 -> 172 us).
#define DFLASH_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

namespace dflash::cuda {

constexpr unsigned kFull = 0xffffffffu;  // every lane of a warp

// Whether a pointer may be read or written in 16-byte pieces.
__host__ __device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A float rounded to bf16 and back: what a torch op in bf16 stores.
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// One element as float: bf16 (stored as uint16_t) or float.
__device__ __forceinline__ float ld(const uint16_t* p) { return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(p)); }
__device__ __forceinline__ float ld(const float* p) { return *p; }

// *p where `on`, else `otherwise`: a load through L2 only (.cg, as __ldcg) under a predicate, so
// that a batch of them is straight-line code with no memory traffic for the loads that are off
// (CUDA's __ldcg is inline assembly, which the compiler guards with a branch instead). Volatile:
// it stays after the kernel's wait (pdl_wait, a volatile asm) for whatever wrote *p.
__device__ __forceinline__ float ldcg_if(const float* p, bool on, float otherwise) {
  float x = otherwise;
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.cg.f32 %0, [%1];\n\t}"
      : "+f"(x)
      : "l"(p), "r"(static_cast<int>(on)));
  return x;
}

// n / d and n % d for 0 <= n < 2^24 and 0 < d < 2^24, given inv = 1.0f / d taken once: the float
// quotient is within one of the true one and a correction step makes it exact. A few instructions
// where the compiler's division by a runtime value takes about twenty.
struct DivMod {
  int q, r;
};
__device__ __forceinline__ DivMod div_mod(int n, int d, float inv) {
  int q = __float2int_rz(__int2float_rn(n) * inv);
  int r = n - q * d;
  if (r < 0) --q, r += d;
  else if (r >= d) ++q, r -= d;
  return {q, r};
}

// Eight bf16 values (16 bytes) as floats, and back (rounded to nearest).
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const auto* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h2[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 raw;
  auto* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h2[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// d += a * b for one m16n8k16 tile: bf16 operands in the mma.sync fragment layout, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x rounded to tf32 (10 mantissa bits, round to nearest): the bits a tf32 product reads.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// The same kept as a float.
__device__ __forceinline__ float tf32_rounded(float x) { return __uint_as_float(to_tf32(x)); }

// d += a * b for one m16n8k8 tile: tf32 operands in the mma.sync fragment layout, fp32 accumulators.
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Four 8x8 bf16 matrices from shared memory in the mma fragment layout: lanes 8j..8j+7 give the
// row addresses of matrix j (16 bytes each); .trans: each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const auto a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const auto a = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// 16 bytes global -> shared without registers (through L2 only); zero-filled when !ok.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}
// The same with an L2 prefetch-size hint: L2 fetches the aligned 128- or 256-byte segment
// around the 16 bytes (kBytes 0: no hint).
template <int kBytes>
__device__ __forceinline__ void cp_async16_hint(void* smem, const void* gmem, bool ok) {
  static_assert(kBytes == 0 || kBytes == 128 || kBytes == 256, "prefetch sizes: 128 or 256 bytes");
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
  else if constexpr (kBytes == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(ok ? 16 : 0)
                 : "memory");
  else
    cp_async16(smem, gmem, ok);
}
// Copies of data a decode step reads once: the products' weights and the long-context attention's
// keys and values. Their lines go to L2 marked evict-first (and with the 128-byte fetch hint), so
// that the stream no longer pushes out what the step's next kernels read back through L2 (residual
// rows, activations, attention partials). Weights, two H200s, 8B shape: plain batch 1 4.21 -> 4.17
// ms, at TP 2 2.65 -> 2.60 ms; 30B-A3B shape: plain batch 1 2.71 -> 2.69 ms, plain batch 8 7.85 ->
// 7.71 ms. Keys and values, 8B shape at 32768 keys: plain batch 1 6.06-6.09 -> 5.98 ms. The routed
// skinny form's 16-pair items keep the plain hint: the policy operand raised their down form's
// registers past 128 (one block an SM), and the MoE steps of 9-16 rows were 4-8% slower
// (bench/results/README.md, "Weight copies marked evict-first", "Long-context keys and values marked
// evict-first" and "Routed 16-pair items: the evict-first loss is registers").
// The policy comes from evict_first_policy(), made once a thread.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async16_evict_first(void* smem, const void* gmem, bool ok, uint64_t policy) {
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(gmem),
               "r"(ok ? 16 : 0), "l"(policy)
               : "memory");
}
// 4 bytes (zeros when !ok), for data without 16-byte alignment.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
  const auto dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(gmem), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

}  // namespace dflash::cuda
