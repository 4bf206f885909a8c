// The OpenAI-compatible HTTP server (cpp-httplib): /v1/completions and
// /v1/chat/completions (streaming or not, n choices, tool calls, reasoning,
// log-probabilities), /v1/models, /tokenize, /detokenize, /health, /metrics.
// Each request is validated, submitted to the ServingEngine and answered from
// its token events; a client that goes away cancels its request. A request
// the engine fails is answered with OpenAI's error JSON (see complete()).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "engine/serving.h"

namespace dflash::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (printed at start-up)
  std::string api_key;              // non-empty: "Authorization: Bearer <key>" required on /v1/*
  std::string model_name;           // what /v1/models lists and requests must name
  std::string tokenizer_dir;        // tokenizer.json and the chat template
  std::string chat_template_file;   // non-empty: this template instead of the directory's
  int n_threads = 4096;             // connections served at once (a thread each, started as they come)
  size_t max_body_bytes = 4u << 20;  // larger bodies get 413
  int read_timeout_s = 20;          // a client that stops sending is dropped
  std::string tool_call_parser = "auto";  // auto | hermes | llama3_json | none (auto: from the chat template)
  std::string reasoning_parser = "auto";  // auto | on | off (auto: on when the chat template writes <think>)
};

// What the server uses of an engine: ServingEngine in `dflash serve`, a
// scripted engine in tests (which can fail a request on demand).
class EngineApi {
 public:
  virtual ~EngineApi() = default;
  virtual uint64_t submit(RequestParams params, ServingEngine::Callback on_event) = 0;
  virtual void cancel(uint64_t id) = 0;
  virtual ServingStats stats() const = 0;
  virtual int max_positions() const = 0;
};

class HttpServer {
 public:
  HttpServer(ServingEngine& engine, const ServerOptions& opts);
  HttpServer(EngineApi& engine, const ServerOptions& opts);
  ~HttpServer();
  // Binds and serves until stop(); calls on_listening(port) once, when it accepts requests (after one
  // request of its own, which starts its worker threads). Throws Error when it cannot bind.
  void run(const std::function<void(int)>& on_listening);
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::server
