// The chunked form of the Gated DeltaNet recurrence, for long committed segments (prefill). Token
// by token, per value head (state S [k_dim, v_dim]):
//   S = exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S += k_t u_t^T;  o_t = S^T q_t.
// Over a chunk of L <= 64 rows with G_i = g_0 + ... + g_i and the state S0 before it, the u rows
// solve (I + A) u = beta (v - exp(G) K S0), A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i, so
// with T = (I + A)^-1:
//   u = U - W S0,  U = T (beta v),  W = T (beta exp(G) K)
//   o_i = exp(G_i) S0^T q_i + sum_{j <= i} exp(G_i - G_j) (q_i.k_j) u_j
//   S_next = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T.
// T and U do not depend on the state, so every chunk of every head gets them at once
// (gdn_chunk_solve_kernel); then one block per (segment, value head, 64 state columns) walks the
// chunks in order with the state in shared memory (gdn_chunk_state_kernel). The products run on
// tensor cores (mma.sync m16n8k8 tf32, float32 accumulators): their operands keep 10 of float32's
// 23 mantissa bits, so the outputs differ from the token-by-token form's by about 1e-3 relative
// (CudaOps tests), well below the bf16 rounding of the core output. A row's bits depend on where
// its chunk starts (the call's first row), as a product's depend on the call's row count.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <climits>

#include "kernels/cuda/gdn_math.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dflash::cuda {
namespace {

constexpr int kL = kGdnChunk;     // rows of a chunk
constexpr int kBV = 64;           // state columns of a gdn_chunk_state_kernel block
constexpr int kMaxDK = 128;       // k_dim of the chunked form (padded to 32, 64 or 128)
constexpr int kSolveThreads = 128;
constexpr int kStateThreads = 256;
constexpr int kPrepThreads = 128;
// Shared-memory row strides (floats): 4 more than a multiple of 32 for operands read as [m][k]
// (rows g, columns t of a fragment fall in distinct banks), 8 more for those read as [k][n].
constexpr int kTS = kL + 4;       // T, A, P: [64][68]
constexpr int kVS = kBV + 8;      // U / u blocks, S: [..][72]
template <int DK>
constexpr int kKS = DK + 4;       // q, k, W rows

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d += a * b for one m16n8k8 tile, tf32 operands, float32 accumulators.
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// acc[mt] += A[16 mt .. 16 mt + 15][0 .. 8 ksteps) * B[0 .. 8 ksteps)[n0 .. n0 + 7] for a warp:
// a(m, k) and b(k, n) read the operands (n relative to the warp's 8 columns). Fragment layout of
// m16n8k8: g = lane / 4, t = lane % 4; a: (g, t) (g + 8, t) (g, t + 4) (g + 8, t + 4); b: (t, g)
// (t + 4, g); accumulators: (g, 2t) (g, 2t + 1) (g + 8, 2t) (g + 8, 2t + 1).
template <int MT, typename FA, typename FB>
__device__ __forceinline__ void warp_product(float (&acc)[MT][4], int ksteps, FA a, FB b) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int ks = 0; ks < ksteps; ++ks) {
    const int k = ks * 8 + t;
    const uint32_t b0 = to_tf32(b(k, g)), b1 = to_tf32(b(k + 4, g));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m = mt * 16 + g;
      mma_tf32(acc[mt], to_tf32(a(m, k)), to_tf32(a(m + 8, k)), to_tf32(a(m, k + 4)), to_tf32(a(m + 8, k + 4)), b0, b1);
    }
  }
}

template <int MT>
__device__ __forceinline__ void zero(float (&acc)[MT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
}

// Calls f(m, n, value) for each accumulator of acc (n relative to the warp's 8 columns).
template <int MT, typename F>
__device__ __forceinline__ void for_each_acc(const float (&acc)[MT][4], F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    f(mt * 16 + g, 2 * t, acc[mt][0]);
    f(mt * 16 + g, 2 * t + 1, acc[mt][1]);
    f(mt * 16 + g + 8, 2 * t, acc[mt][2]);
    f(mt * 16 + g + 8, 2 * t + 1, acc[mt][3]);
  }
}

// Where a segment's chunked rows live in x: q of key head kh at column kh * k_dim, k at key_dim +
// kh * k_dim, v of value head h at 2 key_dim + h * v_dim, beta at conv_dim + h, the log-decay
// (then G) at conv_dim + n_v + h.
struct Cols {
  int64_t q, k, v, beta, g;
  __device__ Cols(const GdnShape& p, int h) {
    const int ratio = p.n_v_heads / p.n_k_heads, kh = h / ratio;
    const int64_t key_dim = int64_t{p.n_k_heads} * p.k_dim, C = p.conv_dim();
    q = int64_t{kh} * p.k_dim;
    k = key_dim + q;
    v = 2 * key_dim + int64_t{h} * p.v_dim;
    beta = C + h;
    g = C + p.n_v_heads + h;
  }
};

// In place on x for the chunked segments, one warp per row and key head: q and k normalized (q
// scaled by k_dim^-1/2), and per value head of the key head b -> beta, a -> log-decay g.
__global__ void gdn_prep_kernel(float* x, int64_t x_stride, GdnShape p, const float* a_log, const float* dt_bias,
                                const int32_t* segs, int chunk_min_rows) {
  pdl_begin();
  const GdnSegment seg = gdn_segment(segs, blockIdx.y);
  if (!gdn_takes_chunks(seg, chunk_min_rows)) return;
  const int kh = blockIdx.x * (kPrepThreads / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (kh >= p.n_k_heads) return;
  const int dk = p.k_dim, ratio = p.n_v_heads / p.n_k_heads;
  const int64_t key_dim = int64_t{p.n_k_heads} * dk, C = p.conv_dim();
  for (int r = blockIdx.z; r < seg.replay + seg.n_rows; r += gridDim.z) {
    float* row = x + (seg.scratch_first + r) * x_stride;
    float q[kGdnRowsPerLane], k[kGdnRowsPerLane];
#pragma unroll
    for (int m = 0; m < kGdnRowsPerLane; ++m) {
      const int i = lane + 32 * m;
      q[m] = i < dk ? row[kh * dk + i] : 0.0f;
      k[m] = i < dk ? row[key_dim + kh * dk + i] : 0.0f;
    }
    gdn_normalize_qk(q, k, rsqrtf(static_cast<float>(dk)));
#pragma unroll
    for (int m = 0; m < kGdnRowsPerLane; ++m) {
      const int i = lane + 32 * m;
      if (i < dk) row[kh * dk + i] = q[m], row[key_dim + kh * dk + i] = k[m];
    }
    for (int j = lane; j < ratio; j += 32) {
      const int h = kh * ratio + j;
      row[C + h] = gdn_beta(row[C + h]);
      row[C + p.n_v_heads + h] = gdn_log_decay(row[C + p.n_v_heads + h], a_log[h], dt_bias[h]);
    }
  }
}

// Stages rows [0, kL) x columns [0, C) of dst (row stride ds floats) from src (row stride ss
// floats) with cp.async: rows < L and columns < valid from memory, zeros elsewhere. vec4: src,
// ss and valid allow 16-byte pieces.
template <int C, int kThreads>
__device__ __forceinline__ void stage_rows(float* dst, int ds, const float* src, int64_t ss, int L, int valid,
                                           bool vec4) {
  if (vec4) {
    for (int e = threadIdx.x; e < kL * C / 4; e += kThreads) {
      const int i = e / (C / 4), c = e % (C / 4) * 4;
      const bool ok = i < L && c < valid;
      cp_async16(dst + i * ds + c, ok ? src + i * ss + c : src, ok);
    }
  } else {
    for (int e = threadIdx.x; e < kL * C; e += kThreads) {
      const int i = e / C, c = e % C;
      const bool ok = i < L && c < valid;
      cp_async4(dst + i * ds + c, ok ? src + i * ss + c : src, ok);
    }
  }
}

template <int DK>
struct SolveSmem {
  union {
    float k[kL][kKS<DK>];  // the chunk's k rows
    float v[kL][kVS];      // then blocks of v
  };
  float a[kL][kTS];
  float t[kL][kTS];
  float G[kL], beta[kL];
};

// One block per (value head, chunk, segment): G (the cumulative log-decay, written over g in x),
// A, T = (I + A)^-1 (to t: row r of x's rows, 64 columns per value head) and U = T (beta v)
// (written over v in x).
template <int DK>
__global__ void __launch_bounds__(kSolveThreads)
    gdn_chunk_solve_kernel(float* x, int64_t x_stride, GdnShape p, const int32_t* segs, int chunk_min_rows,
                           bool vec4, float* tbuf, int64_t t_stride) {
  pdl_begin();
  const GdnSegment seg = gdn_segment(segs, blockIdx.z);
  const int total = seg.replay + seg.n_rows, r0 = blockIdx.y * kL;
  if (!gdn_takes_chunks(seg, chunk_min_rows) || r0 >= total) return;
  extern __shared__ float smem_raw[];
  auto& sm = *reinterpret_cast<SolveSmem<DK>*>(smem_raw);
  const int L = min(kL, total - r0), h = blockIdx.x, dk = p.k_dim, dv = p.v_dim, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const Cols col(p, h);
  float* rows = x + (seg.scratch_first + r0) * x_stride;
  stage_rows<DK, kSolveThreads>(&sm.k[0][0], kKS<DK>, rows + col.k, x_stride, L, dk, vec4);
  cp_async_commit();
  if (warp == 0) {  // G: an inclusive scan of g over the chunk, lanes i and i + 32
    float lo = lane < L ? rows[lane * x_stride + col.g] : 0.0f;
    float hi = lane + 32 < L ? rows[(lane + 32) * x_stride + col.g] : 0.0f;
    for (int o = 1; o < 32; o <<= 1) {
      const float a = __shfl_up_sync(kFull, lo, o), b = __shfl_up_sync(kFull, hi, o);
      if (lane >= o) lo += a, hi += b;
    }
    hi += __shfl_sync(kFull, lo, 31);
    sm.G[lane] = lo;
    sm.G[lane + 32] = hi;
    if (lane < L) rows[lane * x_stride + col.g] = lo;
    if (lane + 32 < L) rows[(lane + 32) * x_stride + col.g] = hi;
  } else if (warp == 1) {
    for (int i = lane; i < kL; i += 32) sm.beta[i] = i < L ? rows[i * x_stride + col.beta] : 0.0f;
  }
  cp_async_wait<0>();
  __syncthreads();
  // A = strictly lower (beta_i exp(G_i - G_j) k_i.k_j): each warp two column tiles, all row tiles.
  for (int nt = warp; nt < kL / 8; nt += kSolveThreads / 32) {
    float acc[kL / 16][4];
    zero(acc);
    warp_product(acc, DK / 8, [&](int m, int k) { return sm.k[m][k]; },
                 [&](int k, int n) { return sm.k[nt * 8 + n][k]; });
    for_each_acc(acc, [&](int m, int n, float v) {
      const int j = nt * 8 + n;
      sm.a[m][j] = j < m ? sm.beta[m] * expf(sm.G[m] - sm.G[j]) * v : 0.0f;
    });
  }
  __syncthreads();
  // T by forward substitution: column j solves (I + A) t = e_j, on lanes 2j and 2j + 1 (one
  // takes the even terms of each sum, the other the odd ones).
  static_assert(kSolveThreads == 2 * kL, "two threads a column of T");
  {
    const int j = tid / 2, half = tid % 2;
    for (int i = 0; i < kL; ++i) {
      float s = 0.0f;
      if (i > j && i < L)
        for (int m = j + half; m < i; m += 2) s += sm.a[i][m] * sm.t[m][j];
      s += __shfl_xor_sync(kFull, s, 1);
      if (half == 0) sm.t[i][j] = i == j ? 1.0f : i > j && i < L ? -s : 0.0f;
      __syncwarp();
    }
  }
  __syncthreads();
  float* trows = tbuf + (seg.scratch_first + r0) * t_stride + int64_t{h} * kL;
  for (int e = tid; e < L * kL; e += kSolveThreads) trows[(e / kL) * t_stride + e % kL] = sm.t[e / kL][e % kL];
  // U = T (beta v), 64 value columns at a time, over v in x.
  for (int c0 = 0; c0 < dv; c0 += kBV) {
    stage_rows<kBV, kSolveThreads>(&sm.v[0][0], kVS, rows + col.v + c0, x_stride, L, dv - c0, vec4);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int nt = warp; nt < kBV / 8; nt += kSolveThreads / 32) {
      float acc[kL / 16][4];
      zero(acc);
      warp_product(acc, kL / 8, [&](int m, int k) { return sm.t[m][k]; },
                   [&](int k, int n) { return sm.beta[k] * sm.v[k][nt * 8 + n]; });
      for_each_acc(acc, [&](int m, int n, float v) {
        const int c = c0 + nt * 8 + n;
        if (m < L && c < dv) rows[m * x_stride + col.v + c] = v;
      });
    }
    __syncthreads();
  }
}

template <int DK>
struct StateSmem {
  float q[kL][kKS<DK>], k[kL][kKS<DK>];
  float S[DK][kVS];
  float t[kL][kTS], P[kL][kTS];
  float u[kL][kVS];  // U, then u
  float y[kL][kVS];  // beta exp(G) K S
  float G[kL], bg[kL], dl[kL];  // G, beta exp(G), exp(G_last - G)
};
static_assert(kBV == kL, "T and the state's column blocks are staged alike");

// One block per (64 state columns, value head, segment): the chunks in order, the state's columns
// in shared memory. Per chunk: P = mask(exp(G_i - G_j) q_i.k_j); u = U - T (beta exp(G) K S);
// o = exp(G) Q S + P u; S = exp(G_last) S + (exp(G_last - G) K)^T u. Each warp owns 8 columns of
// the state and of every result but P, so P's is the one block-wide wait of a chunk.
template <int DK>
__global__ void __launch_bounds__(kStateThreads)
    gdn_chunk_state_kernel(const float* x, int64_t x_stride, GdnShape p, const int32_t* segs, int chunk_min_rows,
                           bool vec4, const float* tbuf, int64_t t_stride, float* state, bf16* out,
                           int64_t out_stride) {
  pdl_begin();
  const GdnSegment seg = gdn_segment(segs, blockIdx.z);
  if (!gdn_takes_chunks(seg, chunk_min_rows)) return;
  extern __shared__ float smem_raw[];
  auto& sm = *reinterpret_cast<StateSmem<DK>*>(smem_raw);
  const int h = blockIdx.y, j0 = blockIdx.x * kBV, dk = p.k_dim, dv = p.v_dim, tid = threadIdx.x;
  const int nt = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, total = seg.replay + seg.n_rows;
  const int n0 = nt * 8;  // this warp's 8 columns of every 64-wide result
  const Cols col(p, h);
  float* S_mem = state + seg.slot * (int64_t{p.n_v_heads} * dk * dv) + int64_t{h} * dk * dv;
  for (int e = tid; e < DK * kBV; e += kStateThreads) {
    const int d = e / kBV, c = e % kBV;
    sm.S[d][c] = !seg.fresh && d < dk && j0 + c < dv ? S_mem[int64_t{d} * dv + j0 + c] : 0.0f;
  }
  for (int r0 = 0; r0 < total; r0 += kL) {
    const int L = min(kL, total - r0);
    const float* rows = x + (seg.scratch_first + r0) * x_stride;
    __syncthreads();  // the previous chunk is done with the buffers
    stage_rows<DK, kStateThreads>(&sm.q[0][0], kKS<DK>, rows + col.q, x_stride, L, dk, vec4);
    stage_rows<DK, kStateThreads>(&sm.k[0][0], kKS<DK>, rows + col.k, x_stride, L, dk, vec4);
    stage_rows<kBV, kStateThreads>(&sm.u[0][0], kVS, rows + col.v + j0, x_stride, L, dv - j0, vec4);
    stage_rows<kL, kStateThreads>(&sm.t[0][0], kTS, tbuf + (seg.scratch_first + r0) * t_stride + int64_t{h} * kL,
                                  t_stride, L, kL, vec4);
    cp_async_commit();
    if (tid < kL) {
      const int i = tid;
      const float G = rows[min(i, L - 1) * x_stride + col.g], G_last = rows[(L - 1) * x_stride + col.g];
      const float beta = i < L ? rows[i * x_stride + col.beta] : 0.0f;
      sm.G[i] = G;  // rows past the end: exp(0) times zeros
      sm.bg[i] = beta * expf(G);
      sm.dl[i] = expf(G_last - G);
    }
    cp_async_wait<0>();
    __syncthreads();
    const float G_last = sm.G[L - 1];
    {  // P = exp(G_i - G_j) q_i.k_j for j <= i, this warp's columns j
      float acc[kL / 16][4];
      zero(acc);
      warp_product(acc, DK / 8, [&](int m, int k) { return sm.q[m][k]; }, [&](int k, int n) { return sm.k[n0 + n][k]; });
      for_each_acc(acc, [&](int m, int n, float v) {
        const int j = n0 + n;
        sm.P[m][j] = j <= m ? expf(sm.G[m] - sm.G[j]) * v : 0.0f;
      });
    }
    // Q S (kept for o) and y = beta exp(G) K S, then u = U - T y.
    float qs[kL / 16][4];
    {
      float ks[kL / 16][4];
      zero(qs);
      zero(ks);
      warp_product(qs, DK / 8, [&](int m, int k) { return sm.q[m][k]; }, [&](int k, int n) { return sm.S[k][n0 + n]; });
      warp_product(ks, DK / 8, [&](int m, int k) { return sm.k[m][k]; }, [&](int k, int n) { return sm.S[k][n0 + n]; });
      for_each_acc(ks, [&](int m, int n, float v) { sm.y[m][n0 + n] = sm.bg[m] * v; });
      __syncwarp();
      float ty[kL / 16][4];
      zero(ty);
      warp_product(ty, kL / 8, [&](int m, int k) { return sm.t[m][k]; }, [&](int k, int n) { return sm.y[k][n0 + n]; });
      for_each_acc(ty, [&](int m, int n, float v) { sm.u[m][n0 + n] -= v; });
    }
    __syncthreads();  // P complete
    {  // o = exp(G) Q S + P u, to out (rows past the tape, columns inside v_dim)
      float o[kL / 16][4];
      zero(o);
      warp_product(o, kL / 8, [&](int m, int k) { return sm.P[m][k]; }, [&](int k, int n) { return sm.u[k][n0 + n]; });
#pragma unroll
      for (int mt = 0; mt < kL / 16; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = mt * 16 + g + (e >= 2 ? 8 : 0), c = j0 + n0 + 2 * t + (e & 1), r = r0 + m;
          if (m >= L || r < seg.replay || c >= dv) continue;
          const float core = expf(sm.G[m]) * qs[mt][e] + o[mt][e];
          *reinterpret_cast<__nv_bfloat16*>(out + int64_t{seg.first_row + r - seg.replay} * out_stride +
                                            int64_t{h} * dv + c) = __float2bfloat16(core);
        }
    }
    {  // S = exp(G_last) S + (exp(G_last - G) K)^T u: rows of S in tiles of 16
      float acc[DK / 16][4];
      const float decay = expf(G_last);
#pragma unroll
      for (int mt = 0; mt < DK / 16; ++mt) {
        acc[mt][0] = decay * sm.S[mt * 16 + g][n0 + 2 * t];
        acc[mt][1] = decay * sm.S[mt * 16 + g][n0 + 2 * t + 1];
        acc[mt][2] = decay * sm.S[mt * 16 + g + 8][n0 + 2 * t];
        acc[mt][3] = decay * sm.S[mt * 16 + g + 8][n0 + 2 * t + 1];
      }
      warp_product(acc, kL / 8, [&](int m, int k) { return sm.dl[k] * sm.k[k][m]; },
                   [&](int k, int n) { return sm.u[k][n0 + n]; });
      __syncwarp();  // every lane has read its operands of S
      for_each_acc(acc, [&](int m, int n, float v) { sm.S[m][n0 + n] = v; });
    }
  }
  __syncthreads();
  for (int e = tid; e < DK * kBV; e += kStateThreads) {
    const int d = e / kBV, c = e % kBV;
    if (d < dk && j0 + c < dv) S_mem[int64_t{d} * dv + j0 + c] = sm.S[d][c];
  }
}

template <int DK>
void launch_chunks(float* x, int64_t x_stride, const GdnShape& p, const int32_t* segs, int n_segs, int max_rows,
                   int chunk_min_rows, float* t, int64_t t_stride, float* state, Mat out, cudaStream_t s) {
  const auto solve = gdn_chunk_solve_kernel<DK>;
  const auto walk = gdn_chunk_state_kernel<DK>;
  static std::atomic<uint64_t> configured{0};
  once_per_device(configured, [&] {
    CUDA_CHECK(cudaFuncSetAttribute(solve, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(sizeof(SolveSmem<DK>))));
    CUDA_CHECK(cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(sizeof(StateSmem<DK>))));
  });
  const unsigned chunks = static_cast<unsigned>((max_rows + kL - 1) / kL);
  // 16-byte staging where every row and column offset allows it.
  const bool vec4 = aligned16(x) && aligned16(t) && x_stride % 4 == 0 && t_stride % 4 == 0 && p.k_dim % 4 == 0 &&
                    p.v_dim % 4 == 0;
  launch_smem(solve, dim3(p.n_v_heads, chunks, n_segs), kSolveThreads, sizeof(SolveSmem<DK>), s, x, x_stride, p, segs,
              chunk_min_rows, vec4, t, t_stride);
  launch_smem(walk, dim3((p.v_dim + kBV - 1) / kBV, p.n_v_heads, n_segs), kStateThreads, sizeof(StateSmem<DK>), s,
              static_cast<const float*>(x), x_stride, p, segs, chunk_min_rows, vec4, static_cast<const float*>(t),
              t_stride, state, out.data, out.stride);
}

}  // namespace

int gdn_chunk_min_rows(const GdnShape& p, bool batch_invariant) {
  return p.k_dim <= kMaxDK && !batch_invariant ? kGdnChunkMinRows : INT_MAX;
}

int64_t gdn_chunk_scratch_cols(const GdnShape& p, int max_rows, int chunk_min_rows) {
  return max_rows >= chunk_min_rows ? int64_t{p.n_v_heads} * kL : 0;
}

void launch_gdn_chunked(float* x, int64_t x_stride, const GdnShape& p, const float* a_log, const float* dt_bias,
                        const int32_t* segs, int n_segs, int max_rows, int min_rows, float* t, int64_t t_stride,
                        float* state, Mat out, cudaStream_t s) {
  if (max_rows < min_rows) return;
  const int warps = kPrepThreads / 32;
  launch(gdn_prep_kernel, dim3((p.n_k_heads + warps - 1) / warps, n_segs, std::min(max_rows, 65535)), kPrepThreads, s,
         x, x_stride, p, a_log, dt_bias, segs, min_rows);
  if (p.k_dim <= 32)
    launch_chunks<32>(x, x_stride, p, segs, n_segs, max_rows, min_rows, t, t_stride, state, out, s);
  else if (p.k_dim <= 64)
    launch_chunks<64>(x, x_stride, p, segs, n_segs, max_rows, min_rows, t, t_stride, state, out, s);
  else
    launch_chunks<128>(x, x_stride, p, segs, n_segs, max_rows, min_rows, t, t_stride, state, out, s);
}

}  // namespace dflash::cuda
