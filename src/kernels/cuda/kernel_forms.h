// Kernel forms the CUDA backend chooses by a rule on the shapes or the GPU: each side of these rules
// runs in production (the rule decides by batch, grid size or GPU), and every side gives the same
// bits unless its comment says otherwise (the routed products' forms). Tests force one side to
// compare them; production leaves every form to its rule. No CUDA headers here: the tests include
// it in every build.
#pragma once

namespace dflash {

class Backend;

namespace cuda {

struct KernelForms {
  // Attention splits of kAttnSplitKeys keys: one block each, then the combine kernel (parallel),
  // one block per tile running its splits in order and combining them itself (loop), or one block
  // per run of up to 8 tiles of a sequence running its splits in order with each split's keys
  // shared by the run's tiles (shared_keys, attention_shared_keys.cu; calls without the fused
  // form). Rule: shared_keys where a sequence's rows fill two tiles or more on average
  // (verification and draft blocks) and the grid without splits has at least 3 blocks per SM,
  // else the loop where that grid has at least 4 blocks per SM.
  enum class Splits { by_rule, parallel, loop, shared_keys } attention_splits = Splits::by_rule;
  // The split combine: a warp per 32 dims of a head, or a warp per head. Rule: per 32 dims where
  // the GPU holds all those warps at once.
  enum class Combine { by_rule, per_32_dims, per_head } combine = Combine::by_rule;
  // Skinny products over a few thousand weight rows: wide blocks (one per SM, several row tiles
  // each) or the usual ones. Rule: wide at more than 8 token rows; any_rows: at any number.
  enum class Wide { by_rule, never, any_rows } skinny_wide = Wide::by_rule;
  // Routed (MoE) products: tile products (moe_gemm.cu) or the skinny kernel's routed form. Rule:
  // tiles where a step's pairs average 32 or more an expert, unless batch-invariant.
  enum class RoutedTiles { by_rule, never } routed_tiles = RoutedTiles::by_rule;
  // The tile products' arithmetic: Hopper's warpgroup products (wgmma) or mma.sync (bits differ).
  // Rule: warpgroup products where the GPU runs this build's sm_90a code (H100, H200), else mma.sync.
  enum class TileMma { by_rule, mma_sync } tile_mma = TileMma::by_rule;
};

// Sets the forms of a backend made by make_cuda_backend (tests). Throws Error for any other
// backend and in builds without CUDA.
void force_kernel_forms(Backend& cuda_backend, const KernelForms& forms);

// How many routed products a backend made by make_cuda_backend has run as tile products (tests:
// whether a step took them; their bits may equal the skinny form's by chance on small shapes).
long long routed_tile_products(const Backend& cuda_backend);

// How many products a backend made by make_cuda_backend has run sending their outputs to the
// peers (Communicator::matmul_all_reduce; tests: whether a sum took that path).
long long pushed_products(const Backend& cuda_backend);

// Whether a backend made by make_cuda_backend takes the warpgroup tile products by rule (tests: then
// the mma.sync form is the rule's other side, to be forced).
bool warpgroup_tile_products(const Backend& cuda_backend);

}  // namespace cuda
}  // namespace dflash
