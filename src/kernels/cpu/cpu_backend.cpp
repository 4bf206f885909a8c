// fp32 reference backend. Every output element is computed by one fixed
// sequence of operations that does not depend on how many rows are in the
// batch, so a token's result is bit-identical whether it is decoded alone or
// verified inside a block (the basis of lossless speculative decoding).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/gated_delta_net.h"
#include "util/error.h"

namespace dflash {
namespace {

// Dot product with 16 independent lanes, reduced in a fixed order. The lane
// loop vectorizes without reassociation, so results do not depend on the
// compiler's choice of vector width.
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * scale);
}

// The router's choice for one row: top_k experts by softmax probability (larger first, the lower
// index on ties), returned in increasing expert index with their weights.
std::vector<std::pair<int, float>> route_row(const float* logits, int n_experts, int top_k, bool norm_topk_prob) {
  const float m = *std::max_element(logits, logits + n_experts);
  std::vector<float> p(static_cast<size_t>(n_experts));
  float sum = 0.0f;
  for (int e = 0; e < n_experts; ++e) sum += p[e] = std::exp(logits[e] - m);
  for (float& v : p) v /= sum;
  std::vector<int> order(static_cast<size_t>(n_experts));
  for (int e = 0; e < n_experts; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                    [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  float top_sum = 0.0f;
  for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
  std::vector<std::pair<int, float>> chosen;
  for (int i = 0; i < top_k; ++i) chosen.emplace_back(order[i], norm_topk_prob ? p[order[i]] / top_sum : p[order[i]]);
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

void require_f32(const Tensor& t, const char* what) {
  check(t.dtype == DType::F32 && !t.empty(), "cpu backend: ", what, " must be a non-empty F32 tensor");
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }

  Tensor alloc(int64_t rows, int64_t cols) override {
    check(rows >= 0 && cols >= 0, "cpu backend: negative tensor size");
    Tensor t;
    const size_t n = static_cast<size_t>(std::max<int64_t>(rows * cols, 1));
    float* p = new float[n];
    t.storage = std::shared_ptr<void>(p, [](void* q) { delete[] static_cast<float*>(q); });
    t.data = p;
    t.dtype = DType::F32;
    t.rows = rows;
    t.cols = cols;
    t.stride = cols;
    return t;
  }

  Tensor upload(const std::vector<const TensorInfo*>& parts) override {
    const UploadShape shape = upload_shape(parts);
    Tensor t = alloc(shape.rows, shape.cols);
    float* dst = t.f32();
    for (const auto* p : parts) {
      convert_to_f32(p->dtype, p->data, dst, static_cast<size_t>(p->n_elements()));
      dst += p->n_elements();
    }
    return t;
  }

  Tensor upload_host(const float* data, int64_t rows, int64_t cols) override {
    Tensor t = alloc(rows, cols);
    std::memcpy(t.data, data, sizeof(float) * static_cast<size_t>(rows * cols));
    return t;
  }

  std::vector<float> to_host(const Tensor& t) override {
    require_f32(t, "to_host input");
    std::vector<float> out(static_cast<size_t>(t.rows * t.cols));
    for (int64_t r = 0; r < t.rows; ++r) std::memcpy(&out[r * t.cols], t.row_f32(r), sizeof(float) * t.cols);
    return out;
  }

  KvCache alloc_kv(int n_layers, int n_pages, int page_size, int n_kv_heads, int head_dim) override {
    KvCache c;
    c.page_size = page_size;
    c.n_pages = n_pages;
    for (int l = 0; l < n_layers; ++l) {
      c.k.push_back(alloc(int64_t{n_pages} * page_size, int64_t{n_kv_heads} * head_dim));
      c.v.push_back(alloc(int64_t{n_pages} * page_size, int64_t{n_kv_heads} * head_dim));
    }
    return c;
  }

  double measure_copy_gbps(int64_t bytes) override {
    std::vector<char> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes));
    std::memcpy(b.data(), a.data(), a.size());  // warm-up: pages are touched
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 2.0 * static_cast<double>(bytes) / s / 1e9;
  }

  void fill_random(Tensor& t, uint64_t seed, float scale) override {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> d(-scale, scale);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int64_t c = 0; c < t.cols; ++c) t.row_f32(r)[c] = d(rng);
  }

  void embed(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out,
             const DeviceTokens* from_device) override {
    require_f32(table, "embedding table");
    for (size_t r = 0; r < ids.size(); ++r) {
      check(ids[r] >= 0 && ids[r] < table.rows, "token id ", ids[r], " is outside the vocabulary (0..",
            table.rows - 1, ")");
      std::memcpy(out.row_f32(static_cast<int64_t>(r)), table.row_f32(ids[r]), sizeof(float) * table.cols);
    }
    if (!from_device) return;
    const std::vector<int32_t> dev = ids_to_host(from_device->ids);
    check(dev.size() == from_device->rows.size(), "cpu backend: device tokens and their rows differ in number");
    for (size_t i = 0; i < dev.size(); ++i) {
      const int32_t r = from_device->rows[i], id = dev[i] >= 0 && dev[i] < table.rows ? dev[i] : 0;
      check(r >= 0 && r < static_cast<int32_t>(ids.size()), "cpu backend: device token row out of range");
      std::memcpy(out.row_f32(r), table.row_f32(id), sizeof(float) * table.cols);
    }
  }

  void matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) override {
    require_f32(x, "matmul input");
    require_f32(w, "matmul weight");
    check(x.cols == w.cols && out.rows == x.rows && out.cols == w.rows, "cpu backend: matmul shape mismatch");
    const int64_t n_rows = x.rows, n_out = w.rows, k = x.cols;
    const float* b = bias ? bias->f32() : nullptr;
    // Output features outer: a weight row stays in cache while every input row uses it.
#pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < n_out; ++o) {
      const float* wr = w.row_f32(o);
      for (int64_t r = 0; r < n_rows; ++r) {
        const float v = dot(x.row_f32(r), wr, k);
        out.row_f32(r)[o] = b ? v + b[o] : v;
      }
    }
  }

  void rms_norm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override {
#pragma omp parallel for schedule(static) if (x.rows > 8)
    for (int64_t r = 0; r < x.rows; ++r) rms_norm_row(x.row_f32(r), weight.f32(), eps, x.cols, out.row_f32(r));
  }

  void add_rms_norm(const Tensor& residual, const Tensor& delta, Tensor& residual_out, const Tensor& weight, float eps,
                    Tensor& out) override {
#pragma omp parallel for schedule(static) if (residual.rows > 8)
    for (int64_t r = 0; r < residual.rows; ++r) {
      const float* res = residual.row_f32(r);
      const float* d = delta.row_f32(r);
      float* res_out = residual_out.row_f32(r);
      for (int64_t i = 0; i < residual.cols; ++i) res_out[i] = res[i] + d[i];
      rms_norm_row(res_out, weight.f32(), eps, residual.cols, out.row_f32(r));
    }
  }

  void head_norm_rope(Tensor& x, int n_heads, int head_dim, const Tensor* norm_weight, float eps,
                      const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) override {
    // The leading 2 * inv_freq.size() dimensions rotate (all of them, or Qwen3.5's partial rotary).
    const int half = static_cast<int>(inv_freq.size());
    check(half >= 1 && 2 * half <= head_dim, "cpu backend: rope table size mismatch");
#pragma omp parallel for schedule(static) if (x.rows > 8)
    for (int64_t r = 0; r < x.rows; ++r) {
      std::vector<float> cos_t(half), sin_t(half);
      for (int i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[r]) * inv_freq[i];  // float32, as Hugging Face
        cos_t[i] = std::cos(angle);
        sin_t[i] = std::sin(angle);
      }
      for (int h = 0; h < n_heads; ++h) {
        float* v = x.row_f32(r) + int64_t{h} * head_dim;
        if (norm_weight) rms_norm_row(v, norm_weight->f32(), eps, head_dim, v);
        for (int i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_t[i] - b * sin_t[i];
          v[i + half] = b * cos_t[i] + a * sin_t[i];
        }
      }
    }
  }

  void swiglu(const Tensor& gate_up, Tensor& out) override {
    const int64_t n = out.cols;
    check(gate_up.cols == 2 * n, "cpu backend: swiglu shape mismatch");
#pragma omp parallel for schedule(static) if (out.rows > 8)
    for (int64_t r = 0; r < out.rows; ++r) {
      const float* g = gate_up.row_f32(r);
      float* o = out.row_f32(r);
      for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * g[n + i];
    }
  }

  void kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                const std::vector<int32_t>& slots) override {
    for (int64_t r = 0; r < k.rows; ++r) {
      check(slots[r] >= 0 && slots[r] < k_cache.rows, "cpu backend: KV slot out of range");
      std::memcpy(k_cache.row_f32(slots[r]), k.row_f32(r), sizeof(float) * k.cols);
      std::memcpy(v_cache.row_f32(slots[r]), v.row_f32(r), sizeof(float) * v.cols);
    }
  }

  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                 const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                 const AttentionParams& p, Tensor& out) override {
    const int group = p.n_heads / p.n_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
    // Flatten (segment, row, head) so that both cores get work even for one row.
    struct Item { const AttentionSegment* seg; int32_t row; int head; };
    std::vector<Item> items;
    for (const auto& s : segments)
      for (int32_t r = s.first_row; r < s.first_row + s.n_rows; ++r)
        for (int h = 0; h < p.n_heads; ++h) items.push_back({&s, r, h});
#pragma omp parallel
    {
      std::vector<float> scores;
      std::vector<float> acc(p.head_dim);
#pragma omp for schedule(dynamic, 4)
      for (size_t it = 0; it < items.size(); ++it) {
        const auto& [seg, r, h] = items[it];
        const int kvh = h / group;
        const int32_t q_pos = positions[r];
        const float* qv = q.row_f32(r) + int64_t{h} * p.head_dim;
        scores.assign(seg->n_keys, -std::numeric_limits<float>::infinity());
        float max_score = -std::numeric_limits<float>::infinity();
        for (int32_t j = 0; j < seg->n_keys; ++j) {
          if (seg->causal && j > q_pos) continue;
          if (p.sliding_window > 0 && q_pos - j >= p.sliding_window) continue;
          const int64_t slot = int64_t{seg->page_table[j / p.page_size]} * p.page_size + j % p.page_size;
          scores[j] = dot(qv, k_cache.row_f32(slot) + int64_t{kvh} * p.head_dim, p.head_dim) * scale;
          max_score = std::max(max_score, scores[j]);
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        float sum = 0.0f;
        for (int32_t j = 0; j < seg->n_keys; ++j) {
          if (scores[j] == -std::numeric_limits<float>::infinity()) continue;
          const float e = std::exp(scores[j] - max_score);
          sum += e;
          const int64_t slot = int64_t{seg->page_table[j / p.page_size]} * p.page_size + j % p.page_size;
          const float* vv = v_cache.row_f32(slot) + int64_t{kvh} * p.head_dim;
          for (int d = 0; d < p.head_dim; ++d) acc[d] += e * vv[d];
        }
        float* o = out.row_f32(r) + int64_t{h} * p.head_dim;
        const float inv = sum > 0 ? 1.0f / sum : 0.0f;
        for (int d = 0; d < p.head_dim; ++d) o[d] = acc[d] * inv;
      }
    }
  }

  void moe(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows, MoeScratch*) override {
    check_moe(x, w, out, expert_rows);
    const int64_t h = x.cols, ff = w.n_ff;
    std::vector<std::vector<std::pair<int, float>>> routes(static_cast<size_t>(x.rows));
    for (int64_t r = 0; r < x.rows; ++r) {
      std::vector<float> logits(static_cast<size_t>(w.n_experts));
      for (int e = 0; e < w.n_experts; ++e) logits[e] = dot(x.row_f32(r), w.router.row_f32(e), h);
      routes[r] = route_row(logits.data(), w.n_experts, w.top_k, w.norm_topk_prob);
    }
    // One row's experts in increasing index, each added to out as soon as it is done: the same
    // operations in the same order whatever the other rows.
    auto run_row = [&](int64_t r, std::vector<float>& act, bool parallel) {
      const float* xr = x.row_f32(r);
      float* o = out.row_f32(r);
      std::fill(o, o + h, 0.0f);
      for (const auto& [e, weight] : routes[r]) {
        const int64_t gate0 = int64_t{e} * 2 * ff, down0 = int64_t{e} * h;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t i = 0; i < ff; ++i)
          act[i] = silu(dot(xr, w.gate_up.row_f32(gate0 + i), h)) * dot(xr, w.gate_up.row_f32(gate0 + ff + i), h);
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t j = 0; j < h; ++j) o[j] += weight * dot(act.data(), w.down.row_f32(down0 + j), ff);
      }
    };
    if (x.rows == 1) {
      std::vector<float> act(static_cast<size_t>(ff));
      run_row(0, act, true);
    } else {
#pragma omp parallel
      {
        std::vector<float> act(static_cast<size_t>(ff));
#pragma omp for schedule(dynamic)
        for (int64_t r = 0; r < x.rows; ++r) run_row(r, act, false);
      }
    }
    if (expert_rows) {
      auto* counts = static_cast<int32_t*>(expert_rows->data);
      for (int e = 0; e < w.n_experts; ++e) counts[e * expert_rows->stride] = 0;
      for (const auto& route : routes)
        for (const auto& chosen : route) ++counts[chosen.first * expert_rows->stride];
    }
  }

  bool has_gated_delta_net() const override { return true; }
  void gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                       RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments,
                       Tensor& out, Tensor*) override {
    cpu_gated_delta_net(proj, w, p, cache, layer, segments, out);
  }

  void sigmoid_mul(Tensor& x, const Tensor& gate) override {
    check(gate.rows == x.rows && gate.cols == x.cols, "cpu backend: sigmoid_mul shape mismatch");
    for (int64_t r = 0; r < x.rows; ++r) {
      float* v = x.row_f32(r);
      const float* g = gate.row_f32(r);
      for (int64_t i = 0; i < x.cols; ++i) v[i] *= 1.0f / (1.0f + std::exp(-g[i]));
    }
  }

  void add_sigmoid_scaled(Tensor& acc, const Tensor& y, const Tensor& gate) override {
    check(y.rows == acc.rows && y.cols == acc.cols && gate.rows == acc.rows && gate.cols == 1,
          "cpu backend: add_sigmoid_scaled shape mismatch");
    for (int64_t r = 0; r < acc.rows; ++r) {
      float* o = acc.row_f32(r);
      const float* v = y.row_f32(r);
      const float s = 1.0f / (1.0f + std::exp(-gate.row_f32(r)[0]));
      for (int64_t i = 0; i < acc.cols; ++i) o[i] += s * v[i];
    }
  }

  void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& out) override {
    for (size_t i = 0; i < rows.size(); ++i) {
      check(rows[i] >= 0 && rows[i] < src.rows, "cpu backend: gather row out of range");
      std::memcpy(out.row_f32(static_cast<int64_t>(i)), src.row_f32(rows[i]), sizeof(float) * src.cols);
    }
  }

  void copy_rows(const Tensor& src, Tensor& dst) override {
    check(src.dtype == dst.dtype && src.rows == dst.rows && src.cols == dst.cols, "cpu backend: copy_rows shape mismatch");
    const size_t row_bytes = static_cast<size_t>(src.cols) * dtype_size(src.dtype);
    for (int64_t r = 0; r < src.rows; ++r)
      std::memmove(static_cast<char*>(dst.data) + r * dst.stride * static_cast<int64_t>(dtype_size(dst.dtype)),
                   static_cast<const char*>(src.data) + r * src.stride * static_cast<int64_t>(dtype_size(src.dtype)),
                   row_bytes);
  }

  // The rows are in host memory already: no copies.
  std::vector<TopCandidates> select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                               const std::vector<float>& temperature,
                                               const std::vector<int32_t>& top_k) override {
    std::vector<TopCandidates> out;
    for (size_t i = 0; i < rows.size(); ++i)
      out.push_back(select_top_candidates(logits.row_f32(rows[i]), logits.cols, temperature[i], top_k[i]));
    return out;
  }

  std::vector<int32_t> argmax_rows(const Tensor& x) override {
    std::vector<int32_t> out(static_cast<size_t>(x.rows));
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* v = x.row_f32(r);
      out[r] = static_cast<int32_t>(std::max_element(v, v + x.cols) - v);
    }
    return out;
  }

  Tensor alloc_ids(int64_t n) override {
    Tensor t = alloc(n, 1);  // float storage of the same size
    t.dtype = DType::I32;
    return t;
  }

  void argmax_ids(const Tensor& x, Tensor& ids) override {
    check(ids.dtype == DType::I32 && ids.rows == x.rows, "cpu backend: argmax_ids needs an I32 tensor of x's rows");
    const std::vector<int32_t> a = argmax_rows(x);
    for (int64_t r = 0; r < ids.rows; ++r) static_cast<int32_t*>(ids.data)[r * ids.stride] = a[r];
  }

  // std::max_element's choice (argmax_rows) over the parts, for rows without NaN: a later part's
  // best replaces the best so far only when it is larger. A NaN candidate (a part with no columns,
  // or whose max_element is NaN) never wins.
  void argmax_candidates(const Tensor& x, int64_t first_id, Tensor& cand) override {
    check(cand.rows == x.rows && cand.cols == 2, "cpu backend: argmax_candidates needs [x.rows, 2] candidates");
    check(first_id + x.cols <= (int64_t{1} << 24), "argmax candidates: ids beyond 2^24 are not exact in float32");
    const std::vector<int32_t> a = argmax_rows(x);
    for (int64_t r = 0; r < x.rows; ++r) {
      float* c = cand.row_f32(r);
      c[0] = x.cols > 0 ? x.row_f32(r)[a[r]] : std::nanf("");
      c[1] = x.cols > 0 ? static_cast<float>(first_id + a[r]) : 0.0f;
    }
  }
  void argmax_of_candidates(const Tensor& all, Tensor& ids) override {
    check(ids.dtype == DType::I32 && ids.rows == all.rows && all.cols % 2 == 0,
          "cpu backend: argmax_of_candidates needs [rows, 2 n] candidates and an id per row");
    for (int64_t r = 0; r < all.rows; ++r) {
      const float* c = all.row_f32(r);
      int64_t best = -1;
      for (int64_t k = 0; k < all.cols / 2; ++k)
        if (!std::isnan(c[2 * k]) && (best < 0 || c[2 * best] < c[2 * k])) best = k;
      static_cast<int32_t*>(ids.data)[r * ids.stride] = best < 0 ? 0 : static_cast<int32_t>(c[2 * best + 1]);
    }
  }

  std::vector<int32_t> ids_to_host(const Tensor& ids) override {
    check(ids.dtype == DType::I32 && ids.cols == 1, "cpu backend: ids_to_host needs an I32 tensor of one column");
    std::vector<int32_t> out(static_cast<size_t>(ids.rows));
    for (int64_t r = 0; r < ids.rows; ++r) out[r] = static_cast<const int32_t*>(ids.data)[r * ids.stride];
    return out;
  }
};

}  // namespace

// Batch-invariant by construction (each row is computed alone), so the options change nothing.
std::unique_ptr<Backend> make_cpu_backend(const BackendOptions&) { return std::make_unique<CpuBackend>(); }

}  // namespace dflash
