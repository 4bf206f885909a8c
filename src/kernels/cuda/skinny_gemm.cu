// out[M, N] = x[M, K] * w[N, K]^T for small M (decode, verification, draft
// blocks): memory-bound, so the kernel streams each weight once, through a
// cp.async ring in shared memory, and feeds tensor cores (mma.sync m16n8k16,
// fp32 accumulation).
//
// The product is computed transposed, out^T = w * x^T: A = 16 weight rows,
// B = 8 tokens. Each thread copies 16 bytes (8 consecutive k) of a weight row
// or a token row into the ring; ldmatrix gives the mma its operands
// (chunk_operands.cuh).
//
// Reduction order: warp j of the block sums chunks j, j+8, j+16, ... in
// increasing order; the 8 warp partials are then added in warp order. This
// depends only on K, so a row's result is bit-identical for any M.
//
// Weight loads carry a 128-byte L2 prefetch hint: a warp asks for 64 bytes of
// each of its 16 rows per chunk, and with the hint L2 fetches the whole line
// from DRAM at once (H100, bench-step at context 512: plain batch 1 6.06 ->
// 5.83 ms, the DFlash step 8.43 -> 8.11 ms; a 256-byte hint was no better).
// The weights are also marked evict-first in L2 (cp_async16_evict_first, device_math.cuh). The
// routed forms of 16-pair items are compiled for two blocks an SM: with evict-first copies and no
// bound their down form took 162 registers, one block an SM (steps of 9-16 rows 4-8% slower),
// and the routed 8-pair SwiGLU form for three (min_blocks). Every other form has no minimum: a
// minimum of one block raises ptxas's register counts in nearly every instantiation
// (bench/results/README.md).
//
// The normalizing form (kNorm, up to a few rows) takes its input from the
// residual stream instead: each block computes rmsnorm(residual + delta) of
// the rows into shared memory with the RMSNorm kernels' own code (row_norm.cuh),
// block 0 stores residual + delta, and the ring carries weights only. This
// saves a kernel and its wait between the products of a layer.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/chunk_operands.cuh"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/peer_collectives.h"
#include "kernels/cuda/peer_words.cuh"
#include "kernels/cuda/row_norm.cuh"

namespace dflash::cuda {
namespace {

constexpr int kWarps = 8;   // warps per block, splitting K
constexpr int kChunk = 32;  // k per chunk (4 threads x 8 elements)

// Output features of one block: RT tiles of 16, or 16 when a gate tile pairs with an up tile.
__host__ __device__ constexpr int features_per_block(int rt, bool swiglu) { return swiglu ? 16 : rt * 16; }

// One chunk's operands in shared memory: RT weight tiles of 16 rows and XT token tiles of 8
// rows, 32 k (4 pieces of 16 bytes) per row (XT = 0: the tokens are in shared memory already).
template <int XT, int RT>
struct Stage {
  uint4 w[RT][16][4];
  uint4 x[XT][8][4];
};
template <int RT>
struct Stage<0, RT> {
  uint4 w[RT][16][4];
};

// Stages per warp: as many chunks in flight as `budget` bytes of shared memory per warp hold,
// at least 2, at most `most` (8; 12 for the one-tile wide block, whose stages are small). 12 KiB a
// warp is 96 KiB a block, two blocks per SM; the normalizing form keeps 10 KiB a warp so that its
// rows fit beside the ring.
template <int XT, int RT>
constexpr int stages(int budget, int most = 8) {
  const int n = budget / static_cast<int>(sizeof(Stage<XT, RT>));
  return n < 2 ? 2 : n > most ? most : n;
}
// kWide (one block per SM, see wide_row_tiles): 24 KiB a warp, 192 KiB a block. kThree (the
// routed forms, and the SwiGLU form of up to 16 tokens): 9 KiB a warp, so that three blocks of the
// one-tile forms share an SM (gate_up at batch 1 of the 30B-A3B shape: 384 blocks, one wave; with
// two blocks an SM, 1.45 waves). Wider stages (the down products' four row tiles with 16 or 32
// rows) still get the two-stage minimum: two blocks.
template <int MT, int RT, bool kNorm, bool kWide = false, bool kRouted = false, bool kThree = kRouted>
constexpr int kStages = kNorm ? stages<0, RT>(10240)
                               : stages<MT, RT>(kWide ? 24576 : kThree ? 9216 : 12288, kWide && RT == 1 ? 12 : 8);
// Whether a form takes kThree's ring: the routed forms, and the plain SwiGLU form of up to 16
// tokens, whose registers (64-75) let three blocks share an SM.
constexpr bool three_blocks(int mt, bool swiglu, bool norm, bool routed) {
  return routed || (swiglu && !norm && mt <= 2);
}
template <int MT, int RT, bool kNorm>
using StageOf = Stage<kNorm ? 0 : MT, RT>;

// Bytes of the ring.
template <int MT, int RT, bool kNorm, bool kWide = false, bool kRouted = false, bool kThree = kRouted>
constexpr size_t ring_bytes() {
  return sizeof(StageOf<MT, RT, kNorm>) * kStages<MT, RT, kNorm, kWide, kRouted, kThree> * kWarps;
}
// Bytes of the ring and the cross-warp reduction; the normalized rows follow them. The reduction
// reuses the ring but in the routed form, where the next work unit's first weights are on their
// way while a unit's partial sums are added.
template <int MT, int RT, bool kNorm, bool kWide = false, bool kRouted = false, bool kThree = kRouted>
constexpr size_t smem_bytes() {
  constexpr size_t ring = ring_bytes<MT, RT, kNorm, kWide, kRouted, kThree>();
  constexpr size_t red = sizeof(float) * kWarps * RT * MT * 4 * 32;
  return kRouted ? ring + red : ring > red ? ring : red;
}

// Shared memory a block may use so that two blocks fit an SM (228 KiB, 1 KiB reserved a block).
constexpr size_t kMaxBlockSmem = 112 * 1024;
// The wide ring's block (one a SM), where the device allows that much.
constexpr size_t kWideBlockSmem = 200 * 1024;
// Normalized rows in shared memory are padded by 16 bytes (fewer bank conflicts).
constexpr int64_t norm_row_elems(int64_t k) { return k + 8; }

// The normalizing form's input: rmsnorm(residual + delta) of M rows into `rows` (row stride
// norm_row_elems(K)), G rows at a time (norm_rows: one round trip to memory for each G rows);
// with store_residual, residual + delta also goes to norm.residual_out.
template <int G, int P, typename R>
__device__ __forceinline__ void normalize_rows(const RowNorm& norm, int M, int K, bool store_residual, bf16* rows) {
  const int64_t rs = norm_row_elems(K);
  for (int t0 = 0; t0 < M; t0 += G) {
    auto store = [&](int t, int i, const uint4& y) { *reinterpret_cast<uint4*>(rows + (t0 + t) * rs + 8 * i) = y; };
    const R* res = static_cast<const R*>(norm.residual) + t0 * norm.residual_stride;
    const int n = min(G, M - t0);
    if (norm.delta) {
      R* res_out = store_residual ? static_cast<R*>(norm.residual_out) + t0 * norm.residual_out_stride : nullptr;
      norm_rows<G, P, true>(n, res, norm.residual_stride, norm.delta + t0 * norm.delta_stride, norm.delta_stride,
                            res_out, norm.residual_out_stride, norm.weight, norm.eps, K, store);
    } else {
      norm_rows<G, P, false>(n, res, norm.residual_stride, nullptr, 0, static_cast<R*>(nullptr), 0, norm.weight,
                             norm.eps, K, store);
    }
  }
}

// ptxas's minimum of blocks an SM: two for the routed 16-pair forms, three for the routed 8-pair
// SwiGLU form (its ring's three blocks: 72 registers, 94 without the bound), none (0) elsewhere
// (see the top).
constexpr int min_blocks(int mt, bool routed, bool swiglu) {
  return routed && mt == 2 ? 2 : routed && swiglu && mt == 1 ? 3 : 0;
}

// MT: 8-token tiles (M <= 8 * MT); RT: 16-row weight tiles per block.
// kSwiglu (RT == 2): w = [gate; up] with N rows each; tile 0 takes gate rows, tile 1 the same
// up rows, and the block writes silu(gate) * up for its 16 features from the float32 sums,
// rounded once (the separate product and SwiGLU kernels round gate and up first).
// Each warp streams its chunks through a ring of kStages stages in shared memory with
// cp.async, so that many chunks are in flight whatever the register budget; the first stages'
// weights are requested before waiting on the previous kernel (they need nothing from it).
// kNorm: x is unused; the rows come from `norm` (see RowNorm), K == the rows' width, and R is
// the residual stream's element type (float or bf16).
// kRouted: a block takes work units from routed.next_unit: unit u is item u / gridDim.x of
// routed.items (RoutedRows: an expert's weights and up to 8 * MT of its pairs, read from and
// written to the pairs' rows), columns block u % gridDim.x.
// push (plain forms, push.n_ranks > 1): each output word (two features of a token) also goes to
// the peers' push inboxes, flagged with the pushed exchange's call number (peer_collectives.h).
template <int MT, int RT, bool kSwiglu, bool kNorm, typename R = bf16, bool kWide = false, bool kRouted = false>
__global__ void __launch_bounds__(kWarps * 32, min_blocks(MT, kRouted, kSwiglu))
    skinny_gemm_kernel(const bf16* __restrict__ x, int64_t x_stride, int M, const bf16* __restrict__ w,
                       int64_t w_stride, int N, int K, const bf16* __restrict__ bias, bf16* __restrict__ out,
                       int64_t out_stride, RowNorm norm, int64_t w_group_step, int out_group_cols,
                       RoutedRows routed, PeerPush push) {
  static_assert(!kSwiglu || RT == 2, "the SwiGLU form pairs one gate tile with one up tile");
  static_assert(!kNorm || kWarps * 32 == kRowThreads, "norm_rows needs the whole block");
  constexpr bool kThree = three_blocks(MT, kSwiglu, kNorm, kRouted);
  const uint64_t w_policy = evict_first_policy();
  constexpr int S = kStages<MT, RT, kNorm, kWide, kRouted, kThree>;
  using St = StageOf<MT, RT, kNorm>;
  DFLASH_DYNAMIC_SMEM(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4;
  constexpr int kPerBlock = features_per_block(RT, kSwiglu);
  // Row groups (launch_skinny_gemm_groups): blockIdx.y is the group, N its rows.
  w += blockIdx.y * w_group_step;
  out += blockIdx.y * out_group_cols;
  St* ring = reinterpret_cast<St*>(smem_raw) + warp * S;
  // kNorm: the normalized rows, [M][norm_row_elems(K)]
  bf16* rows = reinterpret_cast<bf16*>(smem_raw + smem_bytes<MT, RT, kNorm, kWide, kRouted, kThree>());
  const int n_chunks = (K + kChunk - 1) / kChunk;
  const int n_mine = warp < n_chunks ? (n_chunks - warp + kWarps - 1) / kWarps : 0;  // chunks warp + 8i

  // A unit's operands: the weights (rows [n0, n0 + kPerBlock)), the M token rows (routed: `pairs`
  // are the rows' pairs) and this lane's token rows (token mt * 8 + g; null past M), looked up
  // once: the routed form reads them from the pair list, which would otherwise put a dependent
  // load before every chunk's copies.
  struct Operands {
    const bf16* w = nullptr;
    int M = 0;
    const int32_t* pairs = nullptr;
    int64_t n0 = 0;
    const bf16* x_of[kNorm ? 1 : MT] = {};
  };
  // This lane's pieces of a stage: weight piece p = lane + 32j (tile p / 64, row p / 4 % 16,
  // 16 bytes p % 4), token piece lane + 32j (tile j, row lane / 4, 16 bytes lane % 4), each stored
  // where chunk_piece puts it (chunk_operands.cuh).
  // A unit's pieces' rows are looked up once: piece j of this lane is row n0 + g + 8 (j % 2) of
  // tile j / 2 (+ N for the SwiGLU form's up tile), so one pointer (lane_rows: the lane's first row
  // at the warp's first chunk) and offsets that are the same for every lane give every piece of
  // every chunk, instead of a 64-bit product a piece and chunk (the 16-pair routed gate/up ran
  // about 325 instructions a warp a chunk against 180 in the 8-pair form:
  // bench/results/ncu_h200_routed_b8_moe.txt; the dense forms: bench_step_h200_lane_pointers_ab.txt).
  struct LaneRows {
    const bf16* w;  // row n0 + g, k = warp's first chunk + 8 (lane % 4)
    int64_t f;      // feature n0 + g
  };
  auto lane_rows = [&](const Operands& o) {
    return LaneRows{o.w + (o.n0 + g) * w_stride + warp * kChunk + q * 8, o.n0 + g};
  };
  auto issue_w = [&](int i, const Operands& o, const LaneRows& lr) {
    if (i >= n_mine) return;
    const int k0 = (warp + i * kWarps) * kChunk;
    St& st = ring[i % S];
#pragma unroll
    for (int j = 0; j < 2 * RT; ++j) {
      const int p = lane + 32 * j, rt = p / 64, r = p / 4 % 16, part = p % 4;
      const int k = k0 + part * 8;
      const int tile_row = (kSwiglu ? 0 : rt * 16) + 8 * (j % 2);  // the piece's row from n0 + g
      const bool ok = lr.f + tile_row < N && k < K;  // K % 8 == 0: a piece is all in or all out
      const int64_t rows_on = kSwiglu && rt == 1 ? N + tile_row : tile_row;
      const bf16* src = lr.w + rows_on * w_stride + int64_t{i} * (kWarps * kChunk);
      cp_async16_evict_first(&st.w[rt][r][chunk_piece(r, part)], ok ? src : o.w, ok, w_policy);
    }
  };
  auto issue_x = [&](int i, const Operands& o) {
    if constexpr (!kNorm) {
      if (i >= n_mine) return;
      const int k = (warp + i * kWarps) * kChunk + q * 8;
      St& st = ring[i % S];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const bool ok = o.x_of[mt] && k < K;
        cp_async16(&st.x[mt][g][chunk_piece(g, q)], ok ? o.x_of[mt] + k : x, ok);
      }
    }
  };
  // The first S stages, one cp.async group each: the weights, and the token rows too when they
  // are complete already (with_x: after the kernel's wait).
  auto issue_first = [&](const Operands& o, bool with_x) {
    const LaneRows lr = lane_rows(o);
#pragma unroll
    for (int i = 0; i < S; ++i) {
      issue_w(i, o, lr);
      if (with_x) issue_x(i, o);
      cp_async_commit();
    }
  };

  // The product of unit o. wait: the kernel's wait comes once the weights' first stages are
  // requested. issued: its first stages (weights and token rows) are requested already (the
  // routed form's previous unit did). next (routed): the next unit, whose first stages are
  // requested before this unit's partial sums are added (when has_next: next() gives its operands
  // then); mid() runs once, halfway through the warp's chunks (the routed form reads the next
  // unit's pairs there, so that they have arrived when next() uses them).
  auto product = [&](const Operands& o, bool wait, bool issued, bool has_next, auto&& mid, auto&& next) {
    const int M = o.M;
    const LaneRows lr = lane_rows(o);
    if (!issued) issue_first(o, false);
    if (wait) pdl_begin();
    // A pushing product's exchange number, read once its wait is over and used by the epilogue:
    // the read's round trip goes under the stream instead of before the first word's push.
    [[maybe_unused]] uint64_t call = 0;
    if constexpr (!kSwiglu && !kRouted && !kNorm)
      if (push.n_ranks > 1) call = push_call(push);
    if constexpr (kNorm) {
      // The weights above are on their way while the rows are normalized, 4 pieces of rows a
      // thread at once (4 rows of up to 2048 values, 2 of 4096), so that a few rows cost one round
      // trip to memory, not one each (H100, 12 layers of the 30B-A3B shape, plain batch 8:
      // 2.86 -> 2.77 ms). 8 pieces took more than 128 registers (one block an SM, or spills).
      const int pieces = (K / 8 + kRowThreads - 1) / kRowThreads;
      const bool store_residual = blockIdx.x == 0;
      if (pieces <= 1) normalize_rows<4, 1, R>(norm, M, K, store_residual, rows);
      else if (pieces == 2) normalize_rows<2, 2, R>(norm, M, K, store_residual, rows);
      else normalize_rows<1, kVecPerThread, R>(norm, M, K, store_residual, rows);
      __syncthreads();
    } else if (!issued) {
#pragma unroll
      for (int i = 0; i < S; ++i) {
        issue_x(i, o);
        cp_async_commit();
      }
    }

    float acc[RT][MT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][mt][i] = 0.0f;

    // Warp j sums its chunks j, j + 8, ... in increasing order.
    const int half = n_mine / 2;
    for (int i = 0; i < n_mine; ++i) {
      if (i == half) mid();
      cp_async_wait<S - 1>();  // chunk i has landed (later groups may still be in flight)
      __syncwarp();
      const St& st = ring[i % S];
      uint32_t wa[RT][2][4], xb[MT][4];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int s = 0; s < 2; ++s) chunk_weights(wa[rt][s], st.w[rt], s, lane);
      if constexpr (kNorm) {
        const int k0 = (warp + i * kWarps) * kChunk;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int t = mt * 8 + g;
          chunk_tokens_of_row(xb[mt], rows + t * norm_row_elems(K), k0, K, t < M, lane);
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) chunk_tokens(xb[mt], st.x[mt], lane);
      }
      __syncwarp();  // every lane has read the stage before it is refilled
      issue_w(i + S, o, lr);
      issue_x(i + S, o);
      cp_async_commit();
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) chunk_mma(acc[rt][mt], wa[rt], xb[mt]);
    }
    if (n_mine == 0) mid();
    cp_async_wait<0>();
    if constexpr (kRouted) {
      if (has_next) {
        __syncwarp();  // every lane has read the ring's last stages
        issue_first(next(), true);
      }
    }

    // The outputs: lane l of warp w adds element [w % 4][l] of every warp's partials of output tiles
    // w / 4, w / 4 + 2, ... (tile t: rt = t / MT, mt = t % MT), i.e. feature l / 4 (+ 8 for w % 4 >= 2)
    // and token (l % 4) * 2 + (w & 1) of each. The indices are fixed a thread and the tiles unrolled;
    // the routed form's output rows are read here, before the partial sums' barriers.
    constexpr int kTiles = (kSwiglu ? 1 : RT) * MT, kMine = (kTiles + 1) / 2;
    const int i = warp % 4;
    const int64_t f0 = o.n0 + g + (i >= 2 ? 8 : 0);
    const int t0 = q * 2 + (i & 1);
    auto tile = [&](int k) { return 2 * k + warp / 4; };         // this thread's k-th output tile
    auto token = [&](int k) { return tile(k) % MT * 8 + t0; };  // and its token
    int32_t out_row[kMine];
#pragma unroll
    for (int k = 0; k < kMine; ++k) {
      out_row[k] = token(k);
      if constexpr (kRouted) out_row[k] = tile(k) < kTiles && token(k) < M ? o.pairs[token(k)] : 0;
    }

    // Cross-warp reduction in warp order, then bias and the bf16 store (red reuses the ring but
    // in the routed form).
    __syncthreads();
    auto& red = *reinterpret_cast<float(*)[kWarps][RT][MT][4][32]>(
        smem_raw + (kRouted ? ring_bytes<MT, RT, kNorm, kWide, kRouted, kThree>() : 0));
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][rt][mt][i][lane] = acc[rt][mt][i];
    __syncthreads();
    if constexpr (!kSwiglu && !kRouted && !kNorm) {
      if (push.n_ranks > 1) {
        // A thread takes two adjacent features of a token (the same sums as below, rounded
        // together): one 4-byte word here and, flagged, in every peer's inbox.
        for (int e = threadIdx.x; e < RT * 8 * MT * 8; e += kWarps * 32) {
          const int token = e % (MT * 8), f = 2 * (e / (MT * 8));  // f: the pair's first feature in the block
          const int64_t feature = o.n0 + f;
          if (feature >= N || token >= M) continue;
          const int rt = f / 16, mt = token / 8, tt = token % 8;
          const int l = (f % 8) * 4 + tt / 2, i = (f % 16 >= 8 ? 2 : 0) + (tt & 1);  // feature f + 1: lane l + 4
          float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
          for (int j = 0; j < kWarps; ++j) s0 += red[j][rt][mt][i][l], s1 += red[j][rt][mt][i][l + 4];
          if (bias) {
            s0 += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[feature]);
            s1 += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[feature + 1]);
          }
          const __nv_bfloat162 y = __floats2bfloat162_rn(s0, s1);
          const uint32_t word = *reinterpret_cast<const uint32_t*>(&y);
          *reinterpret_cast<uint32_t*>(out + token * out_stride + feature) = word;
          push_word(push, call, (token * N + feature) / 2, word);
        }
        return;
      }
    }
#pragma unroll
    for (int k = 0; k < kMine; ++k) {
      const int t = tile(k), rt = t / MT, mt = t % MT;
      const int64_t feature = f0 + rt * 16;
      if (t >= kTiles || feature >= N || token(k) >= M) continue;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kWarps; ++j) sum += red[j][rt][mt][i][lane];
      if (bias) sum += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[feature]);
      if constexpr (kSwiglu) {
        float up = 0.0f;
#pragma unroll
        for (int j = 0; j < kWarps; ++j) up += red[j][1][mt][i][lane];
        if (bias) up += __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(bias)[N + feature]);
        sum = sum / (1.0f + expf(-sum)) * up;  // float32 gate and up, rounded once below
      }
      reinterpret_cast<__nv_bfloat16*>(out)[int64_t{out_row[k]} * out_stride + feature] = __float2bfloat16(sum);
    }
  };

  if constexpr (kRouted) {
    // Which experts and pairs come from the routing, so the weights cannot be requested before
    // it is done: before the wait only when it finished before the previous kernel released
    // (items_ready: the down products, which follow the gate/up ones). The blocks take work
    // units (an item's columns [n0, n0 + kPerBlock)) from a counter the routing zeroed: however
    // many blocks the GPU holds beside the kernels around it, none waits for another's units.
    bool wait = routed.items_ready;  // whether the wait is still to come (in the first unit)
    if (!wait) pdl_begin();
    const int cols = static_cast<int>(gridDim.x);  // a unit is item unit / cols, columns block unit % cols
    const int n_units = *routed.n_items * cols;
    const int n_blocks = cols * static_cast<int>(gridDim.y);
    const float inv_cols = 1.0f / static_cast<float>(cols), inv_x_div = 1.0f / static_cast<float>(routed.x_div);
    // A unit's operands from its item's fields (expert, first pair, pair count) and this lane's
    // pairs (tokens mt * 8 + g; -1 past the count).
    auto operands_of = [&](int unit, const int (&item)[3], const int (&pair)[MT]) {
      Operands o;
      o.w = w + item[0] * routed.w_step;
      o.M = item[2];
      o.pairs = routed.pairs + item[1];
      o.n0 = static_cast<int64_t>(div_mod(unit, cols, inv_cols).r) * kPerBlock;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        o.x_of[mt] =
            pair[mt] >= 0 ? x + static_cast<int64_t>(div_mod(pair[mt], routed.x_div, inv_x_div).q) * x_stride : nullptr;
      return o;
    };
    auto read_item = [&](int unit, int (&item)[3]) {
      const int32_t* it = routed.items + 3 * div_mod(unit, cols, inv_cols).q;
      item[0] = it[0], item[1] = it[1], item[2] = it[2];
    };
    auto read_pairs = [&](const int (&item)[3], int (&pair)[MT]) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int t = mt * 8 + g;
        pair[mt] = t < item[2] ? routed.pairs[item[1] + t] : -1;
      }
    };
    // Block b's first unit is b; then units n_blocks + counter, each taken when the unit before it
    // starts. The next unit's item is read then, its pairs halfway through the unit, and its first
    // stages (weights and token rows) are requested before the unit's partial sums are added: one
    // round trip (the counter's) between two units' streams instead of four.
    __shared__ int next_s;
    int unit = static_cast<int>(blockIdx.y * gridDim.x + blockIdx.x);
    Operands cur;
    if (unit < n_units) {
      int item[3], pair[MT];
      read_item(unit, item);
      read_pairs(item, pair);
      cur = operands_of(unit, item, pair);
    }
    bool issued = false;
    while (unit < n_units) {
      if (threadIdx.x == 0) next_s = n_blocks + atomicAdd(routed.next_unit, 1);
      __syncthreads();  // next_s is set (the product's first barrier comes after its main loop)
      const int next = next_s;
      const bool has_next = next < n_units;
      int item[3] = {0, 0, 0}, pair[MT];
      if (has_next) read_item(next, item);
      Operands nxt;
      product(
          cur, wait, issued, has_next, [&] { read_pairs(item, pair); },
          [&] {
            nxt = operands_of(next, item, pair);
            return nxt;
          });
      wait = false;
      issued = has_next;
      unit = next;
      cur = nxt;
      __syncthreads();  // every thread has read next_s and finished the unit's epilogue
    }
    if (wait) pdl_begin();  // a block without units waits too
  } else {
    Operands o;
    o.w = w;
    o.M = M;
    o.n0 = static_cast<int64_t>(blockIdx.x) * kPerBlock;
    if constexpr (!kNorm) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int t = mt * 8 + g;
        o.x_of[mt] = t < M ? x + static_cast<int64_t>(t) * x_stride : nullptr;
      }
    }
    product(o, true, false, false, [] {}, [&] { return o; });
  }
}

// Whether the device gives a block the wide ring's shared memory (H100: 227 KiB).
bool wide_ring_fits() {
  static const bool fits = [] {
    int device = 0, optin = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return static_cast<size_t>(optin) >= kWideBlockSmem;
  }();
  return fits;
}

// Dynamic shared memory of a launch: the ring, and for kNorm the normalized rows.
template <int MT, int RT, bool kNorm, bool kThree = false>
size_t launch_smem_bytes(int M, int64_t K) {
  return smem_bytes<MT, RT, kNorm, false, false, kThree>() + (kNorm ? sizeof(bf16) * M * norm_row_elems(K) : 0);
}

// Row groups of a launch (grid.y): group g's weight rows start g * w_step elements after the first
// group's, its outputs g * out_cols columns after the first group's.
struct Groups {
  unsigned count = 1;
  int64_t w_step = 0;
  int out_cols = 0;
};

template <int MT, int RT, bool kSwiglu, bool kNorm = false, typename R = bf16, bool kWide = false,
          bool kRouted = false>
void launch_tiles(const Mat& x, const Mat& w, const bf16* bias, Mat out, const RowNorm& norm, cudaStream_t s,
                  Groups groups = {}, const RoutedRows& routed = {}, const PeerPush& push = {}) {
  constexpr auto kernel = skinny_gemm_kernel<MT, RT, kSwiglu, kNorm, R, kWide, kRouted>;
  static std::atomic<uint64_t> configured{0};
  once_per_device(configured, [] {
    CUDA_CHECK(cudaFuncSetAttribute(kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kWide || kRouted ? kWideBlockSmem : kMaxBlockSmem)));
  });
  const int64_t n = kSwiglu ? out.cols : w.rows;  // output features
  constexpr int kPerBlock = features_per_block(RT, kSwiglu);
  const unsigned blocks = static_cast<unsigned>((n + kPerBlock - 1) / kPerBlock);
  static_assert(!(kWide && kNorm), "the normalizing form has no wide blocks");
  const size_t smem = kWide     ? smem_bytes<MT, RT, false, true>()
                      : kRouted ? smem_bytes<MT, RT, false, false, true>()
                                : launch_smem_bytes<MT, RT, kNorm, three_blocks(MT, kSwiglu, kNorm, false)>(
                                      static_cast<int>(x.rows), w.cols);
  if constexpr (kRouted) {
    // As many blocks as the GPU holds at once (at most one a unit of the items' bound), not one
    // a possible unit (136 items at 16 rows of the 30B-A3B shape, mostly empty: their launch
    // cost more than the product).
    static const int resident = [smem] {
      int device = 0, n = 0, sms = 0;
      CUDA_CHECK(cudaGetDevice(&device));
      CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &n, kernel, kWarps * 32, smem));
      return std::max(1, n) * sms;
    }();
    const unsigned fill = static_cast<unsigned>((resident + blocks - 1) / blocks);
    groups.count = std::max(1u, std::min(groups.count, fill));
  }
  launch_smem(kernel, dim3(blocks, groups.count), kWarps * 32, smem, s, x.data, x.stride, static_cast<int>(x.rows),
              w.data, w.stride, static_cast<int>(n), static_cast<int>(w.cols), bias, out.data, out.stride, norm,
              groups.w_step, groups.out_cols, routed, push);
}

template <int RT, bool kSwiglu = false, bool kWide = false>
void launch_rt(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s, Groups groups = {},
               const PeerPush& push = {}) {
  const RowNorm none{};
  const RoutedRows unrouted{};
  switch ((x.rows + 7) / 8) {
    case 1: return launch_tiles<1, RT, kSwiglu, false, bf16, kWide>(x, w, bias, out, none, s, groups, unrouted, push);
    case 2: return launch_tiles<2, RT, kSwiglu, false, bf16, kWide>(x, w, bias, out, none, s, groups, unrouted, push);
    case 3: return launch_tiles<3, RT, kSwiglu, false, bf16, kWide>(x, w, bias, out, none, s, groups, unrouted, push);
    default: return launch_tiles<4, RT, kSwiglu, false, bf16, kWide>(x, w, bias, out, none, s, groups, unrouted, push);
  }
}

// Row tiles of a wide block (one block per SM, with the 24 KiB-a-warp ring), or 0 for the
// usual blocks (two per SM, one or two tiles). Products of a few thousand rows (q/k/v, o_proj,
// down: 4096-6144) at more than 8 tokens take as many tiles as make one block per SM: a block
// streams the tokens' rows of its K chunks from L2 once for all its tiles (with one tile a
// block, 16 tokens moved as many bytes from L2 as the weights did), and the deeper ring keeps
// as many weight bytes in flight as two blocks did. The tiles and the ring never change a
// feature's reduction order (the warps split K alone), so every form gives the same bits.
// H100, bench-step at context 512: the DFlash step 7.93 -> 7.69 ms at batch 1, 9.47 -> 8.50 ms
// at batch 2 (wide blocks with the 12 KiB ring: 8.22 ms at batch 1). Products of fewer rows than
// 16 an SM (the 30B-A3B shape's o and its draft's down: 2048 rows, 128 blocks, one an SM either
// way) take one tile with the deep ring, up to 12 stages (H100, 12 layers of that shape: the
// DFlash step 2.370 -> 2.318 ms at batch 1, 3.328 -> 3.243 ms at batch 2). `wide` forces a side
// (tests).
constexpr int kMaxRowTiles = 4;
int wide_row_tiles(const Mat& w, int64_t m, int n_sms, KernelForms::Wide wide) {
  using Wide = KernelForms::Wide;
  if (w.rows >= int64_t{32} * 2 * n_sms) return 0;  // two tiles a block leave two blocks per SM
  if (wide == Wide::never || (m <= 8 && wide != Wide::any_rows) || !wide_ring_fits()) return 0;
  const int64_t per_sm = (w.rows + int64_t{16} * n_sms - 1) / (int64_t{16} * n_sms);
  return static_cast<int>(std::min<int64_t>(per_sm, kMaxRowTiles));
}

// Row tiles per block of a usual product: two only when that still leaves two blocks per SM.
bool two_row_tiles(const Mat& w, int n_sms) { return w.rows >= int64_t{32} * 2 * n_sms; }

}  // namespace

bool skinny_gemm_supported(const Mat& x, const Mat& w, const Mat& out) {
  return x.rows >= 1 && x.rows <= kSkinnyMaxRows && w.cols % 8 == 0 && x.stride % 8 == 0 && w.stride % 8 == 0 &&
         aligned16(x.data) && aligned16(w.data) && w.rows < (int64_t{1} << 31) && w.cols < (int64_t{1} << 31);
}

namespace {
// The block shape for all of a launch's groups together (`all`: every group's rows), then the launch.
void launch_tiled(const Mat& x, const Mat& w, const Mat& all, const bf16* bias, Mat out, Groups groups, int n_sms,
                  KernelForms::Wide wide, cudaStream_t s, const PeerPush& push = {}) {
  switch (wide_row_tiles(all, x.rows, n_sms, wide)) {
    case 0: break;
    case 1: return launch_rt<1, false, true>(x, w, bias, out, s, groups, push);
    case 2: return launch_rt<2, false, true>(x, w, bias, out, s, groups, push);
    case 3: return launch_rt<3, false, true>(x, w, bias, out, s, groups, push);
    default: return launch_rt<4, false, true>(x, w, bias, out, s, groups, push);
  }
  if (two_row_tiles(all, n_sms)) launch_rt<2>(x, w, bias, out, s, groups, push);
  else launch_rt<1>(x, w, bias, out, s, groups, push);
}
}  // namespace

void launch_skinny_gemm(const Mat& x, const Mat& w, const bf16* bias, Mat out, int n_sms, KernelForms::Wide wide,
                        cudaStream_t s) {
  launch_tiled(x, w, w, bias, out, Groups{}, n_sms, wide, s);
}

void launch_skinny_gemm_pushed(const Mat& x, const Mat& w, const bf16* bias, Mat out, int n_sms,
                               KernelForms::Wide wide, const PeerPush& push, cudaStream_t s) {
  launch_tiled(x, w, w, bias, out, Groups{}, n_sms, wide, s, push);
}

bool skinny_gemm_groups_supported(const Mat& x, const Mat& w, int count) {
  return skinny_gemm_supported(x, w, Mat{}) && count >= 1 && count <= 65535 && w.rows * count < (int64_t{1} << 31);
}

void launch_skinny_gemm_groups(const Mat& x, const Mat& w, int count, int64_t group_step, Mat out, int n_sms,
                               KernelForms::Wide wide, cudaStream_t s) {
  Mat all = w;
  all.rows = w.rows * count;
  launch_tiled(x, w, all, nullptr, out, Groups{static_cast<unsigned>(count), group_step * w.stride, static_cast<int>(w.rows)},
               n_sms, wide, s);
}

void launch_skinny_gemm_swiglu(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s) {
  launch_rt<2, true>(x, w, bias, out, s);
}

bool skinny_gemm_norm_supported(const RowNorm& n, int64_t rows, const Mat& w, bool swiglu, int n_sms) {
  if (rows < 1 || rows > 8 || w.cols % 8 != 0 || w.stride % 8 != 0 || !aligned16(w.data)) return false;
  if (!rows_fit_registers(w.cols, {n.residual_stride, n.delta ? n.delta_stride : 0, n.delta ? n.residual_out_stride : 0},
                          {n.residual, n.delta, n.residual_out, n.weight}))
    return false;
  if (n.delta && (!n.residual_out || n.residual_out == n.residual)) return false;  // other blocks still read it
  const size_t smem = swiglu || two_row_tiles(w, n_sms) ? launch_smem_bytes<1, 2, true>(static_cast<int>(rows), w.cols)
                                                        : launch_smem_bytes<1, 1, true>(static_cast<int>(rows), w.cols);
  return smem <= kMaxBlockSmem;
}

template <typename R>
void launch_norm_as(const RowNorm& n, int64_t rows, const Mat& w, const bf16* bias, Mat out, bool swiglu, int n_sms,
                    cudaStream_t s) {
  const Mat x{nullptr, rows, w.cols, 0};
  if (swiglu) launch_tiles<1, 2, true, true, R>(x, w, bias, out, n, s);
  else if (two_row_tiles(w, n_sms)) launch_tiles<1, 2, false, true, R>(x, w, bias, out, n, s);
  else launch_tiles<1, 1, false, true, R>(x, w, bias, out, n, s);
}

void launch_skinny_gemm_norm(const RowNorm& n, int64_t rows, const Mat& w, const bf16* bias, Mat out, bool swiglu,
                             int n_sms, cudaStream_t s) {
  if (n.f32) launch_norm_as<float>(n, rows, w, bias, out, swiglu, n_sms, s);
  else launch_norm_as<bf16>(n, rows, w, bias, out, swiglu, n_sms, s);
}

namespace {
template <int RT, bool kSwiglu>
void launch_routed_rt(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, int tile_rows, int max_items,
                      cudaStream_t s) {
  const RowNorm none{};
  const Groups items{static_cast<unsigned>(max_items), 0, 0};
  switch (tile_rows / 8) {
    case 1: return launch_tiles<1, RT, kSwiglu, false, bf16, false, true>(x, w, nullptr, out, none, s, items, routed);
    case 2: return launch_tiles<2, RT, kSwiglu, false, bf16, false, true>(x, w, nullptr, out, none, s, items, routed);
    default: return launch_tiles<4, RT, kSwiglu, false, bf16, false, true>(x, w, nullptr, out, none, s, items, routed);
  }
}
}  // namespace

// The down products take four row tiles a block: an item's blocks then read its pairs' rows
// from L2 once for 64 weight rows (with one tile, 16 pairs' rows of K = 768 are as many bytes as
// the tile's weights), and a batch-1 step's 8 items make one wave of 256 blocks. Items of 32 pairs
// take two: four tiles of 32 tokens hold one block an SM (a 96 KiB ring and a 64 KiB reduction),
// two tiles let two blocks share it (H100, 12-layer 30B-A3B shape: DFlash batch 8 6.25 -> 6.07 ms,
// plain batch 32 5.52 -> 5.34 ms).
void launch_skinny_gemm_routed(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu,
                               int tile_rows, int max_items, cudaStream_t s) {
  if (swiglu) launch_routed_rt<2, true>(x, w, out, routed, tile_rows, max_items, s);
  else if (tile_rows >= 32) launch_routed_rt<2, false>(x, w, out, routed, tile_rows, max_items, s);
  else launch_routed_rt<4, false>(x, w, out, routed, tile_rows, max_items, s);
}

}  // namespace dflash::cuda
