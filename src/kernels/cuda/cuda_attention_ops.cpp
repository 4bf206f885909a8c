// The CUDA backend's attention: over the paged cache (attention), and straight from a layer's
// q/k/v product (qkv_attention: fused where the shape and the batch allow it).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cuda/cuda_backend.h"

namespace dflash::cuda {
namespace {

// The keys a segment's launch is sized for (AttentionSegment::key_capacity).
int32_t launch_keys(const AttentionSegment& seg) { return std::max(seg.n_keys, seg.key_capacity); }

// Segments of at least this many rows take the prefill kernel (more than any verification or
// draft block).
constexpr int kPrefillMinRows = 64;
// The most bytes of long-form partials one call may take (see run_attention).
constexpr int64_t kMaxLongPartialBytes = int64_t{256} << 20;

// Whether each segment's rows are its last keys, in order, with the slots its page table gives.
bool rows_are_last_keys(const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                        const std::vector<int32_t>& slots, int page_size, int64_t n_rows) {
  if (static_cast<int64_t>(positions.size()) != n_rows || static_cast<int64_t>(slots.size()) != n_rows) return false;
  for (const auto& seg : segments) {
    if (seg.n_rows < 0 || seg.n_keys < seg.n_rows || seg.first_row < 0 || seg.first_row + seg.n_rows > n_rows)
      return false;
    for (int32_t i = 0; i < seg.n_rows; ++i) {
      const int32_t pos = seg.n_keys - seg.n_rows + i, r = seg.first_row + i;
      if (positions[r] != pos || slots[r] != seg.page_table[pos / page_size] * page_size + pos % page_size)
        return false;
    }
  }
  return true;
}

// Which kernel a row takes: the decode kernel (attention_mma.cu), the prefill form or the long
// form (attention_prefill.cu).
enum class RowKernel { decode, prefill, tiles_long };

// A row's visible keys from its own position and key count (as the kernels count them).
int visible_count(int32_t position, int32_t n_keys, bool causal, int window) {
  const int end = causal ? std::min(position + 1, n_keys) : n_keys;
  const int begin = window > 0 ? std::max(0, position - window + 1) : 0;
  return std::max(0, end - begin);
}

// The launches of one attention call: each kernel's tiles, and its rows with every other
// kernel's rows given no keys (each combine walks all the rows and leaves those alone).
struct AttentionPlan {
  std::vector<AttnRow> rows;                     // every row as it is (the prefill form's)
  std::vector<AttnRow> decode_rows, long_rows;   // the others without keys
  std::vector<AttnTile> decode_tiles, prefill_tiles, long_tiles;
  std::vector<AttnTile> decode_runs;             // decode tiles of one sequence: {first tile, tiles}
  int most_run_tiles = 1;
  std::vector<int32_t> tables;
  int decode_keys = 0, long_keys = 0;            // the most keys a launch is sized for
};

}  // namespace

void CudaBackend::attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                            const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                            const AttentionParams& p, Tensor& out) {
  run_attention(q, nullptr, k_cache, v_cache, segments, positions, p, out);
}

// The fused form (launch.h's AttnFresh) where the shape has it and the batch is laid out as the
// contract says (H100, batch 1: plain 5.79 -> 5.71 ms a step, DFlash 8.27 -> 8.08); the separate
// steps otherwise.
void CudaBackend::qkv_attention(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm, float eps,
                                const std::vector<float>& inv_freq, const std::vector<int32_t>& slots, Tensor& k_cache,
                                Tensor& v_cache, const std::vector<AttentionSegment>& segments,
                                const std::vector<int32_t>& positions, const AttentionParams& p, Tensor& out) {
  const int64_t q_dim = int64_t{p.n_heads} * p.head_dim, kv_dim = int64_t{p.n_kv_heads} * p.head_dim;
  const AttnShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.page_size, p.sliding_window};
  auto separate = [&] {
    Backend::qkv_attention(qkv, q_norm, k_norm, eps, inv_freq, slots, k_cache, v_cache, segments, positions, p, out);
  };
  if (p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 || qkv.cols != q_dim + 2 * kv_dim ||
      static_cast<int>(inv_freq.size()) != p.head_dim / 2 ||
      !rows_are_last_keys(segments, positions, slots, p.page_size, qkv.rows))
    return separate();
  const int tile_rows = attention_rows_per_tile(shape);
  int n_tiles = 0, max_keys = 0;
  bool tiles_form = false;  // a row takes the prefill or the long form (run_attention): not fused
  for (const auto& seg : segments) {
    n_tiles += (seg.n_rows + tile_rows - 1) / tile_rows;
    max_keys = std::max(max_keys, launch_keys(seg));
    if (seg.n_rows == 0 || attention_prefill_heads(shape) == 0) continue;
    // The most keys a row of the segment sees: its last row's (causal), else its first's (with a
    // window, later rows of a non-causal block see fewer).
    const int most = std::max(visible_count(positions[seg.first_row], seg.n_keys, seg.causal, p.sliding_window),
                              visible_count(positions[seg.first_row + seg.n_rows - 1], seg.n_keys, seg.causal,
                                            p.sliding_window));
    tiles_form = tiles_form || (!options_.batch_invariant && seg.n_rows >= kPrefillMinRows) || most >= kAttnLongKeys;
  }
  if (tiles_form || !attention_fresh_supported(shape, n_tiles, max_keys)) return separate();
  const float2* rope = rope_table(inv_freq, max_keys - 1);
  if (!rope) return separate();  // a capture needs a larger table than there is
  for (int32_t slot : slots) check(slot >= 0 && slot < k_cache.rows, "cuda backend: KV slot out of range");
  const bf16* base = static_cast<const bf16*>(qkv.data);
  const AttnFresh fresh{base + q_dim, base + q_dim + kv_dim, qkv.stride, bf16_or_null(q_norm), bf16_or_null(k_norm),
                        eps, rope};
  run_attention(qkv.slice_cols(0, q_dim), &fresh, k_cache, v_cache, segments, positions, p, out);
}

void CudaBackend::run_attention(const Tensor& q, const AttnFresh* fresh, const Tensor& k_cache, const Tensor& v_cache,
                                const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                                const AttentionParams& p, Tensor& out) {
  check(p.head_dim % 8 == 0 && p.head_dim <= 256, "cuda backend: head_dim ", p.head_dim,
        " is not supported (multiple of 8, <= 256)");
  check(p.n_kv_heads > 0 && p.n_heads % p.n_kv_heads == 0, "cuda backend: heads do not form GQA groups");
  const AttnShape shape{p.n_heads, p.n_kv_heads, p.head_dim, p.page_size, p.sliding_window};
  const int tile_rows = attention_rows_per_tile(shape), wide_rows = attention_prefill_rows_per_tile(shape);
  const bool tiles_form = attention_prefill_heads(shape) > 0 && !fresh;
  // Segments of many rows (prefill chunks) take the prefill form, unless rows must not depend on
  // their batch (a chunk's length does). Rows with many keys take the long form, by their own
  // key count: a verification row and the same row decoded alone get the same bits.
  const bool prefill_form = tiles_form && !options_.batch_invariant;
  auto is_long = [&](const AttentionSegment& seg, int32_t r) {
    return visible_count(positions[r], seg.n_keys, seg.causal, p.sliding_window) >= kAttnLongKeys;
  };
  // The long form's partials have no loop form to fall back on: beyond kMaxLongPartialBytes (a
  // batch-invariant prompt chunk at tens of thousands of keys) the call's long rows take the
  // decode kernel instead.
  bool long_form = tiles_form;
  if (long_form) {
    int n_long = 0, most_keys = 0;
    for (const auto& seg : segments) {
      if (prefill_form && seg.n_rows >= kPrefillMinRows) continue;
      for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; ++r) {
        if (is_long(seg, r)) ++n_long, most_keys = std::max(most_keys, launch_keys(seg));
      }
    }
    long_form = attention_long_workspace_bytes(n_long, most_keys, shape) <= kMaxLongPartialBytes;
  }
  auto kernel_of = [&](const AttentionSegment& seg, int32_t r) {
    if (prefill_form && seg.n_rows >= kPrefillMinRows) return RowKernel::prefill;
    if (long_form && is_long(seg, r)) return RowKernel::tiles_long;
    return RowKernel::decode;
  };
  AttentionPlan plan;
  plan.rows.resize(static_cast<size_t>(q.rows));
  for (const auto& seg : segments) {
    const int n_table = (launch_keys(seg) + p.page_size - 1) / p.page_size;
    const auto offset = static_cast<int32_t>(plan.tables.size());
    plan.tables.insert(plan.tables.end(), seg.page_table, seg.page_table + n_table);
    const int32_t fresh_begin = fresh ? seg.n_keys - seg.n_rows : std::numeric_limits<int32_t>::max();
    for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; ++r) {
      plan.rows[r] = {positions[r], seg.n_keys, seg.causal ? 1 : 0, offset, fresh_begin, seg.first_row};
    }
    // Tiles: runs of rows of one kernel, cut at its tile size.
    for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows;) {
      const RowKernel k = kernel_of(seg, r);
      const int step = k == RowKernel::decode ? tile_rows : wide_rows;
      int32_t n = 1;
      while (n < step && r + n < seg.first_row + seg.n_rows && kernel_of(seg, r + n) == k) ++n;
      auto& tiles = k == RowKernel::decode    ? plan.decode_tiles
                    : k == RowKernel::prefill ? plan.prefill_tiles
                                              : plan.long_tiles;
      if (k == RowKernel::decode) {
        // Runs of a sequence's decode tiles, attention_run_tiles() at most (the shared-keys form).
        const auto t = static_cast<int32_t>(tiles.size());
        auto& runs = plan.decode_runs;
        if (runs.empty() || runs.back().first_row + runs.back().n_rows != t ||
            runs.back().n_rows >= attention_run_tiles() || plan.decode_tiles[runs.back().first_row].first_row < seg.first_row)
          runs.push_back({t, 1});
        else
          plan.most_run_tiles = std::max(plan.most_run_tiles, ++runs.back().n_rows);
      }
      tiles.push_back({r, n});
      if (k == RowKernel::decode) plan.decode_keys = std::max(plan.decode_keys, launch_keys(seg));
      if (k == RowKernel::tiles_long) plan.long_keys = std::max(plan.long_keys, launch_keys(seg));
      r += n;
    }
  }
  if (plan.tables.empty()) plan.tables.push_back(0);
  auto without_keys_except = [&](const std::vector<AttnTile>& own) {
    std::vector<AttnRow> rows(plan.rows.size(), AttnRow{0, 0, 1, 0, 0, 0});
    for (const AttnTile& t : own)
      for (int32_t r = t.first_row; r < t.first_row + t.n_rows; ++r) rows[r] = plan.rows[r];
    return rows;
  };
  const bool any_prefill = !plan.prefill_tiles.empty(), any_long = !plan.long_tiles.empty();
  const bool any_decode = !plan.decode_tiles.empty() || (!any_prefill && !any_long);
  plan.decode_rows = any_prefill || any_long ? without_keys_except(plan.decode_tiles) : plan.rows;
  std::vector<int32_t> work_rows;  // a long row's place among the long rows (its partials)
  int n_long_rows = 0;
  if (any_long) {
    plan.long_rows = without_keys_except(plan.long_tiles);
    work_rows.assign(plan.rows.size(), -1);
    for (const AttnTile& t : plan.long_tiles)
      for (int32_t r = t.first_row; r < t.first_row + t.n_rows; ++r) work_rows[r] = n_long_rows++;
  }
  if (plan.decode_tiles.empty()) plan.decode_tiles.push_back({0, 0});
  if (plan.decode_runs.empty()) plan.decode_runs.push_back({0, 1});

  const int n_rows = static_cast<int>(q.rows), n_tiles = static_cast<int>(plan.decode_tiles.size());
  const int64_t ws_decode = attention_workspace_bytes(n_rows, n_tiles, plan.decode_keys, shape, fresh != nullptr,
                                                      forms_.attention_splits);
  const int64_t ws_long = any_long ? attention_long_workspace_bytes(n_long_rows, plan.long_keys, shape) : 0;
  const int64_t ws_decode_aligned = (ws_decode + 255) / 256 * 256;
  auto* workspace = static_cast<char*>(workspace_for(ws_decode_aligned + ws_long));
  auto stage_rows = [&](const std::vector<AttnRow>& rows) {
    return static_cast<const AttnRow*>(staging_.stage_bytes(rows.data(), rows.size() * sizeof(rows[0])));
  };
  auto stage_tiles = [&](const std::vector<AttnTile>& tiles) {
    return static_cast<const AttnTile*>(staging_.stage_bytes(tiles.data(), tiles.size() * sizeof(tiles[0])));
  };
  const AttnRow* d_rows = stage_rows(plan.decode_rows);
  const AttnTile* d_tiles = stage_tiles(plan.decode_tiles);
  const AttnTile* d_runs = fresh ? nullptr : stage_tiles(plan.decode_runs);
  const int n_runs = static_cast<int>(plan.decode_runs.size());
  const AttnRow* d_all_rows = any_prefill ? stage_rows(plan.rows) : nullptr;
  const AttnTile* d_prefill_tiles = any_prefill ? stage_tiles(plan.prefill_tiles) : nullptr;
  const AttnRow* d_long_rows = any_long ? stage_rows(plan.long_rows) : nullptr;
  const AttnTile* d_long_tiles = any_long ? stage_tiles(plan.long_tiles) : nullptr;
  const int32_t* d_work_rows = any_long ? staging_.stage(work_rows) : nullptr;
  const int32_t* d_tables = staging_.stage(plan.tables);
  // The key counts size the splits and the tiles the grids (which rows take the long form moves
  // with their positions): a graph holds to the ones it was captured with, and to the fused or
  // separate form.
  uint64_t mix = fresh ? 1 : 0;  // unsigned: the mix wraps around
  for (uint64_t v : {uint64_t(plan.decode_keys), uint64_t(plan.long_keys), uint64_t(n_tiles), uint64_t(n_runs),
                     uint64_t(plan.most_run_tiles),
                     uint64_t(plan.prefill_tiles.size()), uint64_t(plan.long_tiles.size())})
    mix = mix * 1000003u + v;
  const auto decision = static_cast<int64_t>(mix);
  staging_.launch(
      [&](cudaStream_t s) {
        if (any_prefill)
          launch_attention_prefill(mat(q), mat(k_cache), mat(v_cache), d_all_rows, d_prefill_tiles,
                                   static_cast<int>(plan.prefill_tiles.size()), d_tables, shape, mat(out), s);
        if (any_long)
          launch_attention_long(mat(q), mat(k_cache), mat(v_cache), d_long_rows, n_rows, d_work_rows, d_long_tiles,
                                static_cast<int>(plan.long_tiles.size()), plan.long_keys, d_tables, shape,
                                reinterpret_cast<float*>(workspace + ws_decode_aligned), mat(out), s);
        if (!any_decode) return;
        auto* ws = reinterpret_cast<float*>(workspace);
        if (fresh)
          launch_attention_fresh(mat(q), *fresh, mat(k_cache), mat(v_cache), d_rows, n_rows, d_tiles, n_tiles,
                                 plan.decode_keys, d_tables, shape, ws, mat(out), forms_, s);
        else
          launch_attention(mat(q), mat(k_cache), mat(v_cache), d_rows, n_rows, d_tiles, n_tiles, d_runs, n_runs,
                           plan.most_run_tiles, plan.decode_keys, d_tables, shape, ws, mat(out), forms_, s);
      },
      decision);
}

}  // namespace dflash::cuda
