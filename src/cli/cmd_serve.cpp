// `dflash serve`: the OpenAI-compatible server over the serving engine.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/bundled_models.h"
#include "cli/commands.h"
#include "engine/sampling.h"
#include "engine/serving.h"
#include "formats/model_config.h"
#include "server/http_server.h"
#include "server/server_sockets.h"
#include "util/error.h"

namespace dflash::cli {

namespace {
server::HttpServer* g_server = nullptr;
std::atomic<bool> g_stopping{false};
// The first SIGINT or SIGTERM stops taking connections and lets the requests in flight finish; a
// second one exits at once.
void on_signal(int sig) {
  if (g_stopping.exchange(true)) std::_Exit(128 + sig);
  static const char kMsg[] = "stopping: finishing the requests in flight (signal again to exit now)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, kMsg, sizeof kMsg - 1);
  if (g_server) g_server->stop();
}
}  // namespace

Command add_serve(CLI::App& app) {
  struct Args {
    ServingOptions so;
    server::ServerOptions http;
    std::string model, draft, speculative, device = "auto", spec_sampling = "match";
    int page_size = 16, block_size = 0;
    bool batch_invariant = false, no_graphs = false;
    int tensor_parallel = 1;
  };
  auto a = std::make_shared<Args>();
  app.add_option("--model", a->model, std::string("target model directory (default: the bundled ") + kBundledTarget +
                                          " with its DFlash draft)");
  app.add_option("--draft", a->draft, "DFlash draft directory; enables DFlash by default");
  app.add_option("--speculative", a->speculative, "dflash | none (default: dflash when a draft is given)")
      ->check(CLI::IsMember({"none", "dflash"}));
  app.add_option("--spec-sampling", a->spec_sampling,
                 "how DFlash verifies drafts of sampled requests: match (output equals plain sampling with the same "
                 "seed) or rejection (speculative rejection sampling)")
      ->check(CLI::IsMember({"match", "rejection"}));
  app.add_option("--host", a->http.host, "address to bind (default 127.0.0.1)");
  app.add_option("--port", a->http.port, "port (0: any free port)")->check(CLI::Range(0, 65535));
  app.add_option("--max-num-seqs", a->so.max_num_seqs, "sequences decoded together")->check(CLI::Range(1, 4096));
  auto* kv = app.add_option("--kv-pages", a->so.kv_pages, "KV-cache pages per cache (default: from --max-num-seqs)")
                 ->check(CLI::Range(1, 1 << 24));
  app.add_option("--gpu-memory-fraction", a->so.gpu_memory_fraction,
                 "size the KV cache to this fraction of the GPU memory left after the weights")
      ->check(CLI::Range(0.01, 0.99))
      ->excludes(kv);
  app.add_option("--state-snapshots", a->so.state_snapshots,
                 "hybrid targets (Qwen3.5, Qwen3-Next): recurrent states kept at page ends for the prefix cache "
                 "(default: a quarter of --max-num-seqs, at least 1; 0 turns their prefix cache off)")
      ->check(CLI::Range(0, 1 << 16));
  app.add_option("--max-tokens-per-step", a->so.max_tokens_per_step, "rows per target forward, prefill chunks and decoding rows together (default: 2048, or twice "
                 "max-num-seqs x block when that is more)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--page-size", a->page_size, "KV-cache page size in tokens")->check(CLI::Range(1, 4096));
  app.add_option("--block-size", a->block_size, "DFlash block size (default: the draft's)");
  app.add_option("--device", a->device, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--api-key", a->http.api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  app.add_option("--read-timeout", a->http.read_timeout_s, "seconds a client may stall while sending (default 20)")
      ->check(CLI::Range(1, 3600));
  app.add_option("--model-name", a->http.model_name, "name served in /v1/models (default: the model directory's name)");
  app.add_option("--chat-template", a->http.chat_template_file,
                 "a Jinja chat template file to use instead of the model directory's")
      ->check(CLI::ExistingFile);
  app.add_option("--tool-call-parser", a->http.tool_call_parser,
                 "how tool calls are read from chat output: auto (from the chat template), hermes "
                 "(<tool_call>...</tool_call>, Qwen), llama3_json (Llama 3.1), none (left as content)")
      ->check(CLI::IsMember({"auto", "hermes", "llama3_json", "none"}));
  app.add_option("--reasoning-parser", a->http.reasoning_parser,
                 "<think> blocks to reasoning_content: auto (when the chat template writes them), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  add_backend_flags(app, a->batch_invariant, a->no_graphs, a->tensor_parallel);
  return [a] {
    if (a->model.empty()) {
      a->model = bundled_model_dir(kBundledTarget);
      if (a->draft.empty()) a->draft = bundled_model_dir(kBundledDraft);
    }
    check(a->speculative != "dflash" || !a->draft.empty(), "--speculative dflash needs --draft DIR");
    ServingOptions so = a->so;
    so.engine.model_dir = a->model;
    so.engine.draft_dir = a->speculative == "none" ? "" : a->draft;
    so.engine.device = a->device;
    so.engine.page_size = a->page_size;
    so.engine.block_size = a->block_size;
    so.engine.batch_invariant = a->batch_invariant;
    so.engine.tensor_parallel = a->tensor_parallel;
    so.engine.graphs = !a->no_graphs;
    so.mode = so.engine.draft_dir.empty() ? SpeculativeMode::None : SpeculativeMode::DFlash;
    so.spec_sampling = parse_spec_sampling(a->spec_sampling);
    server::ServerOptions http = a->http;
    http.tokenizer_dir = a->model;
    if (http.model_name.empty()) http.model_name = std::filesystem::path(a->model).lexically_normal().filename().string();
    if (http.model_name.empty()) http.model_name = std::filesystem::path(a->model).parent_path().filename().string();

    server::check_can_bind(http.host, http.port);  // before a load that may take minutes
    ServingEngine engine(so);
    const ServingStats st = engine.stats();
    const std::string ranks = a->tensor_parallel > 1 ? cat(", tensor parallel over ", a->tensor_parallel,
                                                           engine.backend_name() == "cpu" ? " ranks" : " GPUs")
                                                     : "";
    std::printf("dflash serve: model %s%s%s on %s%s\n", a->model.c_str(), engine.speculative() ? ", DFlash draft " : "",
                engine.speculative() ? so.engine.draft_dir.c_str() : "", engine.backend_name().c_str(), ranks.c_str());
    std::printf("memory plan: %d KV pages of %d tokens (%s), %lld bytes of KV cache; up to %d sequences, block %d, "
                "%d rows a step\n",
                st.kv_pages_total, a->page_size, engine.speculative() ? "target and draft" : "target",
                static_cast<long long>(engine.kv_cache_bytes()), engine.max_num_seqs(), engine.block_size(),
                engine.max_tokens_per_step());
    const SamplingParams ds = default_sampling(load_generation_config(a->model));
    if (ds.greedy()) std::printf("default decoding: greedy (generation_config.json)\n");
    else std::printf("default decoding: temperature %g, top_k %d, top_p %g (generation_config.json); DFlash "
                     "verifies samples by %s\n", ds.temperature, ds.top_k, ds.top_p, a->spec_sampling.c_str());
    server::HttpServer srv(engine, http);
    g_server = &srv;
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    std::signal(SIGPIPE, SIG_IGN);
    srv.run([&](int port) {
      std::printf("serving '%s' at http://%s:%d/v1 (OpenAI API)\n", http.model_name.c_str(), http.host.c_str(), port);
      std::fflush(stdout);
    });
    g_server = nullptr;
    return 0;
  };
}

}  // namespace dflash::cli
