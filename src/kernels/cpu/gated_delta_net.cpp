#include "kernels/cpu/gated_delta_net.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "util/error.h"

namespace dflash {
namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// One slot's state while a segment runs: the convolution window and S.
struct SlotState {
  float* conv;   // (conv_kernel - 1) rows of conv_dim raw q|k|v inputs, oldest first
  float* s;      // [n_v][k_dim][v_dim]
};

class Layer {
 public:
  Layer(const LinearAttentionWeights& w, const LinearAttentionParams& p) : w_(w), p_(p) {
    c_ = p.conv_dim();
    x_.resize(static_cast<size_t>(c_));
    core_.resize(static_cast<size_t>(int64_t{p.n_v_heads} * p.v_dim));
  }

  // Folds one row (raw: its [q|k|v] projection; b, a: n_v values each) into `st`; with `o`, also
  // writes the row's core output o [n_v * v_dim] (before the gated norm).
  void step(SlotState st, const float* raw, const float* b, const float* a, float* o) {
    const int K = p_.conv_kernel;
    const float* cw = w_.conv.f32();
    for (int64_t c = 0; c < c_; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < K - 1; ++j) acc += cw[c * K + j] * st.conv[j * c_ + c];
      acc += cw[c * K + K - 1] * raw[c];
      x_[c] = silu(acc);
    }
    if (K > 1) {
      std::memmove(st.conv, st.conv + c_, sizeof(float) * static_cast<size_t>((K - 2) * c_));
      std::memcpy(st.conv + (K - 2) * c_, raw, sizeof(float) * static_cast<size_t>(c_));
    }
    const int dk = p_.k_dim, dv = p_.v_dim, ratio = p_.n_v_heads / p_.n_k_heads;
    const int64_t key_dim = int64_t{p_.n_k_heads} * dk;
    float* q = x_.data();
    float* k = q + key_dim;
    const float* v = k + key_dim;
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
    for (int h = 0; h < p_.n_k_heads; ++h) {
      for (float* x : {q + int64_t{h} * dk, k + int64_t{h} * dk}) {
        float ss = 0.0f;
        for (int i = 0; i < dk; ++i) ss += x[i] * x[i];
        const float inv = 1.0f / std::sqrt(ss + 1e-6f);
        for (int i = 0; i < dk; ++i) x[i] *= inv;
      }
      for (int i = 0; i < dk; ++i) q[int64_t{h} * dk + i] *= q_scale;
    }
    const float* a_log = w_.a_log.f32();
    const float* dt_bias = w_.dt_bias.f32();
    for (int h = 0; h < p_.n_v_heads; ++h) {
      const float beta = sigmoid(b[h]);
      const float decay = std::exp(-std::exp(a_log[h]) * softplus(a[h] + dt_bias[h]));
      const float* kh = k + int64_t{h / ratio} * dk;
      const float* qh = q + int64_t{h / ratio} * dk;
      const float* vh = v + int64_t{h} * dv;
      float* s = st.s + int64_t{h} * dk * dv;
      for (int64_t i = 0; i < int64_t{dk} * dv; ++i) s[i] *= decay;
      float delta[1024];
      for (int j = 0; j < dv; ++j) {
        float mem = 0.0f;
        for (int i = 0; i < dk; ++i) mem += s[int64_t{i} * dv + j] * kh[i];
        delta[j] = (vh[j] - mem) * beta;
      }
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) s[int64_t{i} * dv + j] += kh[i] * delta[j];
      if (!o) continue;
      for (int j = 0; j < dv; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < dk; ++i) acc += s[int64_t{i} * dv + j] * qh[i];
        o[int64_t{h} * dv + j] = acc;
      }
    }
  }

  // out = rmsnorm(o) * norm * silu(z), per value head.
  void gated_norm(const float* o, const float* z, float* out) const {
    const int dv = p_.v_dim;
    const float* nw = w_.norm.f32();
    for (int h = 0; h < p_.n_v_heads; ++h) {
      const float* oh = o + int64_t{h} * dv;
      double ss = 0.0;
      for (int j = 0; j < dv; ++j) ss += static_cast<double>(oh[j]) * oh[j];
      const float scale = static_cast<float>(1.0 / std::sqrt(ss / dv + p_.eps));
      for (int j = 0; j < dv; ++j) out[int64_t{h} * dv + j] = nw[j] * (oh[j] * scale) * silu(z[int64_t{h} * dv + j]);
    }
  }

  std::vector<float>& core() { return core_; }

 private:
  const LinearAttentionWeights& w_;
  const LinearAttentionParams& p_;
  int64_t c_ = 0;
  std::vector<float> x_, core_;
};

}  // namespace

void cpu_gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                         RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments, Tensor& out) {
  const int64_t c = p.conv_dim(), value_dim = int64_t{p.n_v_heads} * p.v_dim, nv = p.n_v_heads;
  const int64_t width = p.tape_width();
  check(p.n_k_heads > 0 && p.n_v_heads % p.n_k_heads == 0 && p.v_dim <= 1024 && p.conv_kernel >= 2,
        "gated_delta_net: bad layer shape");
  check(proj.cols == c + value_dim + 2 * nv, "gated_delta_net: projection width ", proj.cols, " != ",
        c + value_dim + 2 * nv);
  check(out.rows == proj.rows && out.cols == value_dim, "gated_delta_net: output shape mismatch");
  check(layer >= 0 && layer < static_cast<int>(cache.state.size()) && !cache.state[layer].empty(),
        "gated_delta_net: layer ", layer, " has no recurrent state");
  Tensor& conv = cache.conv[layer];
  Tensor& state = cache.state[layer];
  Tensor& tape = cache.tape[layer];
  const int64_t conv_len = (p.conv_kernel - 1) * c, state_len = nv * p.k_dim * p.v_dim;
  Layer L(w, p);
  std::vector<float> s_work(static_cast<size_t>(state_len)), conv_work(static_cast<size_t>(conv_len));
  for (const RecurrentSegment& seg : segments) {
    check(seg.slot >= 0 && seg.slot < cache.n_slots, "gated_delta_net: slot ", seg.slot, " outside 0..",
          cache.n_slots - 1);
    check(seg.first_row >= 0 && seg.n_rows >= 0 && seg.first_row + seg.n_rows <= proj.rows,
          "gated_delta_net: segment rows outside the batch");
    check(seg.replay >= 0 && seg.replay <= cache.tape_rows && (seg.commit || seg.n_rows <= cache.tape_rows),
          "gated_delta_net: more rows than the tape holds (", cache.tape_rows, ")");
    SlotState st{conv.row_f32(seg.slot), state.row_f32(seg.slot)};
    float* slot_tape = tape.row_f32(seg.slot);
    if (seg.fresh) {
      std::fill_n(st.conv, conv_len, 0.0f);
      std::fill_n(st.s, state_len, 0.0f);
    }
    for (int32_t t = 0; t < seg.replay; ++t) {
      const float* row = slot_tape + t * width;
      L.step(st, row, row + c, row + c + nv, nullptr);
    }
    SlotState run = st;
    if (!seg.commit) {  // the rows run on a copy; the slot keeps the state before them
      std::copy_n(st.conv, conv_len, conv_work.data());
      std::copy_n(st.s, state_len, s_work.data());
      run = SlotState{conv_work.data(), s_work.data()};
    }
    for (int32_t i = 0; i < seg.n_rows; ++i) {
      const float* row = proj.row_f32(seg.first_row + i);
      const float* z = row + c;
      const float* b = z + value_dim;
      const float* a = b + nv;
      L.step(run, row, b, a, L.core().data());
      L.gated_norm(L.core().data(), z, out.row_f32(seg.first_row + i));
      if (!seg.commit) {
        float* t = slot_tape + int64_t{i} * width;
        std::copy_n(row, c, t);
        std::copy_n(b, 2 * nv, t + c);
      }
    }
  }
}

}  // namespace dflash
