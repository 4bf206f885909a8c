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
// 23 mantissa bits, so the outputs differ from the token-by-token form's by about 2e-3 relative
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
constexpr int kStateThreads = 384;  // 12 warps, a 32 x 32 tile of a result each
constexpr int kPrepThreads = 128;
static_assert(kBV == kL, "T and the state's column blocks are staged alike");
// Shared-memory row strides (floats). Operands are read 16 bytes of a row at a time: 16 more than
// a multiple of 32 puts rows g and g + 1 of a fragment in different banks; 4 more (k, whose
// columns are read too, and blocks of v) costs two-way conflicts either way.
constexpr int kTS = kL + 16;       // T, P, y and u transposed: [64][80]
constexpr int kVS = kL + 4;        // v: [64][68]
template <int DK>
constexpr int kQS = DK + 16;       // q, the state transposed
template <int DK>
constexpr int kKS = DK + 4;        // k

// acc[mt] += sum over k < 8 KSTEPS of A[16 mt + i][k] B[k][n] for a warp's 8 columns n. a(m, k)
// gives A[m][k .. k + 3], already rounded to tf32; b(k, n) gives B[k .. k + 3][n] as tf32 bits
// (n relative to the warp's columns). Fragment layout of m16n8k8 (g = lane / 4, t = lane % 4): a
// (g, s) (g + 8, s) (g, s + 4) (g + 8, s + 4), b (s, g) (s + 4, g) for k slot s = t; accumulators
// (g, 2t) (g, 2t + 1) (g + 8, 2t) (g + 8, 2t + 1). A sum does not care which k each slot holds, as
// long as A and B agree: slots t and t + 4 of a pair of k steps take k = 4t, 4t + 1 (first step)
// and 4t + 2, 4t + 3 (second), so a row's four values are one 16-byte load.
template <int MT, int KSTEPS, typename FA, typename FB>
__device__ __forceinline__ void product(float (&acc)[MT][4], FA a, FB b) {
  static_assert(KSTEPS % 2 == 0, "k steps in pairs");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kp = 0; kp < KSTEPS / 2; ++kp) {
    const int k = kp * 16 + 4 * t;
    const uint4 bv = b(k, g);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const float4 lo = a(mt * 16 + g, k), hi = a(mt * 16 + g + 8, k);
      mma_tf32(acc[mt], __float_as_uint(lo.x), __float_as_uint(hi.x), __float_as_uint(lo.y), __float_as_uint(hi.y),
               bv.x, bv.y);
      mma_tf32(acc[mt], __float_as_uint(lo.z), __float_as_uint(hi.z), __float_as_uint(lo.w), __float_as_uint(hi.w),
               bv.z, bv.w);
    }
  }
}

// Operand loaders for product: four values of a row (16-byte aligned), or of a column.
__device__ __forceinline__ float4 row4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 col4(const float* p, int stride) {
  return make_float4(p[0], p[stride], p[2 * stride], p[3 * stride]);
}
__device__ __forceinline__ uint4 bits(float4 v) {
  return make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z), __float_as_uint(v.w));
}
__device__ __forceinline__ uint4 rounded(float4 v) { return make_uint4(to_tf32(v.x), to_tf32(v.y), to_tf32(v.z), to_tf32(v.w)); }

// A warp's MT x NT tile of m16n8 accumulators: acc[mt][nt] += sum over k of A[16 mt + i][k]
// B[k][8 nt + j], operands as for product (b's n is relative to the tile's columns). Each A row
// fragment serves NT column tiles, each B fragment MT row tiles.
template <int MT, int NT, int KSTEPS, typename FA, typename FB>
__device__ __forceinline__ void tile_product(float (&acc)[MT][NT][4], FA a, FB b) {
  static_assert(KSTEPS % 2 == 0, "k steps in pairs");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kp = 0; kp < KSTEPS / 2; ++kp) {
    const int k = kp * 16 + 4 * t;
    uint4 bv[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) bv[nt] = b(k, nt * 8 + g);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 lo = bits(a(mt * 16 + g, k)), hi = bits(a(mt * 16 + g + 8, k));
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_tf32(acc[mt][nt], lo.x, hi.x, lo.y, hi.y, bv[nt].x, bv[nt].y);
        mma_tf32(acc[mt][nt], lo.z, hi.z, lo.w, hi.w, bv[nt].z, bv[nt].w);
      }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
}

// Calls f(m, n, value) for each accumulator of a tile (m, n relative to the tile).
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_acc(float (&acc)[MT][NT][4], F f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(mt * 16 + g + (e >= 2 ? 8 : 0), nt * 8 + 2 * t + (e & 1), acc[mt][nt][e]);
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
// scaled by k_dim^-1/2) and rounded to tf32 (the products' operands), and per value head of the
// key head b -> beta, a -> log-decay g.
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
      if (i < dk) row[kh * dk + i] = tf32_rounded(q[m]), row[key_dim + kh * dk + i] = tf32_rounded(k[m]);
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
  float a[kL][kL + 1];     // A (the solve walks its rows and columns)
  float t[kL][kTS];        // T
  float x[3][16][16 + 1];  // the off-diagonal solve's partial products
  float G[kL], beta[kL];
};

// One block per (value head, chunk, segment): G (the cumulative log-decay, written over g in x),
// A, T = (I + A)^-1 (rounded to tf32, to t: row r of x's rows, 64 columns per value head) and
// U = T (beta v) (written over v in x). T in float32 on CUDA cores, by 16-row blocks: the diagonal
// blocks' inverses by forward substitution (a warp each), then T_ij = -T_ii sum_{j <= m < i} A_im
// T_mj, one block diagonal at a time.
template <int DK>
__global__ void __launch_bounds__(kSolveThreads)
    gdn_chunk_solve_kernel(float* x, int64_t x_stride, GdnShape p, const int32_t* segs, int chunk_min_rows,
                           bool vec4, float* tbuf, int64_t t_stride) {
  // The state walk after this kernel holds most of an SM's shared memory: released at the end, so
  // that its blocks do not take SMs from this kernel's while they wait.
  pdl_wait();
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
    product<kL / 16, DK / 8>(acc, [&](int m, int k) { return row4(&sm.k[m][k]); },
                             [&](int k, int n) { return bits(row4(&sm.k[nt * 8 + n][k])); });
    for_each_acc(acc, [&](int m, int n, float v) {
      const int j = nt * 8 + n;
      sm.a[m][j] = j < m ? sm.beta[m] * __expf(sm.G[m] - sm.G[j]) * v : 0.0f;
    });
  }
  __syncthreads();
  {  // the diagonal blocks: warp b, column j of block b on lanes j and j + 16 (even and odd terms)
    const int b0 = warp * 16, j = lane % 16, half = lane / 16;
    for (int i = 0; i < 16; ++i) {
      float s = 0.0f;
      for (int m = j + half; m < i; m += 2) s += sm.a[b0 + i][b0 + m] * sm.t[b0 + m][b0 + j];
      s += __shfl_xor_sync(kFull, s, 16);
      if (half == 0) sm.t[b0 + i][b0 + j] = i == j ? 1.0f : i > j ? -s : 0.0f;
      __syncwarp();
    }
    for (int e = lane; e < 16 * 16 * 3; e += 32) {  // the blocks above the diagonal are zero
      const int blk = e / 256, r = e % 256 / 16, c = e % 16;
      const int bj = warp + 1 + blk;
      if (bj < 4) sm.t[b0 + r][bj * 16 + c] = 0.0f;
    }
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {  // the blocks (i, i - d): X = sum_{j <= m < i} A_im T_mj, then T_ij = -T_ii X
    const int nb = 4 - d;
    for (int e = tid; e < nb * 256; e += kSolveThreads) {
      const int blk = e / 256, r = e % 256 / 16, c = e % 16, bi = blk + d, bj = blk;
      float s = 0.0f;
      for (int m = bj * 16; m < bi * 16; ++m) s += sm.a[bi * 16 + r][m] * sm.t[m][bj * 16 + c];
      sm.x[blk][r][c] = s;
    }
    __syncthreads();
    for (int e = tid; e < nb * 256; e += kSolveThreads) {
      const int blk = e / 256, r = e % 256 / 16, c = e % 16, bi = blk + d, bj = blk;
      float s = 0.0f;
      for (int m = 0; m <= r; ++m) s += sm.t[bi * 16 + r][bi * 16 + m] * sm.x[blk][m][c];
      sm.t[bi * 16 + r][bj * 16 + c] = -s;
    }
    __syncthreads();
  }
  // T rounded to tf32 (the products' operand), here and for the state kernel.
  float* trows = tbuf + (seg.scratch_first + r0) * t_stride + int64_t{h} * kL;
  for (int e = tid; e < kL * kL; e += kSolveThreads) {
    const int i = e / kL, j = e % kL;
    const float v = tf32_rounded(sm.t[i][j]);
    sm.t[i][j] = v;
    if (i < L) trows[i * t_stride + j] = v;
  }
  // U = T (beta v), 64 value columns at a time, over v in x.
  for (int c0 = 0; c0 < dv; c0 += kBV) {
    __syncthreads();  // T rounded; the previous block's products done
    stage_rows<kBV, kSolveThreads>(&sm.v[0][0], kVS, rows + col.v + c0, x_stride, L, dv - c0, vec4);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int nt = warp; nt < kBV / 8; nt += kSolveThreads / 32) {
      float acc[kL / 16][4];
      zero(acc);
      product<kL / 16, kL / 8>(acc, [&](int m, int k) { return row4(&sm.t[m][k]); }, [&](int k, int n) {
        const float4 v = col4(&sm.v[k][nt * 8 + n], kVS), b = row4(&sm.beta[k]);
        return rounded(make_float4(b.x * v.x, b.y * v.y, b.z * v.z, b.w * v.w));
      });
      for_each_acc(acc, [&](int m, int n, float v) {
        const int c = c0 + nt * 8 + n;
        if (m < L && c < dv) rows[m * x_stride + col.v + c] = v;
      });
    }
  }
  pdl_release();
}

template <int DK>
struct StateSmem {
  float q[kL][kQS<DK>], k[kL][kKS<DK>];
  float st[kBV][kQS<DK>];  // the state's columns, transposed: st[c][d] = S[d][c]
  float t[kL][kTS], P[kL][kTS];
  float y[kBV][kTS];       // beta exp(G) K S, transposed and rounded
  float u[kBV][kTS];       // U - T y, transposed and rounded
  float G[kL], eG[kL], bg[kL], dl[kL];  // G, exp(G), beta exp(G), exp(G_last - G)
};

// One block per (64 state columns, value head, segment): the chunks in order, the state's columns
// in shared memory. Per chunk, in 32 x 32 tiles a warp: P = mask(exp(G_i - G_j) q_i.k_j) (warps
// 0-3), Q S (4-7, kept for o), y = beta exp(G) K S (8-11); then u = U - T y (8-11); then o =
// exp(G) Q S + P u (4-7) and S = exp(G_last) S + (exp(G_last - G) K)^T u (0-3 and 8-11).
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
  const int warp = tid / 32, total = seg.replay + seg.n_rows;
  // This warp's tile of a 64 x 64 result, and of S (warps 0-3 and 8-11: DK x 64 in 32 x 32 tiles).
  const int tm = (warp % 4) / 2 * 32, tn = warp % 2 * 32;
  const int s_tile = warp < 4 ? warp : warp - 4, sd = s_tile / 2 * 32, sc = s_tile % 2 * 32;
  constexpr int kSTiles = DK / 32 * 2;
  const Cols col(p, h);
  float* S_mem = state + seg.slot * (int64_t{p.n_v_heads} * dk * dv) + int64_t{h} * dk * dv;
  for (int e = tid; e < DK * kBV; e += kStateThreads) {
    const int d = e / kBV, c = e % kBV;
    sm.st[c][d] = !seg.fresh && d < dk && j0 + c < dv ? S_mem[int64_t{d} * dv + j0 + c] : 0.0f;
  }
  float acc[2][4][4], qs[2][4][4];
  for (int r0 = 0; r0 < total; r0 += kL) {
    const int L = min(kL, total - r0);
    const float* rows = x + (seg.scratch_first + r0) * x_stride;
    __syncthreads();  // the previous chunk is done with the buffers
    stage_rows<DK, kStateThreads>(&sm.q[0][0], kQS<DK>, rows + col.q, x_stride, L, dk, vec4);
    stage_rows<DK, kStateThreads>(&sm.k[0][0], kKS<DK>, rows + col.k, x_stride, L, dk, vec4);
    stage_rows<kL, kStateThreads>(&sm.t[0][0], kTS, tbuf + (seg.scratch_first + r0) * t_stride + int64_t{h} * kL,
                                  t_stride, L, kL, vec4);
    cp_async_commit();
    if (tid < kL) {
      const int i = tid;
      const float G = rows[min(i, L - 1) * x_stride + col.g], G_last = rows[(L - 1) * x_stride + col.g];
      const float beta = i < L ? rows[i * x_stride + col.beta] : 0.0f;
      const float eG = __expf(G);
      sm.G[i] = G;  // rows past the end: exp(0) times zeros
      sm.eG[i] = eG;
      sm.bg[i] = beta * eG;
      sm.dl[i] = __expf(G_last - G);
    }
    cp_async_wait<0>();
    __syncthreads();
    const float G_last = sm.G[L - 1];
    {
      zero(acc);
      const auto* a_rows = warp < 8 ? &sm.q[0][0] : &sm.k[0][0];
      const int a_stride = warp < 8 ? kQS<DK> : kKS<DK>;
      auto a = [&](int m, int k) { return row4(a_rows + (tm + m) * a_stride + k); };
      if (warp < 4)
        tile_product<2, 4, DK / 8>(acc, a, [&](int k, int n) { return bits(row4(&sm.k[tn + n][k])); });
      else
        tile_product<2, 4, DK / 8>(acc, a, [&](int k, int n) { return rounded(row4(&sm.st[tn + n][k])); });
      if (warp < 4) {
        for_each_acc(acc, [&](int m, int n, float& v) {
          const int i = tm + m, j = tn + n;
          sm.P[i][j] = j <= i ? tf32_rounded(__expf(sm.G[i] - sm.G[j]) * v) : 0.0f;
        });
      } else if (warp < 8) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) qs[mt][nt][e] = acc[mt][nt][e];
      } else {
        for_each_acc(acc, [&](int m, int n, float& v) { sm.y[tn + n][tm + m] = tf32_rounded(sm.bg[tm + m] * v); });
      }
    }
    __syncthreads();  // P, y
    if (warp >= 8 && warp < 12) {  // u = U - T y
      zero(acc);
      tile_product<2, 4, kL / 8>(acc, [&](int m, int k) { return row4(&sm.t[tm + m][k]); },
                                 [&](int k, int n) { return bits(row4(&sm.y[tn + n][k])); });
      for_each_acc(acc, [&](int m, int n, float& v) {
        const int i = tm + m, c = j0 + tn + n;
        const float U = i < L && c < dv ? rows[i * x_stride + col.v + c] : 0.0f;
        sm.u[tn + n][i] = tf32_rounded(U - v);
      });
    }
    __syncthreads();  // u
    if (warp >= 4 && warp < 8) {  // o = exp(G) Q S + P u, to out (rows past the tape, columns inside v_dim)
      zero(acc);
      tile_product<2, 4, kL / 8>(acc, [&](int m, int k) { return row4(&sm.P[tm + m][k]); },
                                 [&](int k, int n) { return bits(row4(&sm.u[tn + n][k])); });
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = fmaf(sm.eG[tm + mt * 16 + (tid % 32) / 4 + (e >= 2 ? 8 : 0)],
                                                            qs[mt][nt][e], acc[mt][nt][e]);
      for_each_acc(acc, [&](int m, int n, float& core) {
        const int i = tm + m, c = j0 + tn + n, r = r0 + i;
        if (i >= L || r < seg.replay || c >= dv) return;
        *reinterpret_cast<__nv_bfloat16*>(out + int64_t{seg.first_row + r - seg.replay} * out_stride +
                                          int64_t{h} * dv + c) = __float2bfloat16(core);
      });
    } else if (s_tile < kSTiles) {  // S = exp(G_last) S + (exp(G_last - G) K)^T u
      const float decay = __expf(G_last);
      for_each_acc(acc, [&](int m, int n, float& v) { v = decay * sm.st[sc + n][sd + m]; });
      tile_product<2, 4, kL / 8>(acc, [&](int m, int k) { return col4(&sm.k[k][sd + m], kKS<DK>); },
                                 [&](int k, int n) {
                                   const float4 u = row4(&sm.u[sc + n][k]), dl = row4(&sm.dl[k]);
                                   return rounded(make_float4(dl.x * u.x, dl.y * u.y, dl.z * u.z, dl.w * u.w));
                                 });
      for_each_acc(acc, [&](int m, int n, float& v) { sm.st[sc + n][sd + m] = v; });
    }
  }
  __syncthreads();
  for (int e = tid; e < DK * kBV; e += kStateThreads) {
    const int d = e / kBV, c = e % kBV;
    if (d < dk && j0 + c < dv) S_mem[int64_t{d} * dv + j0 + c] = sm.st[c][d];
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

// The state walk's shared memory for this k_dim (the solve kernel's is smaller).
size_t state_smem_bytes(int k_dim) {
  return k_dim <= 32 ? sizeof(StateSmem<32>) : k_dim <= 64 ? sizeof(StateSmem<64>) : sizeof(StateSmem<128>);
}

}  // namespace

int gdn_chunk_min_rows(const GdnShape& p, bool batch_invariant) {
  // A GPU that gives a block less shared memory than the walk needs (H100: 227 KiB; the walk
  // takes up to 186 KiB) keeps the token-by-token form.
  static const size_t optin = [] {
    int device = 0, bytes = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return static_cast<size_t>(bytes);
  }();
  const bool fits = p.k_dim <= kMaxDK && state_smem_bytes(p.k_dim) <= optin;
  return fits && !batch_invariant ? kGdnChunkMinRows : INT_MAX;
}

int64_t gdn_chunk_scratch_cols(const GdnShape& p, int max_rows, int chunk_min_rows) {
  return max_rows >= chunk_min_rows ? int64_t{p.n_v_heads} * kL : 0;
}

void launch_gdn_chunked(float* x, int64_t x_stride, const GdnShape& p, const float* a_log, const float* dt_bias,
                        const int32_t* segs, int n_segs, int max_rows, int min_rows, float* t, int64_t t_stride,
                        float* state, Mat out, cudaStream_t s) {
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
