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
  for (const auto& seg : segments) {
    n_tiles += (seg.n_rows + tile_rows - 1) / tile_rows;
    max_keys = std::max(max_keys, launch_keys(seg));
  }
  if (!attention_fresh_supported(shape, n_tiles, max_keys)) return separate();
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
  const int tile_rows = attention_rows_per_tile(shape);
  // Segments of many rows (prefill chunks) go to the prefill kernel, unless rows must not
  // depend on their batch: its rows differ from the decode kernel's in the last bits.
  const bool prefill_form = !fresh && !options_.batch_invariant && attention_prefill_heads(shape) > 0;
  const int prefill_rows = attention_prefill_rows_per_tile(shape);
  std::vector<AttnRow> rows(static_cast<size_t>(q.rows));
  std::vector<AttnTile> tiles, prefill_tiles;
  std::vector<int32_t> tables;
  int max_keys = 0;
  for (const auto& seg : segments) {
    const int n_table = (launch_keys(seg) + p.page_size - 1) / p.page_size;
    const auto offset = static_cast<int32_t>(tables.size());
    tables.insert(tables.end(), seg.page_table, seg.page_table + n_table);
    const int32_t fresh_begin = fresh ? seg.n_keys - seg.n_rows : std::numeric_limits<int32_t>::max();
    for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; ++r) {
      rows[r] = {positions[r], seg.n_keys, seg.causal ? 1 : 0, offset, fresh_begin, seg.first_row};
    }
    const bool long_segment = prefill_form && seg.n_rows >= kPrefillMinRows;
    const int step = long_segment ? prefill_rows : tile_rows;
    for (int32_t r = seg.first_row; r < seg.first_row + seg.n_rows; r += step) {
      (long_segment ? prefill_tiles : tiles).push_back({r, std::min(step, seg.first_row + seg.n_rows - r)});
    }
    if (!long_segment) max_keys = std::max(max_keys, launch_keys(seg));
  }
  if (tables.empty()) tables.push_back(0);
  const int n_prefill_tiles = static_cast<int>(prefill_tiles.size());
  const auto* d_prefill_rows =
      n_prefill_tiles ? static_cast<const AttnRow*>(staging_.stage_bytes(rows.data(), rows.size() * sizeof(rows[0])))
                      : nullptr;
  const auto* d_prefill_tiles =
      n_prefill_tiles ? static_cast<const AttnTile*>(
                            staging_.stage_bytes(prefill_tiles.data(), prefill_tiles.size() * sizeof(prefill_tiles[0])))
                      : nullptr;
  // The other kernels see the prefill kernel's rows without keys: the split combine, which
  // walks every row, leaves them alone.
  for (const AttnTile& t : prefill_tiles)
    for (int32_t r = t.first_row; r < t.first_row + t.n_rows; ++r) rows[r].position = rows[r].n_keys = 0;
  const bool others = n_prefill_tiles == 0 || !tiles.empty();
  if (tiles.empty()) tiles.push_back({0, 0});
  const int n_rows = static_cast<int>(q.rows), n_tiles = static_cast<int>(tiles.size());
  const int64_t ws =
      attention_workspace_bytes(n_rows, n_tiles, max_keys, shape, fresh != nullptr, forms_.attention_splits);
  float* workspace = static_cast<float*>(workspace_for(ws));
  const auto* d_rows = static_cast<const AttnRow*>(staging_.stage_bytes(rows.data(), rows.size() * sizeof(rows[0])));
  const auto* d_tiles =
      static_cast<const AttnTile*>(staging_.stage_bytes(tiles.data(), tiles.size() * sizeof(tiles[0])));
  const int32_t* d_tables = staging_.stage(tables);
  // The key count sizes the splits (and with the tiles picks the forms): a graph holds to the
  // one it was captured with, to the fused or separate form and to the prefill kernel or none.
  const int64_t decision = (int64_t{max_keys} * 2 + (fresh ? 1 : 0)) * 2 + (n_prefill_tiles ? 1 : 0);
  staging_.launch(
      [&](cudaStream_t s) {
        if (n_prefill_tiles)
          launch_attention_prefill(mat(q), mat(k_cache), mat(v_cache), d_prefill_rows, d_prefill_tiles,
                                   n_prefill_tiles, d_tables, shape, mat(out), s);
        if (!others) return;
        if (fresh)
          launch_attention_fresh(mat(q), *fresh, mat(k_cache), mat(v_cache), d_rows, n_rows, d_tiles, n_tiles,
                                 max_keys, d_tables, shape, workspace, mat(out), forms_, s);
        else
          launch_attention(mat(q), mat(k_cache), mat(v_cache), d_rows, n_rows, d_tiles, n_tiles, max_keys, d_tables,
                           shape, workspace, mat(out), forms_, s);
      },
      decision);
}

}  // namespace dflash::cuda
