// `dflash bench-step`: decode and DFlash step times against the memory-bandwidth floor.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/bundled_models.h"
#include "cli/commands.h"
#include "engine/step_bench.h"
#include "util/error.h"

namespace dflash::cli {

namespace {

nlohmann::json to_json(const StepBenchReport& rep, const StepBenchOptions& o) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& k : rep.kernels) {
    rows.push_back({{"device", rep.device}, {"model", rep.model}, {"mode", "kernel"}, {"kernel", k.name},
                    {"batch", k.rows}, {"context", k.context}, {"us", k.us}, {"bytes", k.bytes},
                    {"gb_per_s", k.gb_per_s}, {"copy_gbps", rep.copy_gbps}});
  }
  for (const auto& r : rep.rows) {
    rows.push_back({{"device", rep.device}, {"model", rep.model}, {"draft", rep.draft}, {"mode", r.mode},
                    {"batch", r.batch}, {"context", r.context}, {"ms_per_step", r.ms_per_step}, {"ms_per_step_eager", r.ms_per_step_eager},
                    {"ms_per_step_restaged", r.ms_per_step_restaged}, {"restage_us", r.restage_us},
                    {"floor_ms", r.floor_ms}, {"fraction_of_floor", r.fraction_of_floor}, {"gb_per_s", r.gb_per_s},
                    {"bytes_per_step", r.bytes_per_step}, {"copy_gbps", rep.copy_gbps},
                    {"device_bytes_other", r.device_bytes_other}, {"page_size", o.page_size},
                    {"iters", o.iters}, {"batch_invariant", o.batch_invariant}, {"tensor_parallel", o.tensor_parallel}, {"load_s", rep.load_s}, {"peak_rss_bytes", rep.peak_rss_bytes},
                    {"weight_bytes", rep.weight_bytes}, {"leak_check_steps", o.leak_check_steps},
                    {"leak_check_growth_bytes", rep.leak_check_growth_bytes}});
    if (!r.routed_experts.empty()) rows.back()["routed_experts_per_layer"] = r.routed_experts;
  }
  for (const auto& p : rep.prefills) {
    rows.push_back({{"device", rep.device}, {"model", rep.model}, {"draft", rep.draft}, {"mode", "prefill"},
                    {"batch", p.batch}, {"prompt", p.prompt}, {"steps", p.steps}, {"ms", p.ms},
                    {"tokens_per_s", p.tokens_per_s}, {"tflop", p.tflop}, {"fraction_of_matmul", p.fraction_of_matmul},
                    {"matmul_tflops", rep.matmul_tflops}, {"max_tokens_per_step", o.max_tokens_per_step},
                    {"page_size", o.page_size}});
  }
  return rows;
}

// "min/mean/max" of the distinct experts per routed layer ("-" for a dense target).
std::string routed_summary(const std::vector<int>& routed) {
  std::vector<int> moe;
  for (int n : routed)
    if (n > 0) moe.push_back(n);
  if (moe.empty()) return "-";
  double sum = 0;
  for (int n : moe) sum += n;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%d/%.1f/%d", *std::min_element(moe.begin(), moe.end()), sum / moe.size(),
                *std::max_element(moe.begin(), moe.end()));
  return buf;
}

}  // namespace

Command add_bench_step(CLI::App& app) {
  auto o = std::make_shared<StepBenchOptions>();
  auto json_path = std::make_shared<std::string>();
  app.add_option("--model", o->model_dir, "target checkpoint directory (default: the bundled model)");
  app.add_option("--draft", o->draft_dir, "DFlash draft directory (default with the bundled model: its draft)");
  app.add_option("--batch", o->batches, "batch sizes, comma-separated")->delimiter(',');
  app.add_option("--context", o->contexts, "cached tokens per sequence, comma-separated")->delimiter(',');
  app.add_option("--device", o->device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--page-size", o->page_size, "KV-cache page size in tokens")->check(CLI::Range(1, 4096));
  app.add_option("--block-size", o->block_size, "DFlash block size (default: the draft's)");
  app.add_option("--iters", o->iters, "timed steps per row (median reported)")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", o->warmup, "untimed steps before each row")->check(CLI::Range(0, 100000));
  app.add_option("--leak-check-steps", o->leak_check_steps, "plain steps watched for device-memory growth (0: skip)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--prefill", o->prefills, "prompt lengths to time whole prefills of, comma-separated")
      ->delimiter(',');
  app.add_option("--prefill-batch", o->prefill_batches, "prompts prefilled together, comma-separated")
      ->delimiter(',');
  app.add_option("--max-tokens-per-step", o->max_tokens_per_step, "rows per prefill step (the server's chunking)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--json", *json_path, "write the rows as a JSON list to this file");
  app.add_flag("!--skip-kernels", o->kernels, "do not time the GEMMs and the decode attention alone");
  app.add_flag("--batch-invariant", o->batch_invariant,
               "each row's result independent of the batch it is in (CUDA: slower at large batches)");
  add_tensor_parallel_flag(app, o->tensor_parallel);
  return [o, json_path] {
    if (o->model_dir.empty()) {
      o->model_dir = bundled_model_dir(kBundledTarget);
      if (o->draft_dir.empty()) o->draft_dir = bundled_model_dir(kBundledDraft);
    }
    const StepBenchReport rep = run_step_bench(*o);
    std::printf("device: %s%s, copy bandwidth %.0f GB/s (read + write)\n", rep.device.c_str(),
                o->tensor_parallel > 1 ? cat(" x ", o->tensor_parallel, " (tensor parallel; floors count GPU 0's bytes)").c_str() : "",
                rep.copy_gbps);
    std::printf("model: %s%s%s; weights %.2f GB; load %.1f s, peak host RSS %.2f GB\n", rep.model.c_str(),
                rep.draft.empty() ? "" : " + ", rep.draft.c_str(), rep.weight_bytes / 1e9, rep.load_s,
                rep.peak_rss_bytes / 1e9);
    if (!rep.kernels.empty()) {
      std::printf("%-30s %6s %8s %10s %10s %9s\n", "kernel", "rows", "context", "us", "MB read", "GB/s");
      for (const auto& k : rep.kernels) {
        std::printf("%-30s %6d %8d %10.1f %10.1f %9.0f\n", k.name.c_str(), k.rows, k.context, k.us, k.bytes / 1e6,
                    k.gb_per_s);
      }
    }
    const bool moe = !rep.rows.empty() && !rep.rows[0].routed_experts.empty();
    if (moe) {
      std::printf("routed target: floor_ms counts the experts each layer's rows went to (experts/layer:\n"
                  "min/mean/max over the routed layers); random routers spread tokens uniformly, the worst case\n");
    }
    std::printf("%-7s %6s %8s %10s %10s %10s %9s %9s %12s %12s %10s%s\n", "mode", "batch", "context", "ms/step",
                "eager_ms", "floor_ms", "GB/s", "fraction", "other_MiB", "restaged_ms", "restage_us",
                moe ? "  experts/layer" : "");
    for (const auto& r : rep.rows) {
      std::printf("%-7s %6d %8d %10.3f %10.3f %10.3f %9.0f %9.3f %12.1f %12.3f %10.1f%s%s\n", r.mode.c_str(), r.batch,
                  r.context, r.ms_per_step, r.ms_per_step_eager, r.floor_ms, r.gb_per_s, r.fraction_of_floor,
                  r.device_bytes_other >= 0 ? r.device_bytes_other / 1048576.0 : -1.0, r.ms_per_step_restaged,
                  r.restage_us, moe ? "  " : "", moe ? routed_summary(r.routed_experts).c_str() : "");
    }
    if (!rep.prefills.empty()) {
      std::printf("prefill: measured product rate %.3f TFLOP/s; TFLOP counts the target's\n"
                  "products and attention, not the draft's context projection\n", rep.matmul_tflops);
      std::printf("%-7s %6s %8s %6s %10s %12s %8s %9s\n", "mode", "batch", "prompt", "steps", "ms", "tokens/s",
                  "TFLOP", "fraction");
      for (const auto& p : rep.prefills) {
        std::printf("%-7s %6d %8d %6d %10.2f %12.0f %8.4f %9.3f\n", "prefill", p.batch, p.prompt, p.steps, p.ms,
                    p.tokens_per_s, p.tflop, p.fraction_of_matmul);
      }
    }
    if (rep.leak_check_growth_bytes >= 0) {
      std::printf("device memory growth over %d plain steps: %lld bytes\n", o->leak_check_steps,
                  static_cast<long long>(rep.leak_check_growth_bytes));
    }
    if (!json_path->empty()) {
      std::ofstream out(*json_path);
      check(static_cast<bool>(out), "cannot write ", *json_path);
      out << to_json(rep, *o).dump(2) << "\n";
    }
    return 0;
  };
}

}  // namespace dflash::cli
