// Times decoding steps in isolation (no prefill, no tokenizer): a plain decode
// step and a DFlash step (draft block + verification + context projection) for
// `batch` sequences with `context` cached tokens each, and compares each with
// its floor: the bytes of weights and KV the step must read over the measured
// copy bandwidth (of a routed target's experts, those its rows went to); and
// prefills of whole prompts against the measured matrix-product rate. Used by
// `dflash bench-step`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

struct StepBenchOptions {
  std::string model_dir, draft_dir;  // draft optional: without it, plain rows only
  std::string device = "auto";
  std::vector<int> batches{1}, contexts{512};
  int page_size = 16;
  int block_size = 0;  // 0: the draft's
  int warmup = 5, iters = 30;
  int leak_check_steps = 1000;  // plain batch-1 steps watched for device-memory growth (0: skip)
  bool kernels = true;          // also time the target's GEMMs and decode attention alone
  bool batch_invariant = false; // the backend's batch-invariant mode (EngineOptions::batch_invariant)
  int tensor_parallel = 1;      // the target's ranks (EngineOptions::tensor_parallel); floors are GPU 0's bytes
  // Prefill rows: `prefill_batches` prompts of each length in `prefills` (none: no prefill rows),
  // in steps of at most max_tokens_per_step rows, as the server chunks them.
  std::vector<int> prefills, prefill_batches{1, 4};
  int max_tokens_per_step = 2048;
};

// A prompt (or several) prefilled as the decode loop runs it: whole prompt, all its steps.
struct PrefillBenchRow {
  int batch = 0, prompt = 0, steps = 0;
  double ms = 0, tokens_per_s = 0;
  double tflop = 0;                // the target's products and attention (the draft's projection not counted)
  double fraction_of_matmul = 0;   // tflop / ms against the measured bf16 product rate
};

struct StepBenchRow {
  std::string mode;  // "plain" or "dflash"
  int batch = 0, context = 0;
  double ms_per_step = 0, floor_ms = 0, fraction_of_floor = 0, gb_per_s = 0;
  double ms_per_step_eager = 0;  // the same step launched op by op (ms_per_step: CUDA-graph replays where available)
  // As the decoders run it: each graph's metadata restaged before its replay (0: no graphs),
  // and the host time of restaging one step alone.
  double ms_per_step_restaged = 0, restage_us = 0;
  int64_t bytes_per_step = 0;  // weights + KV the step must read
  // Routed (MoE) targets: per layer, the distinct experts the step's target rows went to (the
  // experts counted in bytes_per_step); empty for dense targets.
  std::vector<int> routed_experts;
  int64_t device_bytes_other = -1;  // device memory beyond weights and KV pages at this row (-1: unknown)
};

// One kernel timed alone (graph replays of 20 back-to-back calls where available).
struct KernelBenchRow {
  std::string name;  // e.g. "matmul gate_up" or "attention decode"
  int rows = 0;      // activation rows (tokens)
  int context = 0;   // attention only
  double us = 0, gb_per_s = 0;
  int64_t bytes = 0;  // weight (or KV) bytes it must read
};

struct StepBenchReport {
  std::string device, model, draft;
  double copy_gbps = 0;
  double load_s = 0;                 // loading both checkpoints onto the device
  int64_t peak_rss_bytes = 0;        // host memory high-water mark after loading
  int64_t weight_bytes = 0;          // target (+ draft) weights on the device
  int64_t leak_check_growth_bytes = -1;  // device memory growth over leak_check_steps steps
  std::vector<StepBenchRow> rows;
  std::vector<KernelBenchRow> kernels;
  double matmul_tflops = 0;          // measured bf16 product rate (prefill rows only)
  std::vector<PrefillBenchRow> prefills;
};

StepBenchReport run_step_bench(const StepBenchOptions& opts);

}  // namespace dflash
