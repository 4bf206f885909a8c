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

}  // namespace dflash::cli
