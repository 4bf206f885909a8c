// Subcommands of the `dflash` binary. Each registers its options on the CLI11
// app and returns the function that runs it (exit status).
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace dflash::cli {

using Command = std::function<int()>;

Command add_generate(CLI::App& app);
Command add_inspect(CLI::App& app);
Command add_tokenize(CLI::App& app);
Command add_chat_template(CLI::App& app);
Command add_bench_step(CLI::App& app);
Command add_logits(CLI::App& app);
Command add_serve(CLI::App& app);

// --batch-invariant and --no-graphs (generate and serve).
inline void add_tensor_parallel_flag(CLI::App& app, int& tensor_parallel) {
  app.add_option("--tensor-parallel", tensor_parallel,
                 "run the target over this many GPUs (0..N-1, NCCL) or CPU ranks, Megatron style")
      ->check(CLI::Range(1, 64));
}

inline void add_backend_flags(CLI::App& app, bool& batch_invariant, bool& no_graphs, int& tensor_parallel) {
  add_tensor_parallel_flag(app, tensor_parallel);
  app.add_flag("--batch-invariant", batch_invariant,
               "each row's result independent of the batch it is in (CUDA: slower at large batches)");
  app.add_flag("--no-graphs", no_graphs, "launch every decoding step op by op instead of replaying CUDA graphs");
}

}  // namespace dflash::cli
