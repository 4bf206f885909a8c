// Qwen3.5's layers on the GPU: Gated DeltaNet over the sequences' state slots (gated_delta_net.cu),
// the attention output gate and the shared expert's gate. Segment metadata is staged like the
// attention's, so the launches are capturable and restageable in graphs.
#include <algorithm>

#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/gated_delta_net.h"

namespace dflash::cuda {

void CudaBackend::gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                                  RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments,
                                  Tensor& out, Tensor* scratch) {
  const GdnShape shape{p.n_k_heads, p.n_v_heads, p.k_dim, p.v_dim, p.conv_kernel};
  check(gdn_shape_supported(shape), "cuda backend: Gated DeltaNet shape (key heads ", p.n_k_heads, ", value heads ",
        p.n_v_heads, ", dims ", p.k_dim, "x", p.v_dim, ", kernel ", p.conv_kernel, ") is not supported");
  const int64_t C = shape.conv_dim(), W = shape.tape_width();
  require_bf16(proj, "gated_delta_net projection");
  require_bf16(out, "gated_delta_net output");
  require_bf16(w.conv, "conv1d weight");
  require_bf16(w.norm, "gated norm weight");
  check(w.a_log.dtype == DType::F32 && w.dt_bias.dtype == DType::F32, "cuda backend: A_log and dt_bias must be F32");
  check(proj.cols == C + shape.value_dim() + 2 * p.n_v_heads && out.rows == proj.rows && out.cols == shape.value_dim(),
        "cuda backend: gated_delta_net shape mismatch");
  check(layer >= 0 && layer < static_cast<int>(cache.state.size()) && !cache.state[layer].empty(),
        "cuda backend: layer ", layer, " has no recurrent state");
  Tensor &conv = cache.conv[layer], &state = cache.state[layer], &tape = cache.tape[layer];
  for (const Tensor* t : {&conv, &state, &tape})
    check(t->dtype == DType::F32 && t->contiguous() && t->rows == cache.n_slots, "cuda backend: recurrent state layout");
  std::vector<int32_t> segs;
  int64_t scratch_rows = 0;
  int max_rows = 0;
  for (const RecurrentSegment& s : segments) {
    check(s.slot >= 0 && s.slot < cache.n_slots, "cuda backend: state slot ", s.slot, " out of range");
    check(s.first_row >= 0 && s.n_rows >= 0 && s.first_row + s.n_rows <= proj.rows,
          "cuda backend: recurrent segment rows outside the batch");
    check(s.replay >= 0 && s.replay <= cache.tape_rows && (s.commit || s.n_rows <= cache.tape_rows),
          "cuda backend: more rows than the tape holds (", cache.tape_rows, ")");
    // Each segment's scratch has room for a whole tape whatever it replays: the size does not
    // change from step to step (graphs).
    segs.insert(segs.end(), {s.first_row, s.n_rows, s.slot, s.replay, static_cast<int32_t>(scratch_rows), s.fresh ? 1 : 0,
                             s.commit ? 1 : 0});
    scratch_rows += cache.tape_rows + s.n_rows;
    max_rows = std::max(max_rows, cache.tape_rows + s.n_rows);
  }
  if (segments.empty()) return;
  // A graph's temporaries are not reused within it: a stack of layers passes one scratch.
  Tensor x = scratch && scratch->dtype == DType::F32 && scratch->rows >= scratch_rows && scratch->cols == W &&
                     scratch->contiguous()
                 ? *scratch
                 : alloc_f32(scratch_rows, W);
  // The chunked form's T matrices (prefill calls only; the pool reuses the memory layer to layer).
  const int chunk_min_rows = gdn_chunk_min_rows(shape, options_.batch_invariant);
  const int64_t t_cols = gdn_chunk_scratch_cols(shape, max_rows, chunk_min_rows);
  Tensor t = t_cols > 0 ? alloc_f32(scratch_rows, t_cols) : Tensor{};
  const int32_t* d_segs = staging_.stage(segs);
  const int n_segs = static_cast<int>(segments.size());
  staging_.launch(
      [&](cudaStream_t st) {
        launch_gated_delta_net(mat(proj), static_cast<const bf16*>(w.conv.data), w.a_log.f32(), w.dt_bias.f32(),
                               static_cast<const bf16*>(w.norm.data), p.eps, shape, d_segs, n_segs, conv.f32(),
                               state.f32(), tape.f32(), cache.tape_rows, max_rows, x.f32(), x.stride, chunk_min_rows,
                               t.f32(), t.stride, mat(out), st);
      },
      int64_t{n_segs} << 32 | max_rows);
}

void CudaBackend::sigmoid_mul(Tensor& x, const Tensor& gate) {
  require_bf16(x, "sigmoid_mul input");
  require_bf16(gate, "sigmoid_mul gate");
  check(gate.rows == x.rows && gate.cols == x.cols, "cuda backend: sigmoid_mul shape mismatch");
  staging_.launch([&](cudaStream_t s) { launch_sigmoid_mul(mat(x), mat(gate), s); });
}

void CudaBackend::add_sigmoid_scaled(Tensor& acc, const Tensor& y, const Tensor& gate) {
  require_bf16(acc, "add_sigmoid_scaled accumulator");
  require_bf16(y, "add_sigmoid_scaled input");
  require_bf16(gate, "add_sigmoid_scaled gate");
  check(y.rows == acc.rows && y.cols == acc.cols && gate.rows == acc.rows && gate.cols == 1,
        "cuda backend: add_sigmoid_scaled shape mismatch");
  staging_.launch([&](cudaStream_t s) { launch_add_sigmoid_scaled(mat(acc), mat(y), mat(gate), s); });
}

}  // namespace dflash::cuda
