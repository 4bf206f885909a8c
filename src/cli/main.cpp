// dflash: command-line entry point. Errors from bad input end here as one
// message on stderr and exit status 1 (usage errors: 2).
#include <cstdio>
#include <exception>
#include <map>

#include "cli/commands.h"
#include "util/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dflash: LLM inference with DFlash speculative decoding"};
  app.require_subcommand(1);
  std::map<CLI::App*, dflash::cli::Command> commands;
  auto add = [&](const char* name, const char* help, auto adder) {
    CLI::App* sub = app.add_subcommand(name, help);
    commands[sub] = adder(*sub);
  };
  add("generate", "generate tokens for one prompt and print them with statistics", dflash::cli::add_generate);
  add("serve", "serve the model over an OpenAI-compatible HTTP API", dflash::cli::add_serve);
  add("tokenize", "turn text into token ids with a tokenizer.json", dflash::cli::add_tokenize);
  add("chat-template", "render chat messages with a tokenizer's chat template", dflash::cli::add_chat_template);
  add("bench-step", "time decode and DFlash steps against the memory-bandwidth floor", dflash::cli::add_bench_step);
  add("logits", "write a target's logits for every prompt position (float32 file)", dflash::cli::add_logits);
  add("inspect", "describe a model or draft checkpoint directory", dflash::cli::add_inspect);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  try {
    for (auto& [sub, run] : commands) {
      if (sub->parsed()) return run();
    }
  } catch (const dflash::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 2;
}
