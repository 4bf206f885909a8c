// Every CPU kernel against a float64 reference on fresh random inputs, with
// outputs poisoned (NaN) before each run, at several (odd) sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/backend.h"
#include "test_util.h"

namespace dflash {
namespace {

using test::max_rel_error;
using test::random_vector;

constexpr double kTol = 1e-5;

class CpuKernels : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::mt19937 rng{std::random_device{}()};

  Tensor random_tensor(int64_t rows, int64_t cols, float scale = 1.0f) {
    auto v = random_vector(rng, static_cast<size_t>(rows * cols), scale);
    return be->upload_host(v.data(), rows, cols);
  }
  Tensor poisoned(int64_t rows, int64_t cols) {
    std::vector<float> v(static_cast<size_t>(rows * cols), std::numeric_limits<float>::quiet_NaN());
    return be->upload_host(v.data(), rows, cols);
  }
  std::vector<double> host(const Tensor& t) {
    auto v = be->to_host(t);
    return {v.begin(), v.end()};
  }
};

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

TEST_F(CpuKernels, MatmulWithBiasAndColumnViews) {
  for (auto [n, k, m] : {std::tuple{1, 7, 5}, {5, 64, 33}, {16, 129, 70}}) {
    Tensor wide = random_tensor(n, k + 3), w = random_tensor(m, k), bias = random_tensor(1, m);
    Tensor x = wide.slice_cols(2, k);  // non-contiguous input
    Tensor out = poisoned(n, m);
    be->matmul(x, w, &bias, out);
    auto xh = host(wide), wh = host(w), bh = host(bias);
    std::vector<double> ref(n * m);
    for (int r = 0; r < n; ++r)
      for (int o = 0; o < m; ++o) {
        double s = bh[o];
        for (int i = 0; i < k; ++i) s += xh[r * (k + 3) + 2 + i] * wh[o * k + i];
        ref[r * m + o] = s;
      }
    EXPECT_LT(max_rel_error(be->to_host(out), to_float(ref)), kTol) << n << "x" << k << "x" << m;
    // Each row alone gives bit-identical results (batch independence).
    for (int r = 0; r < n; ++r) {
      Tensor one = poisoned(1, m);
      be->matmul(x.slice_rows(r, 1), w, &bias, one);
      auto a = be->to_host(one), b = be->to_host(out.slice_rows(r, 1));
      ASSERT_EQ(a, b) << "row " << r;
    }
  }
}

TEST_F(CpuKernels, RmsNormAndAddRmsNorm) {
  for (int cols : {1, 17, 256}) {
    const int rows = 9;
    const float eps = 1e-6f;
    Tensor x = random_tensor(rows, cols), d = random_tensor(rows, cols), w = random_tensor(1, cols);
    auto xh = host(x), dh = host(d), wh = host(w);
    auto norm_ref = [&](const std::vector<double>& v) {
      std::vector<double> out(v.size());
      for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int i = 0; i < cols; ++i) ss += v[r * cols + i] * v[r * cols + i];
        const double s = 1.0 / std::sqrt(ss / cols + eps);
        for (int i = 0; i < cols; ++i) out[r * cols + i] = wh[i] * v[r * cols + i] * s;
      }
      return out;
    };
    Tensor out = poisoned(rows, cols);
    be->rms_norm(x, w, eps, out);
    EXPECT_LT(max_rel_error(be->to_host(out), to_float(norm_ref(xh))), kTol);
    std::vector<double> sum(xh.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] = xh[i] + dh[i];
    Tensor out2 = poisoned(rows, cols), x_out = poisoned(rows, cols);
    be->add_rms_norm(x, d, x_out, w, eps, out2);  // into another tensor
    EXPECT_LT(max_rel_error(be->to_host(x_out), to_float(sum)), kTol);
    EXPECT_LT(max_rel_error(be->to_host(out2), to_float(norm_ref(sum))), kTol);
    EXPECT_LT(max_rel_error(be->to_host(x), to_float(xh)), kTol);  // the input is left alone
    Tensor out3 = poisoned(rows, cols);
    be->add_rms_norm(x, d, x, w, eps, out3);  // in place
    EXPECT_LT(max_rel_error(be->to_host(x), to_float(sum)), kTol);
    EXPECT_LT(max_rel_error(be->to_host(out3), to_float(norm_ref(sum))), kTol);
  }
}

TEST_F(CpuKernels, HeadNormRope) {
  const int rows = 5, heads = 3, hd = 10;
  Tensor x = random_tensor(rows, heads * hd), w = random_tensor(1, hd);
  std::vector<int32_t> pos = {0, 1, 7, 100, 511};
  std::vector<float> inv(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv[i] = 1.0f / std::pow(10000.0f, 2.0f * i / hd);
  auto xh = host(x), wh = host(w);
  std::vector<double> ref(xh.size());
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const double* v = &xh[(r * heads + h) * hd];
      double ss = 0;
      for (int i = 0; i < hd; ++i) ss += v[i] * v[i];
      const double s = 1.0 / std::sqrt(ss / hd + 1e-6);
      std::vector<double> n(hd);
      for (int i = 0; i < hd; ++i) n[i] = wh[i] * v[i] * s;
      for (int i = 0; i < hd / 2; ++i) {
        const double a = static_cast<double>(static_cast<float>(pos[r]) * inv[i]);
        ref[(r * heads + h) * hd + i] = n[i] * std::cos(a) - n[i + hd / 2] * std::sin(a);
        ref[(r * heads + h) * hd + i + hd / 2] = n[i + hd / 2] * std::cos(a) + n[i] * std::sin(a);
      }
    }
  be->head_norm_rope(x, heads, hd, &w, 1e-6f, pos, inv);
  EXPECT_LT(max_rel_error(be->to_host(x), to_float(ref)), kTol);
}

TEST_F(CpuKernels, Swiglu) {
  Tensor gu = random_tensor(3, 2 * 13), out = poisoned(3, 13);
  be->swiglu(gu, out);
  auto g = host(gu);
  std::vector<double> ref(3 * 13);
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 13; ++i) {
      const double a = g[r * 26 + i], b = g[r * 26 + 13 + i];
      ref[r * 13 + i] = a / (1 + std::exp(-a)) * b;
    }
  EXPECT_LT(max_rel_error(be->to_host(out), to_float(ref)), kTol);
}

// Paged attention with GQA in the three masks the engine uses.
TEST_F(CpuKernels, PagedAttentionCausalBidirectionalWindow) {
  const int n_heads = 6, n_kv = 2, hd = 8, page = 3, n_pages = 6;
  const std::vector<int32_t> table = {4, 1, 5, 0, 2};
  for (int mode = 0; mode < 3; ++mode) {
    const bool causal = mode != 1;
    const int window = mode == 2 ? 4 : 0;
    const int n_past = 7, n_new = 5, n_keys = n_past + n_new;
    Tensor kc = random_tensor(n_pages * page, n_kv * hd), vc = random_tensor(n_pages * page, n_kv * hd);
    Tensor q = random_tensor(n_new, n_heads * hd), out = poisoned(n_new, n_heads * hd);
    std::vector<int32_t> pos;
    for (int i = 0; i < n_new; ++i) pos.push_back(n_past + i);
    AttentionSegment seg{0, n_new, n_keys, table.data(), causal};
    AttentionParams p{n_heads, n_kv, hd, window, page};
    be->attention(q, kc, vc, {seg}, pos, p, out);
    auto qh = host(q), kh = host(kc), vh = host(vc);
    std::vector<double> ref(n_new * n_heads * hd, 0.0);
    for (int r = 0; r < n_new; ++r)
      for (int h = 0; h < n_heads; ++h) {
        const int kvh = h / (n_heads / n_kv);
        std::vector<double> s;
        std::vector<int> keys;
        for (int j = 0; j < n_keys; ++j) {
          if (causal && j > pos[r]) continue;
          if (window && pos[r] - j >= window) continue;
          const int slot = table[j / page] * page + j % page;
          double d = 0;
          for (int i = 0; i < hd; ++i) d += qh[(r * n_heads + h) * hd + i] * kh[(slot * n_kv + kvh) * hd + i];
          s.push_back(d / std::sqrt(hd));
          keys.push_back(slot);
        }
        double mx = -1e300, sum = 0;
        for (double v : s) mx = std::max(mx, v);
        for (double& v : s) sum += (v = std::exp(v - mx));
        for (size_t j = 0; j < s.size(); ++j)
          for (int i = 0; i < hd; ++i) ref[(r * n_heads + h) * hd + i] += s[j] / sum * vh[(keys[j] * n_kv + kvh) * hd + i];
      }
    EXPECT_LT(max_rel_error(be->to_host(out), to_float(ref)), kTol) << "mode " << mode;
  }
}

TEST_F(CpuKernels, EmbedGatherArgmaxKvWrite) {
  Tensor table = random_tensor(11, 6), out = poisoned(3, 6);
  be->embed(table, {10, 0, 4}, out);
  auto t = be->to_host(table), o = be->to_host(out);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(o[i], t[10 * 6 + i]);
    EXPECT_EQ(o[12 + i], t[4 * 6 + i]);
  }
  std::vector<int32_t> bad = {11};
  EXPECT_THROW(be->embed(table, bad, out), std::exception);
  const auto am = be->argmax_rows(table);
  for (int r = 0; r < 11; ++r) {
    int best = 0;
    for (int i = 1; i < 6; ++i) if (t[r * 6 + i] > t[r * 6 + best]) best = i;
    EXPECT_EQ(am[r], best);
  }
  // Ids kept on the device: argmax_ids equals argmax_rows, and an embedding takes them for the
  // listed rows (an out-of-range device id reads row 0 rather than failing).
  Tensor ids = be->alloc_ids(11);
  be->argmax_ids(table, ids);
  EXPECT_EQ(be->ids_to_host(ids), am);
  Tensor dev = be->alloc_ids(2);
  be->argmax_ids(table.slice_rows(7, 2), dev);
  Tensor patched = poisoned(3, 6);
  const DeviceTokens from{dev, {2, 0}};
  be->embed(table, {5, 6, 1}, patched, &from);
  auto p = be->to_host(patched);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(p[i], t[am[8] * 6 + i]);       // row 0 <- device id 1
    EXPECT_EQ(p[6 + i], t[6 * 6 + i]);       // row 1 keeps its host id
    EXPECT_EQ(p[12 + i], t[am[7] * 6 + i]);  // row 2 <- device id 0
  }
  static_cast<int32_t*>(dev.data)[0] = 99;
  be->embed(table, {5, 6, 1}, patched, &from);
  EXPECT_EQ(be->to_host(patched)[12], t[0]);
  Tensor kc = poisoned(4, 6), vc = poisoned(4, 6);
  be->kv_write(out.slice_rows(0, 2), out.slice_rows(1, 2), kc, vc, {3, 1});
  auto kh = be->to_host(kc);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(kh[3 * 6 + i], o[i]);
}


// The routed MLP against a float64 transcription of transformers' Qwen3MoeSparseMoeBlock
// (softmax, top-k, optional renormalization, experts summed in index order).
TEST_F(CpuKernels, MoeMatchesFloat64Routing) {
  for (auto [rows, h, n_experts, top_k, ff, norm] :
       {std::tuple{1, 24, 4, 1, 8, false}, {5, 64, 8, 2, 48, true}, {9, 33, 16, 4, 20, false}, {3, 40, 6, 6, 12, true}}) {
    MoeWeights w;
    w.n_experts = n_experts;
    w.top_k = top_k;
    w.n_ff = ff;
    w.norm_topk_prob = norm;
    w.router = random_tensor(n_experts, h, 2.0f);
    w.gate_up = random_tensor(int64_t{n_experts} * 2 * ff, h, 0.3f);
    w.down = random_tensor(int64_t{n_experts} * h, ff, 0.3f);
    Tensor x = random_tensor(rows, h), out = poisoned(rows, h), counts = be->alloc_ids(n_experts);
    be->moe(x, w, out, &counts);
    const auto xh = host(x), rh = host(w.router), guh = host(w.gate_up), dh = host(w.down);
    std::vector<double> ref(static_cast<size_t>(rows * h), 0.0);
    std::vector<int32_t> ref_counts(n_experts, 0);
    for (int r = 0; r < rows; ++r) {
      std::vector<double> p(n_experts);
      double mx = -1e300, sum = 0;
      for (int e = 0; e < n_experts; ++e) {
        p[e] = 0;
        for (int i = 0; i < h; ++i) p[e] += xh[r * h + i] * rh[e * h + i];
        mx = std::max(mx, p[e]);
      }
      for (double& v : p) sum += v = std::exp(v - mx);
      for (double& v : p) v /= sum;
      std::vector<int> order(n_experts);
      for (int e = 0; e < n_experts; ++e) order[e] = e;
      std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      double top_sum = 0;
      for (int i = 0; i < top_k; ++i) top_sum += p[order[i]];
      for (int i = 0; i < top_k; ++i) {
        const int e = order[i];
        ++ref_counts[e];
        const double weight = norm ? p[e] / top_sum : p[e];
        std::vector<double> act(ff);
        for (int f = 0; f < ff; ++f) {
          double g = 0, u = 0;
          for (int k = 0; k < h; ++k) {
            g += xh[r * h + k] * guh[(int64_t{e} * 2 * ff + f) * h + k];
            u += xh[r * h + k] * guh[(int64_t{e} * 2 * ff + ff + f) * h + k];
          }
          act[f] = g / (1 + std::exp(-g)) * u;
        }
        for (int j = 0; j < h; ++j) {
          double y = 0;
          for (int f = 0; f < ff; ++f) y += act[f] * dh[(int64_t{e} * h + j) * ff + f];
          ref[r * h + j] += weight * y;
        }
      }
    }
    EXPECT_LT(max_rel_error(be->to_host(out), to_float(ref)), kTol) << rows << " rows, " << n_experts << " experts";
    EXPECT_EQ(be->ids_to_host(counts), ref_counts);
    for (int r = 0; r < rows; ++r) {  // each row alone: the same bits
      Tensor one = poisoned(1, h);
      be->moe(x.slice_rows(r, 1), w, one);
      ASSERT_EQ(be->to_host(one), be->to_host(out.slice_rows(r, 1))) << "row " << r;
    }
  }
}

}  // namespace
}  // namespace dflash
