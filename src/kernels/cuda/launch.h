// The CUDA kernels behind CudaBackend, as plain launch functions. Every
// activation is bfloat16 (stored as uint16_t here so that host code needs no
// CUDA headers); arithmetic is float32. Matrices are row-major with a row
// stride in elements. Launches are asynchronous on `stream`; integer arrays
// (ids, positions, slots, page tables) are device pointers.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "kernels/cuda/kernel_forms.h"

namespace dflash::cuda {

using bf16 = uint16_t;

struct Mat {          // a bf16 matrix view
  bf16* data;
  int64_t rows, cols, stride;
};

// A matrix of the residual stream: float32 (f32) or bf16.
struct Rows {
  void* data;
  int64_t rows, cols, stride;
  bool f32;
};

// Programmatic dependent launch for every kernel below (pdl.cuh), on devices that have it (Hopper
// and later); the backend sets it once.
void set_pdl_enabled(bool on);

// out[r] = table[ids[r]]; with a map, rows where map[r] >= 0 take dev_ids[map[r]] instead (ids
// outside the table read row 0).
void launch_embed(const Mat& table, const int32_t* ids, const int32_t* dev_ids, const int32_t* map, Rows out,
                  cudaStream_t s);
// out = rmsnorm(x) * w  (x may alias out when both are bf16)
void launch_rms_norm(const Rows& x, const bf16* w, float eps, Mat out, cudaStream_t s);
// The routed MLP's output not yet summed: row t = the sum over j < top_k, in order, of
// weight_of_pair[t * top_k + j] * y[t * top_k + j] (launch_moe_combine's arithmetic and rounding).
struct MoeSum {
  Mat y;
  const float* weight_of_pair = nullptr;
  int top_k = 0;
};
// residual_out = residual + delta (both of the residual's type, residual_out may be residual);
// out = rmsnorm(residual_out) * w. With capture (data set): residual_out's rows also go there,
// rounded to bf16, where add_rms_norm_captures says so. With sum (where add_rms_norm_captures
// says so): delta is first written from it, each row by the block that normalizes it. With
// rank_sum (the same; delta contiguous): delta is this rank's share of a pushed sum over the
// ranks (peer_collectives.h), summed first by the block that normalizes the row.
struct PeerPush;
void launch_add_rms_norm(const Rows& residual, const Mat& delta, Rows residual_out, const bf16* w, float eps, Mat out,
                         cudaStream_t s, const Mat& capture = Mat{nullptr, 0, 0, 0}, const MoeSum* sum = nullptr,
                         const PeerPush* rank_sum = nullptr);
bool add_rms_norm_captures(const Rows& residual, const Mat& delta, const Rows& residual_out, const bf16* w,
                           const Mat& out, const Mat& capture);
// In place: per-head RMSNorm (norm_w may be null), then rotate-half RoPE of the leading
// 2 * rot_half dimensions (rot_half = head_dim / 2 unless the model rotates partially).
void launch_head_norm_rope(Mat x, int n_heads, int head_dim, const bf16* norm_w, float eps, const int32_t* positions,
                           const float* inv_freq, int rot_half, cudaStream_t s);
// qkv = [q | k | v] heads: q and k heads get launch_head_norm_rope's treatment
// in place (with q_norm / k_norm, either may be null), then k and v rows go to
// cache rows slots[r], as launch_kv_write: three launches in one.
void launch_qkv_rope_kv_write(Mat qkv, int n_heads, int n_kv_heads, int head_dim, const bf16* q_norm,
                              const bf16* k_norm, float eps, const int32_t* positions, const float* inv_freq,
                              int rot_half, Mat k_cache, Mat v_cache, const int32_t* slots, cudaStream_t s);
// launch_qkv_rope_kv_write with no query heads for up to kMaxKvLayers layers at once: kv = [k | v]
// of layer 0, [k | v] of layer 1, ...; k_norm[l] may be null.
constexpr int kMaxKvLayers = 8;
struct KvLayers {
  int n = 0;
  const bf16* k_norm[kMaxKvLayers] = {};
  bf16* k_cache[kMaxKvLayers] = {};
  bf16* v_cache[kMaxKvLayers] = {};
  int64_t k_stride = 0, v_stride = 0;
};
void launch_kv_rope_write_layers(Mat kv, int n_kv_heads, int head_dim, const KvLayers& layers, float eps,
                                 const int32_t* positions, const float* inv_freq, const int32_t* slots, cudaStream_t s);
// table[p * half + i] = (cos, sin) of the RoPE angle p * inv_freq[i] for positions p < n_positions,
// as launch_head_norm_rope computes it (the fused attention reads it: AttnFresh).
void launch_rope_table(float2* table, int n_positions, int half, const float* inv_freq, cudaStream_t s);
// out = silu(gate_up[:, :n]) * gate_up[:, n:], n = out.cols
void launch_swiglu(const Mat& gate_up, Mat out, cudaStream_t s);
// k_cache[slots[r]] = k[r]; v_cache[slots[r]] = v[r]
void launch_kv_write(const Mat& k, const Mat& v, Mat k_cache, Mat v_cache, const int32_t* slots, cudaStream_t s);
// out[i] = src[rows[i]] (rounded to bf16 when src is float32)
void launch_gather_rows(const Rows& src, const int32_t* rows, Mat out, cudaStream_t s);
// out[r] = index of the largest element of row r (lowest index on ties), for at most
// kArgmaxMaxRows rows. A row is split over up to kArgmaxSlices blocks; `workspace`
// (argmax_workspace_bytes()) must be zero when first used and is left zero again.
constexpr int kArgmaxSlices = 32;
constexpr int64_t kArgmaxMaxRows = 4096;
int64_t argmax_workspace_bytes();
void launch_argmax(const Mat& x, int32_t* out, void* workspace, cudaStream_t s);
// Backend::argmax_candidates (cand: [x.rows, 2] float32, contiguous) and argmax_of_candidates
// (all: rows of n_parts candidate pairs, `stride` floats apart); the same workspace.
void launch_argmax_candidates(const Mat& x, int64_t first_id, float* cand, void* workspace, cudaStream_t s);
void launch_argmax_of_candidates(const float* all, int64_t stride, int64_t rows, int n_parts, int32_t* ids,
                                 cudaStream_t s);
// Per listed row i of x: the entries of select_top_candidates(row rows[i], temperature[i],
// top_k[i]) (kernels/top_candidates.h) for 0 < top_k[i] <= kTopCandidatesMaxK and top_k[i] <
// x.cols, ids increasing, into out[i]; count -1 where the selection does not fit (more than
// kTopCandidatesCap entries with ties, more than a few thousand entries in its threshold's
// first radix bin, or a NaN): the host selects those.
constexpr int kTopCandidatesMaxK = 256, kTopCandidatesCap = 1024;
struct TopCandidatesRow {
  int32_t count;
  int32_t ids[kTopCandidatesCap];
  float x[kTopCandidatesCap];
};
void launch_top_candidates(const Mat& x, const int32_t* rows, const float* temperature, const int32_t* top_k,
                           int n_rows, TopCandidatesRow* out, cudaStream_t s);
// out += bias (broadcast over rows)
void launch_add_bias(Mat out, const bf16* bias, cudaStream_t s);
// dst[i] = bf16(src[i]) for n contiguous floats
void launch_f32_to_bf16(const float* src, bf16* dst, int64_t n, cudaStream_t s);
// Fills n contiguous values with uniform random numbers in [-scale, scale).
void launch_fill_random(bf16* dst, int64_t n, uint64_t seed, float scale, cudaStream_t s);

// out = x * w^T (+ bias) for x.rows <= kSkinnyMaxRows, streaming w once with
// tensor cores. Each output element is reduced in an order that depends only
// on K, never on the number of rows, so a row's result is identical whether it
// is computed alone or in a batch. Needs K % 8 == 0 and 16-byte aligned rows. `wide`: the block
// form (KernelForms; every form gives the same bits).
constexpr int kSkinnyMaxRows = 32;
bool skinny_gemm_supported(const Mat& x, const Mat& w, const Mat& out);
void launch_skinny_gemm(const Mat& x, const Mat& w, const bf16* bias, Mat out, int n_sms, KernelForms::Wide wide,
                        cudaStream_t s);
// The same, each block also storing its outputs into the peers' push inboxes for
// launch_peer_pushed_sum or launch_peer_pushed_gather (peer_collectives.h, peer_push_fits).
void launch_skinny_gemm_pushed(const Mat& x, const Mat& w, const bf16* bias, Mat out, int n_sms,
                               KernelForms::Wide wide, const PeerPush& push, cudaStream_t s);
// The product of `count` row groups (Backend::matmul_row_groups): w is the first group, group g's
// rows start g * group_step rows after it, and its outputs are columns g * w.rows, ... of out.
bool skinny_gemm_groups_supported(const Mat& x, const Mat& w, int count);
void launch_skinny_gemm_groups(const Mat& x, const Mat& w, int count, int64_t group_step, Mat out, int n_sms,
                               KernelForms::Wide wide, cudaStream_t s);
// out = silu(g) * u with [g | u] = x * w^T (+ bias), w = [gate; up] of 2 * out.cols rows, g and u
// kept in float32 (launch_skinny_gemm followed by launch_swiglu rounds them to bf16 first).
void launch_skinny_gemm_swiglu(const Mat& x, const Mat& w, const bf16* bias, Mat out, cudaStream_t s);

// The rows of a routed (mixture-of-experts) product, as launch_moe_route lays them out: *n_items
// work items, each an expert and up to a tile of its pairs (pair
// p = token * top_k + j, the token's j-th expert in increasing index).
struct RoutedRows {
  const int32_t* items = nullptr;    // per item: expert, first index into pairs, pair count
  const int32_t* n_items = nullptr;
  const int32_t* pairs = nullptr;    // pair indices grouped by expert
  int32_t* next_unit = nullptr;      // the next work unit (an item's columns of a block), from 0
  int x_div = 1;                     // pair p reads input row p / x_div and writes output row p
  int64_t w_step = 0;                // elements from one expert's weight to the next
  // The routing finished before the previous kernel in the stream released this one (that
  // kernel waited for it first): the blocks read the items and request their first weights
  // before their wait.
  bool items_ready = false;
};
// out[p] = x[p / x_div] * w_e^T (with swiglu: silu(gate) * up of w_e = [gate; up], out.cols
// features) for every pair p routed to expert e, w_e = w + e * w_step: each item streams its
// expert's weights once for up to `tile_rows` (8, 16 or 32) pairs. Reduction order as
// launch_skinny_gemm's: a pair's result never depends on the others. `max_items` bounds
// *n_items; the blocks take work units from *next_unit, which must be 0 at the start.
void launch_skinny_gemm_routed(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu,
                               int tile_rows, int max_items, cudaStream_t s);

// The same products for a wide step (moe_gemm.cu): one tile product per item of up to
// kMoeGemmPairs pairs (the routing's items at that tile size), each expert's weights read once an
// item; a pair's result does not depend on the others but its bits differ from the skinny form's.
constexpr int kMoeGemmPairs = 128;
// The same items through Hopper's warpgroup products (moe_gemm_wgmma.cu; other bits), where
// moe_gemm_wgmma_built(): the device runs this build's sm_90a code.
void launch_moe_gemm_wgmma(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu,
                           int max_items, cudaStream_t s);
bool moe_gemm_wgmma_built();
void launch_moe_gemm(const Mat& x, const Mat& w, Mat out, const RoutedRows& routed, bool swiglu, int max_items,
                     cudaStream_t s);

// Where the routing of a mixture-of-experts layer goes (launch_moe_route) and its settings.
struct MoeRouting {
  int top_k = 0;
  bool norm = false;  // norm_topk_prob
  int tile_rows = 8;  // pairs of a work item: 8, 16 or 32 (skinny), kMoeGemmPairs (tile products)
  int32_t* expert_of_pair = nullptr;
  float* weight_of_pair = nullptr;
  int32_t* pairs = nullptr;
  int32_t* items = nullptr;
  int32_t* n_items = nullptr;
  int32_t* next_units = nullptr;
  int32_t* expert_rows = nullptr;  // optional
};
// The routing from router logits [M, E] (bf16): per token, p = softmax in float32, the top_k
// experts (larger p first, the lower index on ties), weights p (divided by their sum with norm);
// pair token * top_k + j takes the token's j-th chosen expert in increasing index:
// expert_of_pair, weight_of_pair. Then the pairs grouped by expert (pairs), their work items of
// up to tile_rows pairs (items, n_items: see RoutedRows) and expert_rows[e] = pairs of expert e;
// next_units[0] and [1] (the routed products' unit counters) set to 0. One block (after a
// kernel routing a warp a token over many blocks when M > 128); E <= kMoeMaxExperts, top_k <= 32.
constexpr int kMoeMaxExperts = 1024;
void launch_moe_route(const Mat& logits, const MoeRouting& r, cudaStream_t s);
// out[t] = sum over j of weight_of_pair[t * top_k + j] * y[t * top_k + j], in j order, in float32.
// push: out's words also go to the peers, a pushed exchange (peer_collectives.h; out contiguous,
// its columns even: peer_push_fits).
void launch_moe_combine(const Mat& y, const float* weight_of_pair, int top_k, Mat out, cudaStream_t s,
                        const PeerPush* push = nullptr);

// A normalizing product's input rows: rmsnorm(residual + delta) * weight, and block 0 stores
// residual + delta to residual_out (not residual: the other blocks read it); without delta,
// rmsnorm(residual) * weight. The rows are as wide as the weight's columns.
struct RowNorm {
  const void* residual = nullptr;  // float32 when f32, else bf16; residual_out likewise
  int64_t residual_stride = 0;
  const bf16* delta = nullptr;
  int64_t delta_stride = 0;
  void* residual_out = nullptr;
  int64_t residual_out_stride = 0;
  bool f32 = false;
  const bf16* weight = nullptr;
  float eps = 0.0f;
};
// out = rmsnorm rows (as launch_rms_norm / launch_add_rms_norm compute them, bit for bit) * w^T
// (+ bias), or with swiglu launch_skinny_gemm_swiglu's output, for a few rows whose
// normalized values fit the block's shared memory.
bool skinny_gemm_norm_supported(const RowNorm& n, int64_t rows, const Mat& w, bool swiglu, int n_sms);
void launch_skinny_gemm_norm(const RowNorm& n, int64_t rows, const Mat& w, const bf16* bias, Mat out, bool swiglu,
                             int n_sms, cudaStream_t s);

// The routed MLP of a single token after its router product (moe_token.cu): the gate/up blocks
// normalize the token's row (RowNorm, as the router product did; residual_out is not written)
// and route it from `logits` ([1, n_experts] bf16, the routing kernel's rule); act row j gets
// swiglu of the j-th chosen expert (increasing index), h_out (optional) the normalized row; then
// out = the weighted sum of the experts' down products, in the combine's order. Bit-identical
// to launch_moe_route, launch_skinny_gemm_routed twice and launch_moe_combine on that row.
// gate_up and down: expert 0's [2 * ff, hidden] and [hidden, ff].
constexpr int kMoeTokenMaxTopK = 8;
struct MoeTokenArgs {
  int n_experts = 0, top_k = 0;
  bool norm_topk_prob = false;
  int64_t gate_up_step = 0, down_step = 0;  // elements from one expert's weights to the next
  int32_t* expert_rows = nullptr;           // optional: 1 for each chosen expert, else 0
};
bool moe_token_supported(const RowNorm& n, const Mat& gate_up, const Mat& down, int n_experts, int top_k);
// push: out's words also go to the peers, as launch_moe_combine's.
void launch_moe_token(const RowNorm& n, const Mat& logits, const MoeTokenArgs& a, const Mat& gate_up, const Mat& down,
                      Mat act, Mat h_out, Mat out, cudaStream_t s, const PeerPush* push = nullptr);

// One query row's view of the paged cache.
struct AttnRow {
  int32_t position;    // query position
  int32_t n_keys;      // keys 0..n_keys-1 of its sequence exist
  int32_t causal;      // 1: keys <= position only
  int32_t page_offset; // start of its sequence's page table in the page-table array
  // With AttnFresh: keys from fresh_begin on are rows fresh_row, fresh_row + 1, ... of qkv.
  int32_t fresh_begin, fresh_row;
};

// The new keys and values of a fused call (launch_attention with qkv = [q | k | v] rows): the
// attention normalizes and rotates the query heads and the new key heads itself (as
// launch_qkv_rope_kv_write, bit for bit), reads the new keys and values from qkv and writes
// them to the cache. k == nullptr: every key is in the cache and q is used as it is.
struct AttnFresh {
  const bf16* k = nullptr;  // qkv's first k head
  const bf16* v = nullptr;  // qkv's first v head
  int64_t stride = 0;       // qkv's row stride
  const bf16* q_norm = nullptr;
  const bf16* k_norm = nullptr;
  float eps = 0.0f;
  const float2* rope = nullptr;  // launch_rope_table's table, covering every position of the call
};

struct AttnShape {
  int n_heads, n_kv_heads, head_dim, page_size, sliding_window;
};

// Keys per split of the KV length; a row's split count depends only on its own
// visible keys, so its result does not depend on the batch it is in.
constexpr int kAttnSplitKeys = 64;
// Bytes of float workspace the attention needs for `n_rows` rows in `n_tiles` tiles of at most
// `max_keys` keys (none where the kernel combines its splits itself); fused: the AttnFresh form.
// `splits` must be the form the launch gets (KernelForms).
int64_t attention_workspace_bytes(int n_rows, int n_tiles, int max_keys, const AttnShape& shape, bool fused,
                                  KernelForms::Splits splits);

// Consecutive rows of one sequence that share a block of the tensor-core kernel.
struct AttnTile {
  int32_t first_row, n_rows;
};
// Rows per tile for a shape: tiles group at most this many rows (never two sequences).
int attention_rows_per_tile(const AttnShape& shape);

// Attention of every row over its sequence's paged keys; `tiles` cover the rows. `forms`: how
// splits run and combine (KernelForms; every form gives the same bits).
// `runs`: the tiles in runs of at most attention_run_tiles() tiles of one sequence ({first tile,
// tiles}; `most_tiles` in the longest), for the shared-keys form (KernelForms::Splits).
void launch_attention(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, int n_rows,
                      const AttnTile* tiles, int n_tiles, const AttnTile* runs, int n_runs, int most_tiles, int max_keys,
                      const int32_t* page_tables, const AttnShape& shape, float* workspace, Mat out,
                      const KernelForms& forms, cudaStream_t s);
// The most tiles of a run (launch_attention's runs).
int attention_run_tiles();
// The FlashAttention-2 form (attention_prefill.cu), for head_dim 64 and 128 (heads 0
// otherwise), over tiles of attention_prefill_rows_per_tile rows of one segment. Its rows do not
// match launch_attention's bits. Prefill: one pass over all the keys, no workspace (long query
// segments). Long: rows with at least kAttnLongKeys visible keys (their own count, so that a
// verification row and the same row decoded alone take the same kernel), in splits of
// kAttnLongSplitKeys keys merged by a combine kernel; `rows` gives the other rows no keys.
constexpr int kAttnLongKeys = 8192;
// One split length for every shape: shorter splits for ranks of 4 KV heads filled more of the GPU
// at batch 1 (4-10% faster) but cost batch 8 3-13% in partials through memory
// (bench/results/bench_step_h200x2_long_splits_by_kv_heads_dropped.txt).
constexpr int kAttnLongSplitKeys = 512;
int attention_prefill_heads(const AttnShape& shape);
int attention_prefill_rows_per_tile(const AttnShape& shape);
void launch_attention_prefill(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows,
                              const AttnTile* tiles, int n_tiles, const int32_t* page_tables, const AttnShape& shape,
                              Mat out, cudaStream_t s);
// The long form's partials: n_long_rows rows (work_rows[r]: row r's place among them; unused
// for other rows) of at most max_keys keys.
int64_t attention_long_workspace_bytes(int n_long_rows, int max_keys, const AttnShape& shape);
void launch_attention_long(const Mat& q, const Mat& k_cache, const Mat& v_cache, const AttnRow* rows, int n_rows,
                           const int32_t* work_rows, const AttnTile* tiles, int n_tiles, int max_keys,
                           const int32_t* page_tables, const AttnShape& shape, float* workspace, Mat out,
                           cudaStream_t s);
// The fused form (AttnFresh) exists for head_dim 64 and 128 on the tensor-core kernel, and is
// taken while its grid (n_tiles tiles of attention_rows_per_tile rows) fits the GPU at once.
bool attention_fresh_supported(const AttnShape& shape, int n_tiles, int max_keys);
void launch_attention_fresh(const Mat& q, const AttnFresh& fresh, const Mat& k_cache, const Mat& v_cache,
                            const AttnRow* rows, int n_rows, const AttnTile* tiles, int n_tiles, int max_keys,
                            const int32_t* page_tables, const AttnShape& shape, float* workspace, Mat out,
                            const KernelForms& forms, cudaStream_t s);

// Whether the GPU holds `blocks` blocks of `threads` of `kernel` at once (occupancy x SMs).
bool gpu_holds_grid(const void* kernel, int threads, int64_t blocks);

// A per-device setting of a kernel (cudaFuncSetAttribute), made once on each device that launches
// it (a tensor-parallel group's GPUs are one kind, so the other device queries are shared).
template <typename Set>
void once_per_device(std::atomic<uint64_t>& done, Set&& set) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  set();
  done.fetch_or(bit, std::memory_order_acq_rel);
}

// The number of SMs of the current device.
int sm_count();

}  // namespace dflash::cuda
