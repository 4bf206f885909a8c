// Every CUDA op against the CPU backend (the fp32 reference) on fresh random
// inputs, in the spirit of llama.cpp's test-backend-ops. Inputs are rounded to
// bf16 first so that both backends see the same values; GPU outputs are
// poisoned (NaN) before each run, so an element left unwritten fails.
// Bound: ||gpu - cpu|| / ||cpu|| <= 1e-2 (bf16 activations). Skipped without a GPU.
#include <gtest/gtest.h>

#include <limits>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <utility>

#include "kernels/backend.h"
#include "kernels/cuda/kernel_forms.h"
#include "test_util.h"
#include "util/dtype.h"
#include "util/error.h"

namespace dflash {
namespace {

constexpr double kBound = 1e-2;

std::vector<float> bf16_rounded(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU here: GPU tests run on the device (scripts/device-test.sh)";
    gpu = make_cuda_backend();
    cpu = make_cpu_backend();
    rng.seed(std::random_device{}());
  }

  // The same matrix on both backends: bf16 on the GPU (random values rounded to bf16 first), or
  // float32 (f32: the residual stream; not rounded). The CPU keeps float32.
  struct Pair {
    Tensor c, g;
    std::vector<float> host;
  };
  Pair pair_of(std::vector<float> host, int64_t rows, int64_t cols, bool f32) {
    Pair p;
    p.host = std::move(host);
    p.c = cpu->upload_host(p.host.data(), rows, cols);
    p.g = f32 ? gpu->upload_host_f32(p.host.data(), rows, cols) : gpu->upload_host(p.host.data(), rows, cols);
    return p;
  }
  Pair random(int64_t rows, int64_t cols, float scale = 1.0f) {
    return pair_of(bf16_rounded(test::random_vector(rng, static_cast<size_t>(rows * cols), scale)), rows, cols, false);
  }
  Pair random_f32(int64_t rows, int64_t cols, float scale = 1.0f) {
    return pair_of(test::random_vector(rng, static_cast<size_t>(rows * cols), scale), rows, cols, true);
  }
  // An output: NaN on the GPU, so an element left unwritten fails; the CPU's is fresh.
  Pair poisoned(int64_t rows, int64_t cols, bool f32 = false) {
    Pair p = pair_of(std::vector<float>(static_cast<size_t>(rows * cols), NAN), rows, cols, f32);
    p.c = cpu->alloc(rows, cols);
    return p;
  }
  Pair poisoned_f32(int64_t rows, int64_t cols) { return poisoned(rows, cols, true); }
  void expect_close(const Pair& p, const std::string& what, double bound = kBound) {
    const double err = test::rel_l2_error(gpu->to_host(p.g), cpu->to_host(p.c));
    EXPECT_LE(err, bound) << what;
  }
  // Random routed-MLP weights on both backends: router logits of about 6 for unit inputs, each
  // expert's output of its input's scale.
  struct MoePairs {
    Pair router, gate_up, down;
    MoeWeights shape;  // everything but the tensors
    MoeWeights on(bool on_gpu) const {
      MoeWeights w = shape;
      w.router = on_gpu ? router.g : router.c;
      w.gate_up = on_gpu ? gate_up.g : gate_up.c;
      w.down = on_gpu ? down.g : down.c;
      return w;
    }
  };
  MoePairs random_moe(int h, int n_experts, int top_k, int ff, bool norm) {
    MoePairs m;
    m.router = random(n_experts, h, 6.0f / std::sqrt(static_cast<float>(h)));
    m.gate_up = random(int64_t{n_experts} * 2 * ff, h, 1.7f / std::sqrt(static_cast<float>(h)));
    m.down = random(int64_t{n_experts} * h, ff, 1.7f / std::sqrt(static_cast<float>(ff)));
    m.shape.n_experts = n_experts;
    m.shape.top_k = top_k;
    m.shape.n_ff = ff;
    m.shape.norm_topk_prob = norm;
    return m;
  }

  std::unique_ptr<Backend> gpu, cpu;
  std::mt19937 rng;
};

TEST_F(CudaOps, MatmulMatchesCpuForSkinnyAndLargeShapes) {
  const int64_t ms[] = {1, 3, 8, 16, 17, 32, 33, 100};
  // At 9 to 32 tokens, 5000 and 7000 rows take three and four 16-row tiles a block on an H100
  // (one block per SM).
  const int64_t shapes[][2] = {{1, 64}, {17, 136}, {256, 8}, {1000, 4096}, {333, 12}, {4096, 1000}, {5000, 64}, {7000, 40}};
  for (int64_t m : ms) {
    for (const auto& s : shapes) {
      const int64_t n = s[0], k = s[1];
      for (bool with_bias : {false, true}) {
        auto x = random(m, k), w = random(n, k, 0.05f), b = random(1, n), out = poisoned(m, n);
        cpu->matmul(x.c, w.c, with_bias ? &b.c : nullptr, out.c);
        gpu->matmul(x.g, w.g, with_bias ? &b.g : nullptr, out.g);
        expect_close(out, testing::PrintToString(std::vector<int64_t>{m, n, k, with_bias}));
      }
    }
  }
}

// cuBLASLt's products take the algorithm of their row count's bucket, chosen at first use. After
// prepare_products, the first product of each shape (seen before or not) first runs every bucket's
// algorithm on its own operands: every row count of a bucket, before and after preparing, matches
// the CPU (the product's own launch comes last), and a repeated product gives the same bits.
TEST_F(CudaOps, LargeProductsOfEveryRowBucketMatchCpu) {
  const int64_t k = 512;
  auto w = random(1024, k, 0.05f), w2 = random(800, k, 0.05f);
  auto product = [&](const Pair& wt, int64_t m, const std::string& what) {
    const int64_t n = wt.c.rows;
    auto x = random(m, k), out = poisoned(m, n);
    cpu->matmul(x.c, wt.c, nullptr, out.c);
    gpu->matmul(x.g, wt.g, nullptr, out.g);
    expect_close(out, what + ", " + std::to_string(n) + " x " + std::to_string(m) + " rows");
    Tensor again = gpu->alloc(m, n);
    gpu->matmul(x.g, wt.g, nullptr, again);
    EXPECT_EQ(gpu->to_host(again), gpu->to_host(out.g)) << what << ", " << m << " rows: repeated";
  };
  for (int64_t m : {33, 64, 65, 127}) product(w, m, "chosen at first use");
  gpu->prepare_products(1000);
  for (int64_t m : {128, 129, 500, 511, 512, 999, 1000, 1100}) product(w, m, "prepared, a shape seen before");
  for (int64_t m : {700, 40, 1000}) product(w2, m, "prepared, a new shape");
}

// The basis of lossless speculative decoding on the GPU: a row's product is
// bit-identical whether it is computed alone or among up to 32 rows, and whatever number of
// weight tiles a block takes (1000, 4096 and 6144 rows at more than 8 tokens: one, two and three
// tiles on an H100, one block per SM; compared with the usual blocks forced, and with wide ones at
// any number of tokens).
TEST_F(CudaOps, SkinnyMatmulRowsDoNotDependOnTheBatch) {
  const int64_t k = 4096;
  for (int64_t n : {1000, 4096, 6144}) {
    auto w = random(n, k, 0.05f);
    for (int64_t m : {2, 9, 16, 32}) {
      auto x = random(m, k);
      Tensor all = gpu->alloc(m, n);
      gpu->matmul(x.g, w.g, nullptr, all);
      const std::vector<float> batched = gpu->to_host(all);
      using Wide = cuda::KernelForms::Wide;
      for (Wide wide : {Wide::never, Wide::any_rows}) {
        Tensor other = gpu->alloc(m, n);
        cuda::KernelForms forced;
        forced.skinny_wide = wide;
        cuda::force_kernel_forms(*gpu, forced);
        gpu->matmul(x.g, w.g, nullptr, other);
        cuda::force_kernel_forms(*gpu, {});
        ASSERT_EQ(gpu->to_host(other), batched)
            << (wide == Wide::never ? "usual blocks" : "wide blocks at any rows") << " n=" << n << " m=" << m;
      }
      for (int64_t r : {int64_t{0}, m / 2, m - 1}) {
        Tensor one = gpu->alloc(1, n);
        gpu->matmul(x.g.slice_rows(r, 1), w.g, nullptr, one);
        const std::vector<float> alone = gpu->to_host(one);
        ASSERT_TRUE(std::equal(alone.begin(), alone.end(), batched.begin() + r * n)) << "n=" << n << " m=" << m << " row " << r;
      }
    }
  }
}

// Several row groups of one weight in one product (the draft's k/v rows of every layer) give each
// group's own product, bit for bit, and the CPU's values.
TEST_F(CudaOps, RowGroupProductsEqualEachGroupsProduct) {
  struct Case { int64_t first, rows, step; int count; int64_t k; };
  // The second: as many output features as take two tiles a block on an H100.
  for (const Case& c : {Case{128, 128, 384, 5, 256}, Case{1024, 2048, 3072, 5, 256}, Case{0, 64, 64, 3, 72}}) {
    auto w = random(c.first + (c.count - 1) * c.step + c.rows + 16, c.k, 0.05f);
    const RowGroups g{c.first, c.rows, c.step, c.count};
    for (int64_t m : {1, 16, 32}) {
      auto x = random(m, c.k), out = poisoned(m, c.count * c.rows);
      cpu->matmul_row_groups(x.c, w.c, g, out.c);
      gpu->matmul_row_groups(x.g, w.g, g, out.g);
      const std::string what = testing::PrintToString(std::vector<int64_t>{c.first, c.rows, c.step, c.count, m});
      expect_close(out, what);
      const std::vector<float> all = gpu->to_host(out.g);
      for (int i = 0; i < c.count; ++i) {
        Tensor one = gpu->alloc(m, c.rows);
        gpu->matmul(x.g, w.g.slice_rows(c.first + i * c.step, c.rows), nullptr, one);
        const std::vector<float> alone = gpu->to_host(one);
        for (int64_t r = 0; r < m; ++r)
          ASSERT_TRUE(std::equal(alone.begin() + r * c.rows, alone.begin() + (r + 1) * c.rows,
                                 all.begin() + r * c.count * c.rows + i * c.rows))
              << what << " group " << i << " row " << r;
      }
    }
  }
  auto x = random(2, 256), w = random(512, 256), out = poisoned(2, 3 * 128);
  EXPECT_THROW(gpu->matmul_row_groups(x.g, w.g, RowGroups{128, 128, 192, 3}, out.g), Error) << "past the weight";
}

// Several layers' k norm + RoPE + cache writes in one call equal the layers' own calls, bit for bit.
TEST_F(CudaOps, KvRopeWriteLayersEqualsEachLayer) {
  const int n_kv = 2, hd = 128, n_layers = 3, rows = 5;
  const int64_t width = 2 * n_kv * hd;
  auto kv = random(rows, n_layers * width);
  auto norm0 = random(1, hd), norm2 = random(1, hd);
  const std::vector<const Tensor*> norms_g{&norm0.g, nullptr, &norm2.g}, norms_c{&norm0.c, nullptr, &norm2.c};
  std::vector<float> inv_freq(hd / 2);
  for (int i = 0; i < hd / 2; ++i) inv_freq[i] = std::pow(1e6f, -2.0f * i / hd);
  const std::vector<int32_t> positions{0, 7, 300, 301, 1000}, slots{3, 17, 40, 41, 9};
  KvCache together = gpu->alloc_kv(n_layers, 4, 16, n_kv, hd), apart = gpu->alloc_kv(n_layers, 4, 16, n_kv, hd);
  KvCache on_cpu = cpu->alloc_kv(n_layers, 4, 16, n_kv, hd);
  Tensor kv2 = gpu->alloc(rows, n_layers * width);
  gpu->gather_rows(kv.g, {0, 1, 2, 3, 4}, kv2);  // a copy: the calls rotate keys in place
  gpu->kv_rope_write_layers(kv.g, n_kv, hd, norms_g, 1e-6f, positions, inv_freq, together.k, together.v, slots);
  cpu->kv_rope_write_layers(kv.c, n_kv, hd, norms_c, 1e-6f, positions, inv_freq, on_cpu.k, on_cpu.v, slots);
  for (int l = 0; l < n_layers; ++l) {
    Tensor layer = kv2.slice_cols(l * width, width);
    gpu->qkv_rope_kv_write(layer, 0, n_kv, hd, nullptr, norms_g[l], 1e-6f, positions, inv_freq, apart.k[l], apart.v[l],
                           slots);
  }
  for (int l = 0; l < n_layers; ++l) {
    for (int32_t slot : slots) {
      const auto a = gpu->to_host(together.k[l].slice_rows(slot, 1)), b = gpu->to_host(apart.k[l].slice_rows(slot, 1));
      const auto c = gpu->to_host(together.v[l].slice_rows(slot, 1)), d = gpu->to_host(apart.v[l].slice_rows(slot, 1));
      ASSERT_EQ(a, b) << "layer " << l << " key slot " << slot;
      ASSERT_EQ(c, d) << "layer " << l << " value slot " << slot;
      const double err = test::rel_l2_error(a, cpu->to_host(on_cpu.k[l].slice_rows(slot, 1)));
      EXPECT_LE(err, kBound) << "layer " << l << " key slot " << slot << " vs the CPU";
    }
  }
}

TEST_F(CudaOps, EmbedAndGatherRowsIntoAColumnSlice) {
  auto table = random(300, 72);
  std::vector<int32_t> ids(37);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % 300);
  auto out = poisoned(37, 72), out32 = poisoned_f32(37, 72);
  cpu->embed(table.c, ids, out.c);
  gpu->embed(table.g, ids, out.g);
  expect_close(out, "embed");
  cpu->embed(table.c, ids, out32.c);
  gpu->embed(table.g, ids, out32.g);
  expect_close(out32, "embed into float32", 0.0);
  {  // float32 rows gathered into bf16
    std::vector<int32_t> rows(9);
    for (auto& r : rows) r = static_cast<int32_t>(rng() % 37);
    auto src = random_f32(37, 72), dst = poisoned(9, 72);
    cpu->gather_rows(src.c, rows, dst.c);
    gpu->gather_rows(src.g, rows, dst.g);
    expect_close(dst, "gather float32 into bf16");
  }
  {  // rows taking their ids from the device (the draft's argmax feeding verification)
    auto logits = random(5, 300);
    Tensor cpu_ids = cpu->alloc_ids(5), gpu_ids = gpu->alloc_ids(5);
    cpu->argmax_ids(logits.c, cpu_ids);
    gpu->argmax_ids(logits.g, gpu_ids);
    ASSERT_EQ(gpu->ids_to_host(gpu_ids), cpu->ids_to_host(cpu_ids));
    const std::vector<int32_t> rows{36, 1, 2, 20, 0};
    const DeviceTokens from_c{cpu_ids, rows}, from_g{gpu_ids, rows};
    auto patched = poisoned_f32(37, 72);
    cpu->embed(table.c, ids, patched.c, &from_c);
    gpu->embed(table.g, ids, patched.g, &from_g);
    expect_close(patched, "embed with device tokens", 0.0);
    const DeviceTokens too_few{gpu_ids, {1, 2}}, outside{gpu_ids, {36, 1, 2, 37, 0}};
    EXPECT_THROW(gpu->embed(table.g, ids, patched.g, &too_few), Error);
    EXPECT_THROW(gpu->embed(table.g, ids, patched.g, &outside), Error);
  }
  Pair wide;  // the columns around the slice must keep their contents
  std::vector<float> zeros(37 * 200, 0.0f);
  wide.c = cpu->upload_host(zeros.data(), 37, 200);
  wide.g = gpu->upload_host(zeros.data(), 37, 200);
  std::vector<int32_t> rows(37);
  for (auto& r : rows) r = static_cast<int32_t>(rng() % 37);
  Tensor gc = wide.c.slice_cols(72, 72), gg = wide.g.slice_cols(72, 72);
  cpu->gather_rows(out.c, rows, gc);
  gpu->gather_rows(out.g, rows, gg);
  expect_close(wide, "gather into columns 72..143");
  // Rows that are not whole 16-byte pieces (70 columns, a slice from column 1) are copied element
  // by element.
  auto src70 = random(37, 70), table70 = random(300, 70), out70 = poisoned(37, 70);
  Tensor uc = wide.c.slice_cols(1, 70), ug = wide.g.slice_cols(1, 70);
  cpu->gather_rows(src70.c, rows, uc);
  gpu->gather_rows(src70.g, rows, ug);
  expect_close(wide, "gather into columns 1..70");
  cpu->embed(table70.c, ids, out70.c);
  gpu->embed(table70.g, ids, out70.g);
  expect_close(out70, "embed, 70 columns", 0.0);
}

// Rows held in registers (cols % 8 == 0, up to 8192) and the general form (12, 10000), with a
// bf16 and a float32 residual stream.
TEST_F(CudaOps, RmsNormAndFusedResidualAdd) {
  for (bool f32 : {false, true}) {
    auto stream = [&](int64_t r, int64_t c, float scale) { return f32 ? random_f32(r, c, scale) : random(r, c, scale); };
    for (int64_t cols : {12, 64, 384, 1000, 4096, 8192, 10000}) {
      for (int64_t rows : {1, 5, 64}) {
        const std::string what = " cols=" + std::to_string(cols) + (f32 ? " float32" : "");
        auto x = stream(rows, cols, 3.0f), w = random(1, cols), out = poisoned(rows, cols);
        cpu->rms_norm(x.c, w.c, 1e-6f, out.c);
        gpu->rms_norm(x.g, w.g, 1e-6f, out.g);
        expect_close(out, "rms_norm" + what);
        auto res = stream(rows, cols, 1.0f), delta = random(rows, cols), out2 = poisoned(rows, cols);
        auto res_out = f32 ? poisoned_f32(rows, cols) : poisoned(rows, cols);
        cpu->add_rms_norm(res.c, delta.c, res_out.c, w.c, 1e-6f, out2.c);
        gpu->add_rms_norm(res.g, delta.g, res_out.g, w.g, 1e-6f, out2.g);
        expect_close(res_out, "add_rms_norm residual into another tensor" + what);
        expect_close(out2, "add_rms_norm out" + what);
        cpu->add_rms_norm(res.c, delta.c, res.c, w.c, 1e-6f, out2.c);
        gpu->add_rms_norm(res.g, delta.g, res.g, w.g, 1e-6f, out2.g);
        expect_close(res, "add_rms_norm residual in place" + what);
        expect_close(out2, "add_rms_norm out in place" + what);
        // A float32 stream adds without rounding.
        if (f32) {
          EXPECT_LE(test::rel_l2_error(gpu->to_host(res.g), cpu->to_host(res.c)), 1e-6) << what;
        }
      }
    }
  }
}

TEST_F(CudaOps, HeadNormRopeOnAStridedSlice) {
  for (int head_dim : {8, 24, 64, 128, 256}) {
    for (bool with_norm : {false, true}) {
      const int n_heads = 5, rows = 19;
      const int64_t width = int64_t{n_heads} * head_dim + 40;  // q lives inside a wider qkv row
      auto qkv = random(rows, width), nw = random(1, head_dim);
      std::vector<int32_t> pos(rows);
      for (auto& p : pos) p = static_cast<int32_t>(rng() % 40000);
      std::vector<float> inv_freq(head_dim / 2);
      for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(1e6f, -2.0f * i / head_dim);
      Tensor qc = qkv.c.slice_cols(8, int64_t{n_heads} * head_dim), qg = qkv.g.slice_cols(8, int64_t{n_heads} * head_dim);
      cpu->head_norm_rope(qc, n_heads, head_dim, with_norm ? &nw.c : nullptr, 1e-6f, pos, inv_freq);
      gpu->head_norm_rope(qg, n_heads, head_dim, with_norm ? &nw.g : nullptr, 1e-6f, pos, inv_freq);
      expect_close(qkv, "head_norm_rope head_dim=" + std::to_string(head_dim));
    }
  }
}

// The fused attention-input step: bit-identical to the three separate GPU ops
// (so fused and unfused paths cannot drift apart) and close to the CPU. No query heads: the
// draft's context projection (k and v only).
TEST_F(CudaOps, FusedQkvRopeAndCacheWriteEqualsTheSeparateOps) {
  for (int head_dim : {24, 64, 128, 256}) {
    for (int variant = 0; variant < 3; ++variant) {
      const bool with_norm = variant > 0;
      const int n_heads = variant == 2 ? 0 : 8, n_kv = 2, rows = 13, cache_rows = 40;
      const int64_t width = int64_t{n_heads + 2 * n_kv} * head_dim;
      auto qkv = random(rows, width), qn = random(1, head_dim), kn = random(1, head_dim);
      std::vector<int32_t> pos(rows), slots(rows);
      for (int r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(rng() % 40000), slots[r] = (7 * r + 3) % cache_rows;
      std::vector<float> inv_freq(head_dim / 2);
      for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = std::pow(1e6f, -2.0f * i / head_dim);
      auto kc = random(cache_rows, int64_t{n_kv} * head_dim), vc = random(cache_rows, int64_t{n_kv} * head_dim);
      Tensor qkv2 = gpu->upload_host(qkv.host.data(), rows, width);
      Tensor kc2 = gpu->upload_host(kc.host.data(), cache_rows, kc.c.cols);
      Tensor vc2 = gpu->upload_host(vc.host.data(), cache_rows, vc.c.cols);
      const Tensor* qn_g = with_norm ? &qn.g : nullptr;
      const Tensor* kn_g = with_norm ? &kn.g : nullptr;
      gpu->qkv_rope_kv_write(qkv.g, n_heads, n_kv, head_dim, qn_g, kn_g, 1e-6f, pos, inv_freq, kc.g, vc.g, slots);
      gpu->Backend::qkv_rope_kv_write(qkv2, n_heads, n_kv, head_dim, qn_g, kn_g, 1e-6f, pos, inv_freq, kc2, vc2, slots);
      cpu->qkv_rope_kv_write(qkv.c, n_heads, n_kv, head_dim, with_norm ? &qn.c : nullptr, with_norm ? &kn.c : nullptr,
                             1e-6f, pos, inv_freq, kc.c, vc.c, slots);
      const std::string what =
          "head_dim=" + std::to_string(head_dim) + (with_norm ? " normed" : "") + (n_heads ? "" : " no q heads");
      EXPECT_EQ(gpu->to_host(qkv.g), gpu->to_host(qkv2)) << what;
      EXPECT_EQ(gpu->to_host(kc.g), gpu->to_host(kc2)) << what;
      EXPECT_EQ(gpu->to_host(vc.g), gpu->to_host(vc2)) << what;
      expect_close(qkv, "qkv " + what);
      expect_close(kc, "k cache " + what);
      expect_close(vc, "v cache " + what);
    }
  }
}

TEST_F(CudaOps, SwiGlu) {
  for (int64_t n : {7, 1024, 12288}) {
    auto gu = random(9, 2 * n, 2.0f), out = poisoned(9, n);
    cpu->swiglu(gu.c, out.c);
    gpu->swiglu(gu.g, out.g);
    expect_close(out, "swiglu n=" + std::to_string(n));
  }
}

// The fused gate/up product + SwiGLU (skinny batches; gate and up stay float32) and the two
// steps (wider batches, and Backend's own form) against the CPU.
TEST_F(CudaOps, FusedMatmulSwigluMatchesTheSeparateOps) {
  const int64_t shapes[][2] = {{1000, 136}, {72, 4096}, {12288, 4096}, {3000, 64}};
  for (int64_t m : {1, 5, 12, 16, 33}) {
    for (const auto& s : shapes) {
      const int64_t n = s[0], k = s[1];
      if (n * k > 4096 * 4096 && m > 16) continue;  // keep the CPU reference quick
      for (bool with_bias : {false, true}) {
        auto x = random(m, k), w = random(2 * n, k, 0.05f), b = random(1, 2 * n), out = poisoned(m, n);
        const Tensor* bg = with_bias ? &b.g : nullptr;
        Tensor gu = gpu->alloc(m, 2 * n), gu2 = gpu->alloc(m, 2 * n), out2 = gpu->alloc(m, n);
        gpu->matmul_swiglu(x.g, w.g, bg, gu, out.g);
        gpu->Backend::matmul_swiglu(x.g, w.g, bg, gu2, out2);
        Tensor gu_c = cpu->alloc(m, 2 * n);
        cpu->matmul_swiglu(x.c, w.c, with_bias ? &b.c : nullptr, gu_c, out.c);
        const std::string what = testing::PrintToString(std::vector<int64_t>{m, n, k, with_bias});
        expect_close(out, what);
        EXPECT_LE(test::rel_l2_error(gpu->to_host(out2), cpu->to_host(out.c)), kBound) << what << " two steps";
        // Up to 32 tokens (the skinny kernel), a row alone equals the row in the batch.
        if (m > 32) continue;
        const std::vector<float> batched = gpu->to_host(out.g);
        Tensor one = gpu->alloc(1, n), gu1 = gpu->alloc(1, 2 * n);
        gpu->matmul_swiglu(x.g.slice_rows(m - 1, 1), w.g, bg, gu1, one);
        const std::vector<float> alone = gpu->to_host(one);
        EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batched.begin() + (m - 1) * n)) << what << " last row alone";
      }
    }
  }
}

// Products that normalize their own input rows (a few rows; more rows take the two steps). With a
// delta, the new residual rows also go to a capture (a column slice, as the layer outputs that the
// DFlash draft reads), rounded to bf16. The products normalize 4, 2 or 1 rows at once by width
// (up to 2048, 4096, 8192 values): the row counts fill and split those groups.
TEST_F(CudaOps, NormMatmulEqualsTheSeparateOps) {
  const int64_t shapes[][2] = {{1000, 136}, {6144, 4096}, {4096, 4096}, {768, 2048}, {256, 6144}};
  for (bool f32 : {false, true}) {
    for (int64_t m : {1, 2, 3, 5, 8, 9}) {
      for (const auto& s : shapes) {
        for (bool swiglu : {false, true}) {
          for (bool with_delta : {false, true}) {
            const int64_t n = s[0], k = s[1], w_rows = swiglu ? 2 * n : n;
            if (swiglu && n * k > 1000 * 4096 && m > 3) continue;  // keep the CPU reference quick
            auto res = f32 ? random_f32(m, k, 3.0f) : random(m, k, 3.0f), delta = random(m, k), norm_w = random(1, k);
            auto w = random(w_rows, k, 0.05f);
            auto b = random(1, w_rows), out = poisoned(m, n), res_out = f32 ? poisoned_f32(m, k) : poisoned(m, k);
            const std::string what = testing::PrintToString(std::vector<int64_t>{m, n, k, swiglu, with_delta, f32});
            Tensor captures = gpu->alloc(m, 2 * k), captures2 = gpu->alloc(m, 2 * k);
            Tensor cap = captures.slice_cols(k, k), cap2 = captures2.slice_cols(k, k);
            auto run = [&](Backend& be, Backend& as, const Tensor& r, const Tensor& d, Tensor& ro, const Tensor& nw,
                           const Tensor& wt, const Tensor& bias, Tensor& o, Tensor* c) {
              ResidualNorm rn{&r, with_delta ? &d : nullptr, with_delta ? &ro : nullptr, &nw, 1e-6f,
                              with_delta ? c : nullptr};
              Tensor h = be.alloc(m, k), gu = be.alloc(m, w_rows);
              if (&as == &be) be.norm_matmul(rn, h, wt, &bias, o, swiglu ? &gu : nullptr);
              else be.Backend::norm_matmul(rn, h, wt, &bias, o, swiglu ? &gu : nullptr);
            };
            run(*gpu, *gpu, res.g, delta.g, res_out.g, norm_w.g, w.g, b.g, out.g, &cap);
            Tensor out2 = gpu->alloc(m, n), res_out2 = f32 ? gpu->alloc_f32(m, k) : gpu->alloc(m, k);
            run(*gpu, *cpu, res.g, delta.g, res_out2, norm_w.g, w.g, b.g, out2, &cap2);  // the separate ops
            run(*cpu, *cpu, res.c, delta.c, res_out.c, norm_w.c, w.c, b.c, out.c, nullptr);
            EXPECT_EQ(gpu->to_host(out.g), gpu->to_host(out2)) << what;
            expect_close(out, what);
            if (with_delta) {
              EXPECT_EQ(gpu->to_host(res_out.g), gpu->to_host(res_out2)) << what;
              expect_close(res_out, what + " residual");
              Tensor gathered = gpu->alloc(m, k);
              gpu->capture_rows(res_out.g, gathered);
              EXPECT_EQ(gpu->to_host(cap), gpu->to_host(gathered)) << what << " capture";
              EXPECT_EQ(gpu->to_host(cap2), gpu->to_host(gathered)) << what << " capture, separate ops";
            }
            expect_close(res, what + " input untouched");
          }
        }
      }
    }
  }
}

// Gated DeltaNet at a Qwen3.5-27B head shape (128 x 128 state per value head, 3 value heads a key
// head), half the heads decaying slowly so that the state carries over many chunks. A 300-row
// prefill (the chunked form: 4 chunks of 64 and one of 44), a verification block left on the tape,
// a decode row that replays 5 of its rows, a chunked call that replays the tape: each against the
// CPU (float32, no bf16 roundings). The same rows decoded one call a row (the token-by-token form,
// same roundings) stay within tf32's error of the chunked outputs and state; a prefill split at a
// chunk boundary gives the chunked call's bits; a decode row beside a chunked segment gives its
// bits alone.
TEST_F(CudaOps, GatedDeltaNetChunkedPrefillTracksTheDecodeForm) {
  LinearAttentionParams p;
  p.n_k_heads = 4, p.n_v_heads = 12, p.k_dim = 128, p.v_dim = 128, p.conv_kernel = 4, p.eps = 1e-6f;
  const int64_t C = p.conv_dim(), W = p.tape_width(), value_dim = int64_t{p.n_v_heads} * p.v_dim;
  const int64_t proj_cols = C + value_dim + 2 * p.n_v_heads, state_cols = value_dim * p.k_dim;
  const int tape_rows = 16, slots = 4;
  auto conv = random(C, p.conv_kernel, 0.5f), a_log = random_f32(1, p.n_v_heads, 0.5f);
  auto dt_bias = random_f32(1, p.n_v_heads, 0.5f);
  std::vector<float> norm_host(static_cast<size_t>(p.v_dim));
  for (auto& w : norm_host) w = 1.0f + 0.3f * std::normal_distribution<float>()(rng);
  auto norm = pair_of(bf16_rounded(norm_host), 1, p.v_dim, false);
  auto cache_on = [&](Backend& be) {
    RecurrentCache c;
    c.n_slots = slots, c.tape_rows = tape_rows;
    c.conv = {be.alloc_f32(slots, (p.conv_kernel - 1) * C)};
    c.state = {be.alloc_f32(slots, state_cols)};
    c.tape = {be.alloc_f32(slots, tape_rows * W)};
    return c;
  };
  // Projections whose even value heads decay by about 1% a row (a near -6), the odd ones faster.
  auto rows_of = [&](int n) {
    auto host = bf16_rounded(test::random_vector(rng, static_cast<size_t>(n * proj_cols), 1.0f));
    for (int r = 0; r < n; ++r)
      for (int h = 0; h < p.n_v_heads; h += 2) {
        float& a = host[static_cast<size_t>(r * proj_cols + proj_cols - p.n_v_heads + h)];
        a = bf16_to_f32(f32_to_bf16(a - 6.0f));
      }
    return pair_of(host, n, proj_cols, false);
  };
  RecurrentCache cc = cache_on(*cpu), cg = cache_on(*gpu);
  const LinearAttentionWeights wc{conv.c, a_log.c, dt_bias.c, norm.c}, wg{conv.g, a_log.g, dt_bias.g, norm.g};
  // One call on both backends (slot 0), compared; returns the GPU's output.
  auto step = [&](const Pair& proj, const RecurrentSegment& seg, const std::string& what) {
    auto out = poisoned(proj.g.rows, value_dim);
    cpu->gated_delta_net(proj.c, wc, p, cc, 0, {seg}, out.c, nullptr);
    gpu->gated_delta_net(proj.g, wg, p, cg, 0, {seg}, out.g, nullptr);
    const double err = test::rel_l2_error(gpu->to_host(out.g), cpu->to_host(out.c));
    std::printf("gated delta net, %s: rel. L2 error %.2e vs the CPU\n", what.c_str(), err);
    EXPECT_LE(err, 2e-2) << what;
    return gpu->to_host(out.g);
  };
  auto state_of = [&](int slot) { return gpu->to_host(cg.state[0].slice_rows(slot, 1)); };
  const int n = 300;
  auto prompt = rows_of(n), block = rows_of(tape_rows), next = rows_of(1), more = rows_of(100);
  const auto prefilled = step(prompt, {0, n, 0, true, 0, true}, "300-row prefill (chunked)");
  const auto state_after_prefill = state_of(0);
  {
    const double err = test::rel_l2_error(state_after_prefill, cpu->to_host(cc.state[0].slice_rows(0, 1)));
    std::printf("gated delta net, state after the prefill: rel. L2 error %.2e vs the CPU\n", err);
    EXPECT_LE(err, 2e-2);
  }
  step(block, {0, tape_rows, 0, false, 0, false}, "verification block, not committed");
  step(next, {0, 1, 0, false, 5, true}, "decode row replaying 5 rows");
  step(block, {0, tape_rows, 0, false, 0, false}, "verification block again");
  step(more, {0, 100, 0, false, 7, true}, "100 rows replaying 7 (chunked)");
  // Slot 1: the prompt a row a call (token by token).
  std::vector<float> by_rows;
  for (int r = 0; r < n; ++r) {
    Tensor row = prompt.g.slice_rows(r, 1), out = gpu->alloc(1, value_dim);
    gpu->gated_delta_net(row, wg, p, cg, 0, {{0, 1, 1, r == 0, 0, true}}, out, nullptr);
    const auto o = gpu->to_host(out);
    by_rows.insert(by_rows.end(), o.begin(), o.end());
  }
  const double out_err = test::rel_l2_error(prefilled, by_rows), state_err = test::rel_l2_error(state_after_prefill, state_of(1));
  std::printf("gated delta net, chunked vs token by token: outputs %.2e, state %.2e (rel. L2)\n", out_err, state_err);
  EXPECT_LE(out_err, 5e-3);
  EXPECT_LE(state_err, 5e-3);
  // Slot 2: the prompt in two calls split at a chunk boundary (128 + 172 rows).
  Tensor head = gpu->alloc(128, value_dim), tail = gpu->alloc(n - 128, value_dim);
  gpu->gated_delta_net(prompt.g.slice_rows(0, 128), wg, p, cg, 0, {{0, 128, 2, true, 0, true}}, head, nullptr);
  gpu->gated_delta_net(prompt.g.slice_rows(128, n - 128), wg, p, cg, 0, {{0, n - 128, 2, false, 0, true}}, tail, nullptr);
  auto split = gpu->to_host(head);
  const auto tail_host = gpu->to_host(tail);
  split.insert(split.end(), tail_host.begin(), tail_host.end());
  EXPECT_EQ(split, prefilled) << "a prefill split at a chunk boundary differs from one call";
  EXPECT_EQ(state_of(2), state_after_prefill) << "states differ";
  // A decode row on slot 1 alone, then (from the same state, slot 3) beside a chunked segment on slot 2.
  for (Tensor* t : {&cg.state[0], &cg.conv[0]}) {
    Tensor dst = t->slice_rows(3, 1);
    gpu->copy_rows(t->slice_rows(1, 1), dst);
  }
  Tensor alone = gpu->alloc(1, value_dim);
  gpu->gated_delta_net(next.g, wg, p, cg, 0, {{0, 1, 1, false, 0, true}}, alone, nullptr);
  auto both_rows = rows_of(65);
  {
    std::vector<float> h = both_rows.host;
    std::copy(next.host.begin(), next.host.end(), h.begin() + 64 * proj_cols);
    both_rows = pair_of(h, 65, proj_cols, false);
  }
  Tensor both = gpu->alloc(65, value_dim);
  gpu->gated_delta_net(both_rows.g, wg, p, cg, 0, {{0, 64, 2, false, 0, true}, {64, 1, 3, false, 0, true}}, both,
                       nullptr);
  EXPECT_EQ(gpu->to_host(both.slice_rows(64, 1)), gpu->to_host(alone)) << "a decode row beside a chunked segment";
}

TEST_F(CudaOps, ArgmaxIsExactWithTiesToTheLowestIndex) {
  // Rows are split over several blocks: ties across blocks, a constant row, rows that are not
  // 16-byte aligned (a column slice) and repeated calls (the blocks' counters are reused).
  for (int64_t cols : {5, 4099, 8192, 151936}) {
    auto x = random(23, cols);
    std::vector<float> host = x.host;
    host[3 * cols + cols / 2] = host[3 * cols + cols / 3] = 100.0f;  // a tie in row 3
    for (int64_t c = 0; c < cols; ++c) host[5 * cols + c] = 0.25f;
    x.c = cpu->upload_host(host.data(), 23, cols);
    x.g = gpu->upload_host(host.data(), 23, cols);
    const auto expected = cpu->argmax_rows(x.c);
    EXPECT_EQ(expected[3], cols / 3);
    EXPECT_EQ(expected[5], 0);
    for (int rep = 0; rep < 2; ++rep) EXPECT_EQ(gpu->argmax_rows(x.g), expected) << "cols=" << cols;
    for (int64_t r : {1, 2, 4}) {  // fewer rows after more (a decode step after a verification)
      const auto part = gpu->argmax_rows(x.g.slice_rows(0, r));
      EXPECT_EQ(part, std::vector<int32_t>(expected.begin(), expected.begin() + r)) << "cols=" << cols;
    }
    if (cols > 3) {
      EXPECT_EQ(gpu->argmax_rows(x.g.slice_cols(3, cols - 3)), cpu->argmax_rows(x.c.slice_cols(3, cols - 3)))
          << "cols=" << cols << " from column 3";
    }
  }
}

// The argmax of rows split by columns (a vocabulary split over ranks): each part's candidates,
// chosen from side by side, give the argmax of the whole rows on either backend, with ties across
// the parts going to the lower id and rows without a value (-inf, NaN) to 0 as argmax_ids does.
TEST_F(CudaOps, ArgmaxCandidatesOfPartsGiveTheWholeRowsArgmax) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t cols : {6, 4098, 151936}) {
    const int64_t rows = 9;
    auto x = random(rows, cols);
    std::vector<float> host = x.host;
    const int64_t half = cols / 2;
    host[2 * cols + 1] = host[2 * cols + half + 1] = 100.0f;  // row 2: a tie across the parts
    host[3 * cols + half + 2] = 100.0f;                       // row 3: the second part's
    for (int64_t c = 0; c < cols; ++c) host[4 * cols + c] = 0.5f;   // row 4: constant
    for (int64_t c = 0; c < cols; ++c) host[5 * cols + c] = -inf;   // row 5: no value
    for (int64_t c = 0; c < half; ++c) host[6 * cols + c] = nan;    // row 6: the first part NaN
    host[6 * cols + half + 1] = 50.0f;
    for (Backend* be : {cpu.get(), gpu.get()}) {
      Tensor t = be->upload_host(host.data(), rows, cols);
      Tensor whole = be->alloc_ids(rows), ids = be->alloc_ids(rows);
      be->argmax_ids(t, whole);
      std::vector<float> side_by_side(static_cast<size_t>(rows * 4));  // row r: part 0's pair, part 1's
      for (int p = 0; p < 2; ++p) {
        Tensor cand = be->alloc_f32(rows, 2);
        be->argmax_candidates(t.slice_cols(p * half, half), p * half, cand);
        const std::vector<float> c = be->to_host(cand);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < 2; ++j) side_by_side[static_cast<size_t>(4 * r + 2 * p + j)] = c[static_cast<size_t>(2 * r + j)];
      }
      Tensor all = be->upload_host_f32(side_by_side.data(), rows, 4);
      be->argmax_of_candidates(all, ids);
      std::vector<int32_t> got = be->ids_to_host(ids), want = be->ids_to_host(whole);
      // The CPU's order among NaNs is std::max_element's (argmax_rows): its rows 0-5 are compared.
      const int64_t checked = be == cpu.get() ? 6 : rows;
      got.resize(checked);
      want.resize(checked);
      EXPECT_EQ(got, want) << be->name() << ", cols=" << cols;
      EXPECT_EQ(got[2], 1) << be->name();
      EXPECT_EQ(got[3], half + 2) << be->name();
      EXPECT_EQ(got[4], 0) << be->name();
      EXPECT_EQ(got[5], 0) << be->name();
      if (be == gpu.get()) {
        EXPECT_EQ(got[6], half + 1);
      }
    }
  }
}

// A step body that reassigns a tensor an eager step allocated releases that memory inside the
// capture; the free waits until the capture ends (a free inside it would break the graph).
TEST_F(CudaOps, ArgmaxIdsInAGraphWhoseBodyReleasesAnEagerTensor) {
  auto x = random(6, 4099);
  const std::vector<int32_t> expected = cpu->argmax_rows(x.c);
  Tensor ids = gpu->alloc_ids(6);
  gpu->argmax_ids(x.g, ids);
  EXPECT_EQ(gpu->ids_to_host(ids), expected);
  auto graph = gpu->capture_graph([&] {
    ids = gpu->alloc_ids(6);
    gpu->argmax_ids(x.g, ids);
  });
  for (int rep = 0; rep < 2; ++rep) {
    gpu->replay_graph(graph);
    EXPECT_EQ(gpu->ids_to_host(ids), expected);
  }
  Tensor after = gpu->alloc_ids(3);  // the stream still works eagerly
  gpu->argmax_ids(x.g.slice_rows(2, 3), after);
  EXPECT_EQ(gpu->ids_to_host(after), std::vector<int32_t>(expected.begin() + 2, expected.begin() + 5));
}

// A restaged graph replays its step with the new metadata, bit for bit as the step launched op by
// op (here the decode form of a normalizing product, which also gathers the new residual's rows).
// A body that launches differently from its capture, even without staging anything, does not
// match it.
TEST_F(CudaOps, RestagedGraphsReplayNewMetadataAndRefuseOtherLaunches) {
  const int64_t m = 2, k = 256, n = 512, vocab = 50;
  auto table = random(vocab, k), norm_w = random(1, k), w = random(n, k, 0.05f), res = random_f32(m, k, 3.0f);
  Tensor delta = gpu->alloc(m, k), res_out = gpu->alloc_f32(m, k), h = gpu->alloc(m, k), out = gpu->alloc(m, n);
  Tensor captured = gpu->alloc(m, k), act = gpu->alloc(m, n / 2);
  std::vector<int32_t> ids = {3, 7};
  bool with_swiglu = false;
  auto body = [&] {
    gpu->embed(table.g, ids, delta);
    const ResidualNorm rn{&res.g, &delta, &res_out, &norm_w.g, 1e-6f, &captured};
    gpu->norm_matmul(rn, h, w.g, nullptr, out);
    if (with_swiglu) gpu->swiglu(out, act);
  };
  auto graph = gpu->capture_graph(body);
  gpu->replay_graph(graph);
  for (const std::vector<int32_t>& next : {std::vector<int32_t>{11, 2}, std::vector<int32_t>{49, 0}}) {
    ids = next;
    body();  // op by op
    const std::vector<float> want_out = gpu->to_host(out), want_captured = gpu->to_host(captured);
    ASSERT_TRUE(gpu->restage_graph(graph, body));
    gpu->replay_graph(graph);
    EXPECT_EQ(gpu->to_host(out), want_out) << "ids " << ids[0] << ", " << ids[1];
    EXPECT_EQ(gpu->to_host(captured), want_captured) << "ids " << ids[0] << ", " << ids[1];
  }
  with_swiglu = true;  // one launch more, nothing more staged
  EXPECT_FALSE(gpu->restage_graph(graph, body));
}

TEST_F(CudaOps, TopCandidatesEqualTheHostSelection) {
  // Random rows, rows with many ties (values on a coarse grid, so that the k-th value is tied),
  // a constant row and a row with a NaN (both selected on the host), an unaligned column slice,
  // top_k on the device (1..256) and on the host (0, 257, >= cols), several temperatures.
  for (int64_t cols : {5, 1000, 4099, 151936}) {
    const int64_t n_rows = 8;
    auto x = random(n_rows, cols, 4.0f);
    std::vector<float> host = x.host;
    for (int64_t c = 0; c < cols; ++c) {
      host[1 * cols + c] = std::round(host[1 * cols + c] * 2) / 2;
      host[2 * cols + c] = std::round(host[2 * cols + c] * 16) / 16;
      host[3 * cols + c] = 0.25f;
    }
    host = bf16_rounded(host);
    host[4 * cols + cols / 2] = NAN;
    host[5 * cols] = -INFINITY;
    x.c = cpu->upload_host(host.data(), n_rows, cols);
    x.g = gpu->upload_host(host.data(), n_rows, cols);
    const std::vector<int32_t> rows = {0, 1, 2, 3, 4, 5, 6, 7, 2, 0};
    for (int k : {1, 20, 50, 256, 257, 0}) {
      for (float t : {1.0f, 0.6f, 1.3f}) {
        std::vector<float> temps(rows.size(), t);
        std::vector<int32_t> ks(rows.size(), k);
        ks[6] = static_cast<int32_t>(cols);  // every entry
        temps[7] = 0.7f;
        const auto want = cpu->top_candidates(x.c, rows, temps, ks);
        const auto got = gpu->top_candidates(x.g, rows, temps, ks);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < rows.size(); ++i) {
          EXPECT_EQ(got[i].ids, want[i].ids) << "cols " << cols << " k " << ks[i] << " T " << temps[i] << " row " << i;
          EXPECT_EQ(got[i].x, want[i].x) << "cols " << cols << " k " << ks[i] << " T " << temps[i] << " row " << i;
          if (ks[i] > 0 && ks[i] < cols && rows[i] != 4) {
            EXPECT_GE(static_cast<int64_t>(got[i].ids.size()), ks[i]);
          }
        }
      }
    }
    if (cols > 3) {
      const auto want = cpu->top_candidates(x.c.slice_cols(3, cols - 3), {0, 2}, {0.8f, 0.8f}, {20, 20});
      const auto got = gpu->top_candidates(x.g.slice_cols(3, cols - 3), {0, 2}, {0.8f, 0.8f}, {20, 20});
      for (size_t i = 0; i < 2; ++i) {
        EXPECT_EQ(got[i].ids, want[i].ids) << "cols " << cols << " from column 3";
        EXPECT_EQ(got[i].x, want[i].x) << "cols " << cols << " from column 3";
      }
    }
  }
}

// Attention fixture: a paged cache with shuffled pages, filled through kv_write.
struct AttnCase {
  int n_heads, n_kv_heads, head_dim, page_size, window;
};

void PrintTo(const AttnCase& c, std::ostream* os) {
  *os << c.n_heads << "/" << c.n_kv_heads << " heads of " << c.head_dim << ", page " << c.page_size << ", window " << c.window;
}

class CudaAttention : public CudaOps, public ::testing::WithParamInterface<AttnCase> {
 protected:
  struct Seq {
    int n_past, n_new;
    bool causal;
  };
  void check_fused_qkv_attention(const std::vector<Seq>& seqs);
};

TEST_P(CudaAttention, DecodeVerifyDraftAndPrefillSegmentsTogether) {
  const AttnCase ac = GetParam();
  const int kv_dim = ac.n_kv_heads * ac.head_dim, q_dim = ac.n_heads * ac.head_dim;
  // Five sequences with disjoint page tables: (cached keys, new rows, causal).
  struct Seq { int n_past, n_new; bool causal; };
  const Seq seqs[] = {{700, 1, true}, {333, 16, true}, {129, 16, false}, {0, 200, true}, {63, 1, true}};
  int n_pages = 9;  // a few pages nobody uses
  for (const auto& s : seqs) n_pages += (s.n_past + s.n_new + ac.page_size - 1) / ac.page_size;
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables;
  int next = 0;
  for (const auto& s : seqs) {
    const int n = (s.n_past + s.n_new + ac.page_size - 1) / ac.page_size;
    tables.emplace_back(perm.begin() + next, perm.begin() + next + n);
    next += n;
  }
  ASSERT_LE(next, n_pages);
  KvCache cc = cpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  KvCache cg = gpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  std::vector<AttentionSegment> segs;
  std::vector<int32_t> positions;
  int rows = 0;
  for (size_t i = 0; i < std::size(seqs); ++i) {
    const auto& s = seqs[i];
    const int n_keys = s.n_past + s.n_new;
    std::vector<int32_t> slots;
    for (int p = 0; p < n_keys; ++p) slots.push_back(tables[i][p / ac.page_size] * ac.page_size + p % ac.page_size);
    auto k = random(n_keys, kv_dim), v = random(n_keys, kv_dim);
    cpu->kv_write(k.c, v.c, cc.k[0], cc.v[0], slots);
    gpu->kv_write(k.g, v.g, cg.k[0], cg.v[0], slots);
    segs.push_back({rows, s.n_new, n_keys, tables[i].data(), s.causal});
    for (int r = 0; r < s.n_new; ++r) positions.push_back(s.n_past + r);
    rows += s.n_new;
  }
  auto q = random(rows, q_dim, 2.0f), out = poisoned(rows, q_dim);
  const AttentionParams ap{ac.n_heads, ac.n_kv_heads, ac.head_dim, ac.window, ac.page_size};
  cpu->attention(q.c, cc.k[0], cc.v[0], segs, positions, ap, out.c);
  using Splits = cuda::KernelForms::Splits;
  cuda::KernelForms forced;
  forced.attention_splits = Splits::parallel;  // splits in parallel, then the combine kernel
  cuda::force_kernel_forms(*gpu, forced);
  gpu->attention(q.g, cg.k[0], cg.v[0], segs, positions, ap, out.g);
  expect_close(out, "attention");

  // The form that runs a tile's splits in one block and combines them itself (large batches)
  // gives the same bits.
  auto looped = poisoned(rows, q_dim);
  forced.attention_splits = Splits::loop;
  cuda::force_kernel_forms(*gpu, forced);
  gpu->attention(q.g, cg.k[0], cg.v[0], segs, positions, ap, looped.g);
  EXPECT_EQ(gpu->to_host(looped.g), gpu->to_host(out.g)) << "splits combined in the attention block";

  // So does the form whose blocks share each split's keys among a sequence's tiles (verification
  // and draft blocks; the single rows take it too when forced), and the rule's choice.
  auto shared = poisoned(rows, q_dim);
  forced.attention_splits = Splits::shared_keys;
  cuda::force_kernel_forms(*gpu, forced);
  gpu->attention(q.g, cg.k[0], cg.v[0], segs, positions, ap, shared.g);
  cuda::force_kernel_forms(*gpu, {});
  EXPECT_EQ(gpu->to_host(shared.g), gpu->to_host(out.g)) << "splits' keys shared by a sequence's tiles";
  auto by_rule = poisoned(rows, q_dim);
  gpu->attention(q.g, cg.k[0], cg.v[0], segs, positions, ap, by_rule.g);
  EXPECT_EQ(gpu->to_host(by_rule.g), gpu->to_host(out.g)) << "the forms' rule";

  // A verification row equals the same query decoded alone at its position.
  const int r = segs[1].first_row + 7;
  const int n_keys = positions[r] + 1;
  std::vector<AttentionSegment> alone{{0, 1, n_keys, tables[1].data(), true}};
  Tensor one = gpu->alloc(1, q_dim);
  gpu->attention(q.g.slice_rows(r, 1), cg.k[0], cg.v[0], alone, {positions[r]}, ap, one);
  const auto a = gpu->to_host(one), b = gpu->to_host(out.g);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin() + int64_t{r} * q_dim)) << "verify row differs from decode";
}

// The shared-keys form on grids larger than the GPU's SMs, whose blocks take a warp per tile of
// the longest run (4 warps for 16-row blocks of a 4-head group, 2 for 8-row blocks) and share SMs:
// the same bits as the split form, sequence by sequence.
TEST_F(CudaOps, SharedKeysAttentionOnLargeGridsEqualsTheSplitForm) {
  const int n_heads = 32, n_kv = 8, hd = 128, page = 16, n_seqs = 40;  // 40 x 8 KV heads: 320 blocks
  const int kv_dim = n_kv * hd, q_dim = n_heads * hd;
  const AttentionParams ap{n_heads, n_kv, hd, 0, page};
  std::uniform_int_distribution<int> past(40, 700);
  for (int block_rows : {16, 8}) {
    std::vector<int> n_past(n_seqs);
    int n_pages = 0;
    for (int& p : n_past) p = past(rng), n_pages += (p + block_rows + page - 1) / page;
    std::vector<int32_t> perm(n_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    KvCache c = gpu->alloc_kv(1, n_pages, page, n_kv, hd);
    std::vector<std::vector<int32_t>> tables;
    std::vector<AttentionSegment> segs;
    std::vector<int32_t> positions;
    int next = 0, rows = 0;
    for (int i = 0; i < n_seqs; ++i) {
      const int n_keys = n_past[i] + block_rows, n_table = (n_keys + page - 1) / page;
      tables.emplace_back(perm.begin() + next, perm.begin() + next + n_table);
      next += n_table;
    }
    for (int i = 0; i < n_seqs; ++i) {
      const int n_keys = n_past[i] + block_rows;
      std::vector<int32_t> slots;
      for (int p = 0; p < n_keys; ++p) slots.push_back(tables[i][p / page] * page + p % page);
      const auto kh = bf16_rounded(test::random_vector(rng, static_cast<size_t>(n_keys) * kv_dim, 1.0f));
      const auto vh = bf16_rounded(test::random_vector(rng, static_cast<size_t>(n_keys) * kv_dim, 1.0f));
      Tensor k = gpu->upload_host(kh.data(), n_keys, kv_dim), v = gpu->upload_host(vh.data(), n_keys, kv_dim);
      gpu->kv_write(k, v, c.k[0], c.v[0], slots);
      segs.push_back({rows, block_rows, n_keys, tables[i].data(), i % 3 != 2});  // every third not causal
      for (int r = 0; r < block_rows; ++r) positions.push_back(n_past[i] + r);
      rows += block_rows;
    }
    const auto qh = bf16_rounded(test::random_vector(rng, static_cast<size_t>(rows) * q_dim, 2.0f));
    Tensor q = gpu->upload_host(qh.data(), rows, q_dim);
    using Splits = cuda::KernelForms::Splits;
    auto attend = [&](Splits form) {
      cuda::KernelForms forced;
      forced.attention_splits = form;
      cuda::force_kernel_forms(*gpu, forced);
      const std::vector<float> nan(static_cast<size_t>(rows) * q_dim, NAN);
      Tensor out = gpu->upload_host(nan.data(), rows, q_dim);
      gpu->attention(q, c.k[0], c.v[0], segs, positions, ap, out);
      cuda::force_kernel_forms(*gpu, {});
      return gpu->to_host(out);
    };
    const auto split = attend(Splits::parallel), shared = attend(Splits::shared_keys);
    ASSERT_FALSE(std::any_of(split.begin(), split.end(), [](float x) { return std::isnan(x); }));
    EXPECT_EQ(shared, split) << block_rows << "-row blocks";
  }
}

// Segments of many rows (prefill chunks: from the start, after cached keys, at 8k+ keys, not
// causal) take the prefill form where the shape has it, rows with kAttnLongKeys+ keys the long
// form (a verification block across that count, a decode row, a draft block), the other rows the
// decode kernel, all in one call: every row against the CPU, on the usual backend and on a
// batch-invariant one (no prefill form there: those rows take the decode or the long form). A
// long verification row equals the same row decoded alone, bit for bit.
TEST_P(CudaAttention, LongSegmentsAndLongRowsBesideDecodeRows) {
  const AttnCase ac = GetParam();
  const int kv_dim = ac.n_kv_heads * ac.head_dim, q_dim = ac.n_heads * ac.head_dim;
  const Seq seqs[] = {{0, 300, true},   {250, 200, true},   {600, 1, true},     {8200, 70, true}, {129, 16, false},
                      {40, 65, false},  {8185, 16, true},   {9000, 1, true},    {8500, 16, false}};
  int n_pages = 3;
  for (const auto& s : seqs) n_pages += (s.n_past + s.n_new + ac.page_size - 1) / ac.page_size;
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::vector<int32_t>> tables, slots;
  std::vector<std::vector<float>> ks, vs;
  std::vector<AttentionSegment> segs;
  std::vector<int32_t> positions;
  int next = 0, rows = 0;
  for (const auto& s : seqs) {
    const int n_keys = s.n_past + s.n_new, n_table = (n_keys + ac.page_size - 1) / ac.page_size;
    tables.emplace_back(perm.begin() + next, perm.begin() + next + n_table);
    next += n_table;
    slots.emplace_back();
    for (int p = 0; p < n_keys; ++p) slots.back().push_back(tables.back()[p / ac.page_size] * ac.page_size + p % ac.page_size);
    ks.push_back(bf16_rounded(test::random_vector(rng, static_cast<size_t>(n_keys) * kv_dim, 1.0f)));
    vs.push_back(bf16_rounded(test::random_vector(rng, static_cast<size_t>(n_keys) * kv_dim, 1.0f)));
    segs.push_back({rows, s.n_new, n_keys, tables.back().data(), s.causal});
    for (int r = 0; r < s.n_new; ++r) positions.push_back(s.n_past + r);
    rows += s.n_new;
  }
  const auto qh = bf16_rounded(test::random_vector(rng, static_cast<size_t>(rows) * q_dim, 2.0f));
  const AttentionParams ap{ac.n_heads, ac.n_kv_heads, ac.head_dim, ac.window, ac.page_size};
  // The cache on `be`; then its attention of `sg` for query rows [first, first + n).
  auto fill = [&](Backend& be) {
    KvCache c = be.alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
    for (size_t i = 0; i < segs.size(); ++i) {
      const int n_keys = segs[i].n_keys;
      Tensor k = be.upload_host(ks[i].data(), n_keys, kv_dim), v = be.upload_host(vs[i].data(), n_keys, kv_dim);
      be.kv_write(k, v, c.k[0], c.v[0], slots[i]);
    }
    return c;
  };
  auto attend = [&](Backend& be, KvCache& c, const std::vector<AttentionSegment>& sg, const std::vector<int32_t>& pos,
                    int first, int n) {
    Tensor q = be.upload_host(qh.data() + int64_t{first} * q_dim, n, q_dim), out = be.alloc(n, q_dim);
    be.attention(q, c.k[0], c.v[0], sg, pos, ap, out);
    return be.to_host(out);
  };
  KvCache cc = fill(*cpu);
  const auto want = attend(*cpu, cc, segs, positions, 0, rows);
  BackendOptions invariant;
  invariant.batch_invariant = true;
  auto gpu_invariant = make_cuda_backend(invariant);
  for (Backend* be : {gpu.get(), gpu_invariant.get()}) {
    const std::string what = be == gpu.get() ? "usual backend" : "batch-invariant backend";
    KvCache c = fill(*be);
    const auto got = attend(*be, c, segs, positions, 0, rows);
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> g(got.begin() + int64_t{r} * q_dim, got.begin() + int64_t{r + 1} * q_dim);
      const std::vector<float> w(want.begin() + int64_t{r} * q_dim, want.begin() + int64_t{r + 1} * q_dim);
      ASSERT_LE(test::rel_l2_error(g, w), kBound) << what << ", row " << r << " (position " << positions[r] << ")";
    }
    // Rows of the verification block across kAttnLongKeys keys, each alone at its position.
    for (int i = 0; i < 16; ++i) {
      const int r = segs[6].first_row + i, n_keys = positions[r] + 1;
      std::vector<AttentionSegment> alone{{0, 1, n_keys, tables[6].data(), true}};
      const auto one = attend(*be, c, alone, {positions[r]}, r, 1);
      EXPECT_TRUE(std::equal(one.begin(), one.end(), got.begin() + int64_t{r} * q_dim))
          << what << ": verification row at position " << positions[r] << " differs from the row decoded alone";
    }
  }
}

// The layer's attention straight from its q/k/v product (fused on the GPU where the shape
// allows: queries and new keys normalized and rotated inside the attention, which also writes
// the new keys and values to the cache) equals the separate steps bit for bit, and the CPU.
TEST_P(CudaAttention, FusedQkvAttentionEqualsTheSeparateSteps) {
  // Batches small enough for the fused form (one wave of blocks): decode rows (one at a split
  // boundary), a verification block, a draft block; then prefill chunks, one continuing a sequence.
  check_fused_qkv_attention({{250, 1, true}, {150, 16, true}, {100, 16, false}, {64, 1, true}});
  check_fused_qkv_attention({{0, 48, true}, {20, 30, true}});
  // Larger ones take the separate steps.
  check_fused_qkv_attention({{700, 1, true}, {333, 16, true}, {129, 16, false}, {0, 200, true}, {63, 1, true}});
}

void CudaAttention::check_fused_qkv_attention(const std::vector<Seq>& seqs) {
  const AttnCase ac = GetParam();
  const int kv_dim = ac.n_kv_heads * ac.head_dim, q_dim = ac.n_heads * ac.head_dim, width = q_dim + 2 * kv_dim;
  int n_pages = 5;
  for (const auto& s : seqs) n_pages += (s.n_past + s.n_new + ac.page_size - 1) / ac.page_size;
  std::vector<int32_t> perm(n_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  KvCache cc = cpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  KvCache fused = gpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  KvCache steps = gpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  KvCache per_head_kv = gpu->alloc_kv(1, n_pages, ac.page_size, ac.n_kv_heads, ac.head_dim);
  std::vector<std::vector<int32_t>> tables;
  std::vector<AttentionSegment> segs;
  std::vector<int32_t> positions, slots;
  int next = 0, rows = 0;
  for (const auto& s : seqs) {
    const int n_keys = s.n_past + s.n_new, n_table = (n_keys + ac.page_size - 1) / ac.page_size;
    tables.emplace_back(perm.begin() + next, perm.begin() + next + n_table);
    next += n_table;
    const auto& t = tables.back();
    auto slot_of = [&](int p) { return t[p / ac.page_size] * ac.page_size + p % ac.page_size; };
    std::vector<int32_t> past;
    for (int p = 0; p < s.n_past; ++p) past.push_back(slot_of(p));
    if (!past.empty()) {
      auto k = random(s.n_past, kv_dim), v = random(s.n_past, kv_dim);
      cpu->kv_write(k.c, v.c, cc.k[0], cc.v[0], past);
      gpu->kv_write(k.g, v.g, fused.k[0], fused.v[0], past);
      gpu->kv_write(k.g, v.g, steps.k[0], steps.v[0], past);
      gpu->kv_write(k.g, v.g, per_head_kv.k[0], per_head_kv.v[0], past);
    }
    segs.push_back({rows, s.n_new, n_keys, t.data(), s.causal});
    for (int r = 0; r < s.n_new; ++r) positions.push_back(s.n_past + r), slots.push_back(slot_of(s.n_past + r));
    rows += s.n_new;
  }
  std::vector<float> inv_freq(ac.head_dim / 2);
  for (int i = 0; i < ac.head_dim / 2; ++i) inv_freq[i] = std::pow(1e6f, -2.0f * i / ac.head_dim);
  const AttentionParams ap{ac.n_heads, ac.n_kv_heads, ac.head_dim, ac.window, ac.page_size};
  for (bool with_norm : {false, true}) {
    auto qkv = random(rows, width, 2.0f), qn = random(1, ac.head_dim), kn = random(1, ac.head_dim);
    Tensor qkv2 = gpu->upload_host(qkv.host.data(), rows, width);
    auto out = poisoned(rows, q_dim);
    Tensor out2 = gpu->alloc(rows, q_dim);
    const Tensor* qn_g = with_norm ? &qn.g : nullptr;
    const Tensor* kn_g = with_norm ? &kn.g : nullptr;
    gpu->qkv_attention(qkv.g, qn_g, kn_g, 1e-6f, inv_freq, slots, fused.k[0], fused.v[0], segs, positions, ap, out.g);
    gpu->Backend::qkv_attention(qkv2, qn_g, kn_g, 1e-6f, inv_freq, slots, steps.k[0], steps.v[0], segs, positions,
                                ap, out2);
    cpu->qkv_attention(qkv.c, with_norm ? &qn.c : nullptr, with_norm ? &kn.c : nullptr, 1e-6f, inv_freq, slots,
                       cc.k[0], cc.v[0], segs, positions, ap, out.c);
    const std::string what = with_norm ? "q/k normed" : "no q/k norm";
    EXPECT_EQ(gpu->to_host(out.g), gpu->to_host(out2)) << what;
    // The split combine with a warp per head instead of a warp per 32 dims: the same bits.
    Tensor qkv3 = gpu->upload_host(qkv.host.data(), rows, width);
    auto per_head = poisoned(rows, q_dim);
    cuda::KernelForms forced;
    forced.combine = cuda::KernelForms::Combine::per_head;
    cuda::force_kernel_forms(*gpu, forced);
    gpu->qkv_attention(qkv3, qn_g, kn_g, 1e-6f, inv_freq, slots, per_head_kv.k[0], per_head_kv.v[0], segs, positions,
                       ap, per_head.g);
    cuda::force_kernel_forms(*gpu, {});
    EXPECT_EQ(gpu->to_host(per_head.g), gpu->to_host(out.g)) << what << ", a warp per head";
    EXPECT_EQ(gpu->to_host(fused.k[0]), gpu->to_host(steps.k[0])) << what;
    EXPECT_EQ(gpu->to_host(fused.v[0]), gpu->to_host(steps.v[0])) << what;
    expect_close(out, "attention output, " + what);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention,
                         ::testing::Values(AttnCase{32, 8, 128, 16, 0}, AttnCase{6, 2, 64, 16, 0},
                                           AttnCase{4, 4, 24, 7, 0}, AttnCase{8, 1, 256, 32, 0},
                                           AttnCase{24, 4, 256, 16, 0},
                                           AttnCase{16, 4, 128, 16, 100}, AttnCase{12, 4, 96, 16, 0},
                                           AttnCase{32, 1, 64, 8, 0}),
                         [](const auto& info) {
                           const AttnCase& c = info.param;
                           return "h" + std::to_string(c.n_heads) + "_kv" + std::to_string(c.n_kv_heads) + "_d" +
                                  std::to_string(c.head_dim) + "_page" + std::to_string(c.page_size) + "_window" +
                                  std::to_string(c.window);
                         });

// The routed MLP against a float64 reference with the GPU's rounding points (router logits, the
// SwiGLU activation and each expert's output rounded to bf16, weights and sum in high precision),
// and against the CPU backend (float32, nothing rounded: bf16 logits of magnitude 4 move each
// expert's weight by up to 1.6%, and a row by up to about 5% measured; a bound against gross
// errors), per token where the router's k-th and (k+1)-th logits
// are far enough apart that both choose the same experts; rows bit-identical alone, in a 3-row
// batch and in the whole batch on a batch-invariant backend; a graph replay gives the direct call's
// bits. Wide steps (the last two) take the tile products.
TEST_F(CudaOps, MoeMatchesCpuAndRowsAreBatchInvariant) {
  struct Case {
    int m, h, n_experts, top_k, ff;
    bool norm;
  };
  auto bf = [](double v) { return static_cast<double>(bf16_to_f32(f32_to_bf16(static_cast<float>(v)))); };
  // Weights drawn once a shape: the 30B-A3B shape's (128 experts of 2048 x 768) took most of the
  // test's time when each of its three cases drew its own.
  std::map<std::tuple<int, int, int>, MoePairs> drawn;
  for (const Case c : {Case{1, 64, 8, 2, 48, true}, Case{13, 48, 6, 3, 40, false}, Case{40, 64, 8, 2, 48, true},
                       Case{1, 2048, 128, 8, 768, true}, Case{16, 2048, 128, 8, 768, true},
                       Case{130, 2048, 128, 8, 768, false}, Case{300, 264, 16, 4, 200, true},
                       Case{520, 512, 32, 4, 256, false}, Case{600, 128, 4, 2, 64, true}}) {
    // 32 or more pairs an expert on average: the tile products (moe_gemm.cu), unless batch-invariant.
    const bool wide = c.m * c.top_k >= 32 * c.n_experts;
    const std::string what = std::to_string(c.m) + " rows, top " + std::to_string(c.top_k) + " of " +
                             std::to_string(c.n_experts) + ", h " + std::to_string(c.h);
    auto shape = drawn.find({c.h, c.n_experts, c.ff});
    if (shape == drawn.end())
      shape = drawn.emplace(std::tuple{c.h, c.n_experts, c.ff}, random_moe(c.h, c.n_experts, c.top_k, c.ff, c.norm)).first;
    MoePairs& moe = shape->second;
    moe.shape.top_k = c.top_k;
    moe.shape.norm_topk_prob = c.norm;
    const Pair &router = moe.router, &gate_up = moe.gate_up, &down = moe.down;
    // bf16 router logits of a row (what the GPU routes by), in float64 from the bf16 inputs.
    // The row's router logits rounded to bf16, and whether one of them lies within 1% of a bf16
    // step of a rounding midpoint (the GPU's float32 sum may then round it the other way: one
    // step moves a softmax weight by up to 12% at |logit| ~ 16).
    std::vector<bool> ambiguous;
    auto row_logits = [&](const float* xr) {
      std::vector<double> logit(c.n_experts);
      ambiguous.assign(c.n_experts, false);
      for (int e = 0; e < c.n_experts; ++e) {
        double d = 0;
        for (int k = 0; k < c.h; ++k) d += double{xr[k]} * router.host[static_cast<size_t>(e) * c.h + k];
        logit[e] = bf(d);
        const double step = std::ldexp(1.0, std::ilogb(std::max(std::abs(d), 1e-30)) - 7);
        ambiguous[e] = std::abs(std::abs(d - logit[e]) - step / 2) < 0.01 * step;
      }
      return logit;
    };
    // Whether the row's k-th and (k+1)-th logits are at least 0.05 apart and none of the top k + 1
    // rounds ambiguously (row_logits just ran on the row): then float32 and bf16 logits choose the
    // same experts with the same weights.
    auto clear_routing = [&](const std::vector<double>& logit) {
      std::vector<int> order(c.n_experts);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return logit[a] > logit[b]; });
      for (int j = 0; j < std::min(c.top_k + 1, c.n_experts); ++j)
        if (ambiguous[order[j]]) return false;
      if (c.top_k == c.n_experts) return true;
      return logit[order[c.top_k - 1]] - logit[order[c.top_k]] >= 0.05;
    };
    // Inputs with at least half the rows clearly routed (a single row: that one).
    Pair x;
    for (int attempt = 0;; ++attempt) {
      x = random(c.m, c.h);
      int clear = 0;
      for (int r = 0; r < c.m; ++r) clear += clear_routing(row_logits(&x.host[static_cast<size_t>(r) * c.h]));
      if (clear >= (c.m + 1) / 2) break;
      ASSERT_LT(attempt, 20) << what << ": no inputs with clear routing";
    }
    const MoeWeights wg = moe.on(true), wc = moe.on(false);
    auto out = poisoned(c.m, c.h);
    Tensor counts_g = gpu->alloc_ids(c.n_experts), counts_c = cpu->alloc_ids(c.n_experts);
    const long long tiles_before = cuda::routed_tile_products(*gpu);
    gpu->moe(x.g, wg, out.g, &counts_g);
    cpu->moe(x.c, wc, out.c, &counts_c);
    // Where the rule takes the warpgroup tile products (Hopper), the mma.sync tile form too: the
    // rule's side on other GPUs, checked against the same reference.
    const bool both_tiles = wide && cuda::warpgroup_tile_products(*gpu);
    cuda::KernelForms mma_sync;
    mma_sync.tile_mma = cuda::KernelForms::TileMma::mma_sync;
    std::vector<float> mh;
    Tensor out_mma;
    if (both_tiles) {
      cuda::force_kernel_forms(*gpu, mma_sync);
      out_mma = gpu->alloc(c.m, c.h);
      gpu->moe(x.g, wg, out_mma);
      cuda::force_kernel_forms(*gpu, {});
      mh = gpu->to_host(out_mma);
    }

    const auto gh = gpu->to_host(out.g), ch = cpu->to_host(out.c);
    const std::vector<float>&xh = x.host, &guh = gate_up.host, &dh = down.host;
    int safe = 0;
    bool all_safe = true;
    for (int r = 0; r < c.m; ++r) {
      const float* xr = &xh[static_cast<size_t>(r) * c.h];
      const std::vector<double> logit = row_logits(xr);
      if (!clear_routing(logit)) {
        all_safe = false;
        continue;
      }
      ++safe;
      std::vector<int> order(c.n_experts);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return logit[a] > logit[b] || (logit[a] == logit[b] && a < b); });
      const double mx = logit[order[0]];
      double sum = 0, top_sum = 0;
      for (double l : logit) sum += std::exp(l - mx);
      for (int j = 0; j < c.top_k; ++j) top_sum += std::exp(logit[order[j]] - mx) / sum;
      std::vector<double> ref(c.h, 0.0);
      std::vector<int> chosen(order.begin(), order.begin() + c.top_k);
      std::sort(chosen.begin(), chosen.end());
      for (int e : chosen) {
        const double p = std::exp(logit[e] - mx) / sum, weight = c.norm ? p / top_sum : p;
        std::vector<double> act(c.ff);
        for (int f = 0; f < c.ff; ++f) {
          double g = 0, u = 0;
          const size_t g0 = (static_cast<size_t>(e) * 2 * c.ff + f) * c.h, u0 = g0 + static_cast<size_t>(c.ff) * c.h;
          for (int k = 0; k < c.h; ++k) g += double{xr[k]} * guh[g0 + k], u += double{xr[k]} * guh[u0 + k];
          act[f] = bf(g / (1 + std::exp(-g)) * u);
        }
        for (int j = 0; j < c.h; ++j) {
          double y = 0;
          for (int f = 0; f < c.ff; ++f) y += act[f] * dh[(static_cast<size_t>(e) * c.h + j) * c.ff + f];
          ref[j] += weight * bf(y);
        }
      }
      const std::vector<float> g(gh.begin() + int64_t{r} * c.h, gh.begin() + int64_t{r + 1} * c.h);
      const std::vector<float> cc(ch.begin() + int64_t{r} * c.h, ch.begin() + int64_t{r + 1} * c.h);
      // Rounding points: the output's bf16 rounding alone is about 6e-4 (relative L2); an activation
      // or expert output that float32 sums round the other way from float64 moves its terms by 2^-8.
      // A row of 520 at h 512 reached 3.1e-3 (H200, one of many random draws), a row of 600 at h
      // 128, top 2 of 4, 4.3e-3 (H100): with few terms a row, a few such flips weigh more. A wrong
      // expert or weight moves a row by far more (order 1).
      EXPECT_LE(test::rel_l2_error(g, std::vector<float>(ref.begin(), ref.end())), 6e-3) << what << ", row " << r;
      if (both_tiles) {
        const std::vector<float> m(mh.begin() + int64_t{r} * c.h, mh.begin() + int64_t{r + 1} * c.h);
        EXPECT_LE(test::rel_l2_error(m, std::vector<float>(ref.begin(), ref.end())), 6e-3)
            << what << ", row " << r << " (mma.sync tile products)";
      }
      EXPECT_LE(test::rel_l2_error(g, cc), 1e-1) << what << ", row " << r << " against the CPU backend";
    }
    EXPECT_GE(safe, (c.m + 1) / 2) << what << ": too few rows with a clear routing to compare";
    if (all_safe) {
      EXPECT_EQ(gpu->ids_to_host(counts_g), cpu->ids_to_host(counts_c)) << what;
    }
    const auto counts = gpu->ids_to_host(counts_g);
    EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), 0), c.m * c.top_k) << what;

    // Batch invariance: the first, middle and last rows alone and in a 3-row batch, on a
    // batch-invariant backend (elsewhere the router product of more than 32 rows goes through
    // cuBLASLt, whose bits differ from the skinny kernel's, and a bf16 logit may round the other way).
    BackendOptions invariant;
    invariant.batch_invariant = true;
    auto inv = make_cuda_backend(invariant);
    MoeWeights wi = wg;
    wi.router = inv->upload_host(router.host.data(), router.g.rows, router.g.cols);
    wi.gate_up = inv->upload_host(gate_up.host.data(), gate_up.g.rows, gate_up.g.cols);
    wi.down = inv->upload_host(down.host.data(), down.g.rows, down.g.cols);
    Tensor xi = inv->upload_host(x.host.data(), c.m, c.h), whole = inv->alloc(c.m, c.h);
    inv->moe(xi, wi, whole);
    EXPECT_EQ(cuda::routed_tile_products(*inv), 0) << what << ": tile products on a batch-invariant backend";
    EXPECT_EQ(cuda::routed_tile_products(*gpu) - tiles_before, wide ? (both_tiles ? 2 : 1) : 0)
        << what << ": whether the tile products ran";
    if (wide) {
      // The skinny kernel's routed form on the same logits: close (the tile products sum in another
      // k order, so some bits usually differ; on small shapes all may agree by chance).
      cuda::KernelForms skinny;
      skinny.routed_tiles = cuda::KernelForms::RoutedTiles::never;
      cuda::force_kernel_forms(*gpu, skinny);
      Tensor narrow = gpu->alloc(c.m, c.h);
      gpu->moe(x.g, wg, narrow);
      cuda::force_kernel_forms(*gpu, {});
      const auto nh = gpu->to_host(narrow);
      EXPECT_LE(test::rel_l2_error(gh, nh), 1e-2) << what << ": tile products against the skinny form";
      // A row keeps its bits when every other row changes (and with them the experts' items).
      const int keep = c.m / 2;
      auto other = random(c.m, c.h);
      std::copy(x.host.begin() + int64_t{keep} * c.h, x.host.begin() + int64_t{keep + 1} * c.h,
                other.host.begin() + int64_t{keep} * c.h);
      Tensor other_g = gpu->upload_host(other.host.data(), c.m, c.h), other_out = gpu->alloc(c.m, c.h);
      gpu->moe(other_g, wg, other_out);
      EXPECT_EQ(gpu->to_host(other_out.slice_rows(keep, 1)), gpu->to_host(out.g.slice_rows(keep, 1)))
          << what << ": row " << keep << " among other rows";
      if (both_tiles) {
        cuda::force_kernel_forms(*gpu, mma_sync);
        gpu->moe(other_g, wg, other_out);
        cuda::force_kernel_forms(*gpu, {});
        EXPECT_EQ(gpu->to_host(other_out.slice_rows(keep, 1)), gpu->to_host(out_mma.slice_rows(keep, 1)))
            << what << ": row " << keep << " among other rows (mma.sync tile products)";
      }
    }
    for (int r : {0, c.m / 2, c.m - 1}) {
      Tensor one = inv->alloc(1, c.h);
      inv->moe(xi.slice_rows(r, 1), wi, one);
      ASSERT_EQ(inv->to_host(one), inv->to_host(whole.slice_rows(r, 1))) << what << ": row " << r << " alone";
      if (c.m >= 3) {
        const int r0 = std::min(r, c.m - 3);
        Tensor three = inv->alloc(3, c.h);
        inv->moe(xi.slice_rows(r0, 3), wi, three);
        ASSERT_EQ(inv->to_host(three), inv->to_host(whole.slice_rows(r0, 3))) << what << ": rows " << r0 << "+3";
      }
    }

    // A graph replay: the direct call's bits.
    Tensor replayed = gpu->alloc(c.m, c.h);
    auto graph = gpu->capture_graph([&] { gpu->moe(x.g, wg, replayed); });
    gpu->replay_graph(graph);
    EXPECT_EQ(gpu->to_host(replayed), gpu->to_host(out.g)) << what << ": graph replay";
  }
}

// The routed MLP of one token that normalizes its own input (the router product, then gate/up and
// down kernels that route the token themselves) gives the bits of the separate steps (RMSNorm,
// the routing kernel, the routed products, the combine) and of the token's row in a batch: output,
// normalized row, new residual and expert counts; a graph replay too. Its scratch's y rows stay
// untouched (the steps write them), which shows that the one-token kernels ran.
TEST_F(CudaOps, NormMoeOfOneTokenGivesTheStepsBits) {
  struct Case {
    int h, n_experts, top_k, ff;
    bool norm, f32, with_delta;
  };
  for (const Case c : {Case{2048, 128, 8, 768, true, true, true}, Case{64, 8, 2, 48, false, false, true},
                       Case{256, 300, 5, 40, true, true, false}, Case{512, 16, 8, 264, false, true, true},
                       Case{1024, 600, 4, 128, true, false, true}, Case{200, 24, 3, 56, true, true, true},
                       Case{128, 4, 1, 32, false, true, true}}) {  // top 1: the down kernel's second warp group idles
    const std::string what = "top " + std::to_string(c.top_k) + " of " + std::to_string(c.n_experts) + ", h " +
                             std::to_string(c.h) + ", ff " + std::to_string(c.ff) + (c.f32 ? ", f32" : ", bf16") +
                             (c.with_delta ? " residual + delta" : " residual");
    const MoePairs moe = random_moe(c.h, c.n_experts, c.top_k, c.ff, c.norm);
    const MoeWeights w = moe.on(true);
    const int m = 5;
    auto res = c.f32 ? random_f32(m, c.h, 3.0f) : random(m, c.h, 3.0f);
    auto delta = random(m, c.h), norm_w = random(1, c.h);
    auto residual = [&](int64_t rows) { return c.f32 ? gpu->alloc_f32(rows, c.h) : gpu->alloc(rows, c.h); };
    auto run = [&](bool fused, const Tensor& r, const Tensor& d, Tensor& ro, Tensor& h, Tensor& out, Tensor* counts,
                   MoeScratch* scratch) {
      const ResidualNorm n{&r, c.with_delta ? &d : nullptr, c.with_delta ? &ro : nullptr, &norm_w.g, 1e-6f};
      if (fused) gpu->norm_moe(n, h, w, out, counts, scratch);
      else gpu->Backend::norm_moe(n, h, w, out, counts, scratch);
    };
    // The whole batch (more than one row: the steps).
    Tensor ro_b = residual(m), h_b = gpu->alloc(m, c.h), out_b = gpu->alloc(m, c.h);
    run(true, res.g, delta.g, ro_b, h_b, out_b, nullptr, nullptr);
    for (int r = 0; r < m; ++r) {
      const std::string row = what + ", row " + std::to_string(r);
      const Tensor rr = res.g.slice_rows(r, 1), dr = delta.g.slice_rows(r, 1);
      Tensor ro1 = residual(1), h1 = gpu->alloc(1, c.h), out1 = gpu->alloc(1, c.h);
      Tensor ro2 = residual(1), h2 = gpu->alloc(1, c.h), out2 = gpu->alloc(1, c.h);
      Tensor n1 = gpu->alloc_ids(c.n_experts), n2 = gpu->alloc_ids(c.n_experts);
      auto y = poisoned(c.top_k, c.h);
      MoeScratch scratch;
      scratch.act = gpu->alloc(c.top_k, c.ff);
      scratch.y = y.g;
      run(true, rr, dr, ro1, h1, out1, &n1, &scratch);
      run(false, rr, dr, ro2, h2, out2, &n2, nullptr);
      for (float v : gpu->to_host(y.g)) ASSERT_TRUE(std::isnan(v)) << row << ": the steps ran, not the one-token kernels";
      EXPECT_EQ(gpu->to_host(out1), gpu->to_host(out2)) << row;
      EXPECT_EQ(gpu->to_host(h1), gpu->to_host(h2)) << row << ": normalized row";
      EXPECT_EQ(gpu->ids_to_host(n1), gpu->ids_to_host(n2)) << row << ": expert counts";
      EXPECT_EQ(gpu->to_host(out1), gpu->to_host(out_b.slice_rows(r, 1))) << row << " against the batch";
      EXPECT_EQ(gpu->to_host(h1), gpu->to_host(h_b.slice_rows(r, 1))) << row << " against the batch";
      if (c.with_delta) {
        EXPECT_EQ(gpu->to_host(ro1), gpu->to_host(ro2)) << row << ": residual";
        EXPECT_EQ(gpu->to_host(ro1), gpu->to_host(ro_b.slice_rows(r, 1))) << row << ": residual, batch";
      }
      if (r == 0) {
        Tensor ro3 = residual(1), h3 = gpu->alloc(1, c.h), out3 = gpu->alloc(1, c.h);
        auto graph = gpu->capture_graph([&] { run(true, rr, dr, ro3, h3, out3, nullptr, nullptr); });
        gpu->replay_graph(graph);
        EXPECT_EQ(gpu->to_host(out3), gpu->to_host(out1)) << row << ": graph replay";
        // Output over its own delta, as the decoder calls it.
        Tensor d4 = gpu->alloc(1, c.h), ro4 = residual(1), h4 = gpu->alloc(1, c.h);
        gpu->copy_rows(dr, d4);
        run(true, rr, d4, ro4, h4, d4, nullptr, nullptr);
        EXPECT_EQ(gpu->to_host(d4), gpu->to_host(out1)) << row << ": output over the delta";
      }
    }
  }
}

// A routed MLP whose weighted sum the backend defers (MoeScratch::defer_sum) to the RMSNorm after
// it: the norm writes the sum into the output as it reads it, with the combine kernel's bits, and
// the normalized rows, the new residual and the capture are those of the undeferred steps. Where
// no norm reads it first, finish_moe_sum writes the same output.
TEST_F(CudaOps, DeferredMoeSumInTheNextNormGivesTheCombinesBits) {
  struct Case {
    int m, h, n_experts, top_k, ff;
    bool f32;
  };
  for (const Case c : {Case{16, 2048, 128, 8, 768, true}, Case{3, 256, 16, 4, 64, false}, Case{24, 512, 40, 6, 96, true},
                       Case{9, 128, 8, 1, 32, false}}) {
    const std::string what = std::to_string(c.m) + " rows, top " + std::to_string(c.top_k) + " of " +
                             std::to_string(c.n_experts) + ", h " + std::to_string(c.h) + (c.f32 ? ", f32" : ", bf16");
    const MoePairs moe = random_moe(c.h, c.n_experts, c.top_k, c.ff, true);
    const MoeWeights w = moe.on(true);
    auto x = random(c.m, c.h), res = c.f32 ? random_f32(c.m, c.h, 3.0f) : random(c.m, c.h, 3.0f);
    auto norm_w = random(1, c.h);
    auto residual = [&] { return c.f32 ? gpu->alloc_f32(c.m, c.h) : gpu->alloc(c.m, c.h); };
    auto scratch = [&](bool defer) {
      MoeScratch s;
      s.act = gpu->alloc(int64_t{c.m} * c.top_k, c.ff);
      s.y = gpu->alloc(int64_t{c.m} * c.top_k, c.h);
      s.defer_sum = defer;
      return s;
    };
    struct Out {
      Pair delta, h, cap;
      Tensor ro;
    };
    auto run = [&](bool defer) {
      Out o{poisoned(c.m, c.h), poisoned(c.m, c.h), poisoned(c.m, c.h), residual()};
      MoeScratch s = scratch(defer);
      gpu->moe(x.g, w, o.delta.g, nullptr, &s);
      EXPECT_EQ(s.sum_deferred, defer) << what;
      const ResidualNorm n{&res.g, &o.delta.g, &o.ro, &norm_w.g, 1e-6f, &o.cap.g, defer ? &s : nullptr};
      gpu->norm_in(n, o.h.g);
      EXPECT_FALSE(s.sum_deferred) << what << ": the norm took the sum";
      return o;
    };
    const Out steps = run(false), deferred = run(true);
    EXPECT_EQ(gpu->to_host(deferred.delta.g), gpu->to_host(steps.delta.g)) << what << ": output";
    EXPECT_EQ(gpu->to_host(deferred.h.g), gpu->to_host(steps.h.g)) << what << ": normalized rows";
    EXPECT_EQ(gpu->to_host(deferred.ro), gpu->to_host(steps.ro)) << what << ": residual";
    EXPECT_EQ(gpu->to_host(deferred.cap.g), gpu->to_host(steps.cap.g)) << what << ": capture";
    // No norm: the backend writes the output when asked.
    auto out = poisoned(c.m, c.h);
    MoeScratch s = scratch(true);
    gpu->moe(x.g, w, out.g, nullptr, &s);
    gpu->finish_moe_sum(s, out.g);
    EXPECT_FALSE(s.sum_deferred) << what;
    EXPECT_EQ(gpu->to_host(out.g), gpu->to_host(steps.delta.g)) << what << ": finish_moe_sum";
  }
}

}  // namespace
}  // namespace dflash
