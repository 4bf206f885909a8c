// CUDA backend: bf16 weights, activations and KV cache; float32 arithmetic in every kernel (the
// residual stream may be float32). One stream, owned by GraphStaging, through which every launch
// goes; temporaries come from the stream-ordered memory pool, or inside graphs from their arena.
//
// cuda_backend.cpp: device, memory, copies, graphs and token readback; cuda_ops.cpp: the row
// ops and products; cuda_attention_ops.cpp: attention; cuda_moe_ops.cpp: the routed MLP.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "kernels/cuda/graph_staging.h"
#include "kernels/cuda/kernel_forms.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/lt_gemm.h"
#include "util/error.h"

namespace dflash::cuda {

inline Mat mat(const Tensor& t) { return {static_cast<bf16*>(t.data), t.rows, t.cols, t.stride}; }
// A residual-stream tensor (float32 or bf16) for the kernels.
inline Rows rows_of(const Tensor& t) { return {t.data, t.rows, t.cols, t.stride, t.dtype == DType::F32}; }
inline bool residual_dtype(const Tensor& t) { return t.dtype == DType::F32 || t.dtype == DType::BF16; }
// The kernels' view of a ResidualNorm; residual stays null when a tensor is not bf16 or the
// shapes differ (the caller then takes the separate steps). cuda_ops.cpp.
RowNorm row_norm(const ResidualNorm& n);
// The operands of a routed MLP's deferred sum (MoeScratch::sum_deferred) for its first `rows` output rows.
MoeSum moe_sum_of(const MoeScratch& s, int64_t rows);
inline const bf16* bf16_or_null(const Tensor* t) { return t ? static_cast<const bf16*>(t->data) : nullptr; }

inline void require_ids(const Tensor& t, const char* what) {
  check(t.dtype == DType::I32 && t.cols == 1 && t.stride == 1 && !t.empty(), "cuda backend: ", what,
        " must be a contiguous I32 tensor of one column");
}
inline void require_bf16(const Tensor& t, const char* what) {
  check(t.dtype == DType::BF16 && !t.empty(), "cuda backend: ", what, " must be a non-empty BF16 tensor");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options);
  ~CudaBackend() override;

  // Tests: one side of the kernels' shape rules (KernelForms).
  void force_forms(const KernelForms& forms) { forms_ = forms; }
  long long routed_tile_products() const { return routed_tile_products_; }
  long long pushed_products() const { return pushed_products_; }

  std::string name() const override { return std::string("cuda (") + props_.name + ")"; }
  bool memory_info(int64_t& free_bytes, int64_t& total_bytes) override;
  bool supports_graphs() const override { return true; }
  std::shared_ptr<void> capture_graph(const std::function<void()>& body, bool share_uploads) override;
  void replay_graph(const std::shared_ptr<void>& graph) override;
  bool restage_graph(const std::shared_ptr<void>& graph, const std::function<void()>& body) override;
  void set_graph_peers(GraphPeers* peers) override { peers_ = peers; }
  int device() const { return options_.device; }
  const cudaDeviceProp& properties() const { return props_; }
  const BackendOptions& options() const { return options_; }
  // A library call that queues work on the backend's stream (NCCL's collectives), through the
  // same path as kernels: captured into graphs, skipped while one is restaged.
  void launch_library(const std::function<void(cudaStream_t)>& fn) { staging_.launch(fn); }
  void synchronize() override;
  void release_cached_memory() override;
  void prepare_products(int64_t max_rows) override { lt_->prepare(max_rows); }
  double measure_copy_gbps(int64_t bytes) override;

  Tensor alloc(int64_t rows, int64_t cols) override { return alloc_as(rows, cols, DType::BF16); }
  Tensor alloc_f32(int64_t rows, int64_t cols) override { return alloc_as(rows, cols, DType::F32); }
  Tensor upload(const std::vector<const TensorInfo*>& parts) override;
  Tensor upload_host(const float* data, int64_t rows, int64_t cols) override;
  Tensor upload_host_f32(const float* data, int64_t rows, int64_t cols) override;
  std::vector<float> to_host(const Tensor& t) override;
  KvCache alloc_kv(int n_layers, int n_pages, int page_size, int n_kv_heads, int head_dim) override;
  void fill_random(Tensor& t, uint64_t seed, float scale) override;

  void embed(const Tensor& table, const std::vector<int32_t>& ids, Tensor& out,
             const DeviceTokens* from_device) override;
  void matmul(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out) override;
  // matmul through the skinny kernel whole, its blocks also sending their outputs to the peers
  // (launch_skinny_gemm_pushed); false, with nothing launched, where the product takes another form.
  bool matmul_pushing(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& out, const PeerPush& push);
  void matmul_swiglu(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor& gate_up, Tensor& out) override;
  void norm_matmul(const ResidualNorm& n, Tensor& h, const Tensor& w, const Tensor* bias, Tensor& out,
                   Tensor* gate_up) override;
  void norm_in(const ResidualNorm& n, Tensor& h) override;
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, Tensor& out) override;
  void add_rms_norm(const Tensor& residual, const Tensor& delta, Tensor& residual_out, const Tensor& weight, float eps,
                    Tensor& out) override;
  void head_norm_rope(Tensor& x, int n_heads, int head_dim, const Tensor* norm_weight, float eps,
                      const std::vector<int32_t>& positions, const std::vector<float>& inv_freq) override;
  void qkv_rope_kv_write(Tensor& qkv, int n_heads, int n_kv_heads, int head_dim, const Tensor* q_norm,
                         const Tensor* k_norm, float eps, const std::vector<int32_t>& positions,
                         const std::vector<float>& inv_freq, Tensor& k_cache, Tensor& v_cache,
                         const std::vector<int32_t>& slots) override;
  void kv_rope_write_layers(Tensor& kv, int n_kv_heads, int head_dim, const std::vector<const Tensor*>& k_norms,
                            float eps, const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                            std::vector<Tensor>& k_caches, std::vector<Tensor>& v_caches,
                            const std::vector<int32_t>& slots) override;
  void matmul_row_groups(const Tensor& x, const Tensor& w, const RowGroups& g, Tensor& out) override;
  void swiglu(const Tensor& gate_up, Tensor& out) override;
  void kv_write(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                const std::vector<int32_t>& slots) override;
  void attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                 const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                 const AttentionParams& p, Tensor& out) override;
  void qkv_attention(Tensor& qkv, const Tensor* q_norm, const Tensor* k_norm, float eps,
                     const std::vector<float>& inv_freq, const std::vector<int32_t>& slots, Tensor& k_cache,
                     Tensor& v_cache, const std::vector<AttentionSegment>& segments,
                     const std::vector<int32_t>& positions, const AttentionParams& p, Tensor& out) override;
  void moe(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
           MoeScratch* scratch) override;  // cuda_moe_ops.cpp
  void norm_moe(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
                MoeScratch* scratch) override;
  // norm_moe whose last kernel (the one-token down kernel or the combine) also sends out's words to
  // the peers (a pushed exchange, as matmul_pushing's); false, with nothing launched, where out
  // cannot be exchanged so.
  bool norm_moe_pushing(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
                        MoeScratch* scratch, const PeerPush& push);
  void finish_moe_sum(MoeScratch& s, const Tensor& out) override;  // cuda_moe_ops.cpp
  // s.exchange: the PeerPush of the rank (nccl_ranks.cpp) whose products pushed the shares.
  void finish_rank_sum(RankSum& s, const Tensor& out) override;
  // Qwen3.5 (cuda_hybrid_ops.cpp)
  bool has_gated_delta_net() const override { return true; }
  void gated_delta_net(const Tensor& proj, const LinearAttentionWeights& w, const LinearAttentionParams& p,
                       RecurrentCache& cache, int layer, const std::vector<RecurrentSegment>& segments,
                       Tensor& out, Tensor* scratch) override;
  void sigmoid_mul(Tensor& x, const Tensor& gate) override;
  void add_sigmoid_scaled(Tensor& acc, const Tensor& y, const Tensor& gate) override;
  void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& out) override;
  void copy_rows(const Tensor& src, Tensor& dst) override;
  std::vector<int32_t> argmax_rows(const Tensor& x) override;
  Tensor alloc_ids(int64_t n) override { return alloc_as(n, 1, DType::I32); }
  void argmax_ids(const Tensor& x, Tensor& ids) override;
  void argmax_candidates(const Tensor& x, int64_t first_id, Tensor& cand) override;
  void argmax_of_candidates(const Tensor& all, Tensor& ids) override;
  std::vector<int32_t> ids_to_host(const Tensor& ids) override;

 protected:
  std::vector<TopCandidates> select_candidates(const Tensor& logits, const std::vector<int32_t>& rows,
                                               const std::vector<float>& temperature,
                                               const std::vector<int32_t>& top_k) override;

 private:
  static constexpr int64_t kArgmaxCap = kArgmaxMaxRows;
  static constexpr size_t kTopRowsPerCall = 64;

  Tensor alloc_as(int64_t rows, int64_t cols, DType dt);
  // moe and norm_moe, their outputs pushed to the peers when push is not null (cuda_moe_ops.cpp).
  void moe_to(const Tensor& x, const MoeWeights& w, Tensor& out, Tensor* expert_rows, MoeScratch* scratch,
              const PeerPush* push);
  void norm_moe_to(const ResidualNorm& n, Tensor& h, const MoeWeights& w, Tensor& out, Tensor* expert_rows,
                   MoeScratch* scratch, const PeerPush* push);
  // Runs a product through the skinny kernel (cuda_ops.cpp); false when it takes cuBLASLt.
  template <typename Launch>
  bool in_skinny_slices(const Tensor& x, const Tensor& w, Tensor& out, Launch&& launch);
  // Attention of q's rows (with fresh: the fused form, q being qkv's query heads).
  void run_attention(const Tensor& q, const AttnFresh* fresh, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<AttentionSegment>& segments, const std::vector<int32_t>& positions,
                     const AttentionParams& p, Tensor& out);
  // Device scratch for the attention's partials (dead once the stream moves on).
  void* workspace_for(int64_t bytes);
  const float2* rope_table(const std::vector<float>& inv_freq, int max_position);
  const float* device_inv_freq(const std::vector<float>& f);

  BackendOptions options_;
  cudaDeviceProp props_;  // of options_.device, which the backend selects first
  GraphPeers* peers_ = nullptr;
  GraphStaging staging_;
  std::unique_ptr<LtGemm> lt_;
  KernelForms forms_;  // by rule, unless a test forces a form
  long long routed_tile_products_ = 0;  // moe() calls that took the tile products (tests)
  long long pushed_products_ = 0;       // matmul_pushing and norm_moe_pushing calls that launched (tests)
  TopCandidatesRow* top_out_ = nullptr;  // top_candidates' results, device and pinned host
  TopCandidatesRow* top_host_ = nullptr;
  std::map<std::vector<float>, float*> inv_freq_;
  std::map<const float*, std::vector<std::pair<float2*, int>>> rope_tables_;  // per inv_freq: (table, positions)
  Tensor attn_ws_;
  int32_t* argmax_host_ = nullptr;
  int32_t* argmax_out_ = nullptr;  // kArgmaxCap results, then the argmax workspace
};

}  // namespace dflash::cuda
