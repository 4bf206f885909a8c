#include "server/http_server.h"

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <utility>

#include "engine/sampling.h"
#include "formats/chat_template.h"
#include "formats/model_config.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "server/text_stream.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace dflash::server {

namespace {

using Clock = std::chrono::steady_clock;
// JSON text; bytes that are not UTF-8 (none are expected) become U+FFFD instead of throwing.
std::string to_text(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Token events of one request, handed from the engine thread to the HTTP thread.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<TokenEvent> events;

  void push(const TokenEvent& e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      events.push_back(e);
    }
    cv.notify_all();
  }
  // Waits up to `timeout` for the next event.
  std::optional<TokenEvent> pop(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_for(lk, timeout, [&] { return !events.empty(); })) return std::nullopt;
    TokenEvent e = std::move(events.front());
    events.pop_front();
    return e;
  }
};

// One request in flight: engine id, text assembly, usage, timing and outcome.
struct Generation {
  std::shared_ptr<Channel> channel = std::make_shared<Channel>();
  uint64_t engine_id = 0;
  std::unique_ptr<TextStream> text;
  Usage usage;
  std::string finish_reason;  // "stop" or "length" when it ended normally
  std::string error;          // failed: the engine's message
  Clock::time_point start = Clock::now(), first_token, last_token;
  int n_tokens = 0, n_events = 0;
  bool done = false, failed = false, cancelled = false;
  bool counted = false;  // in /metrics (before its last bytes, so a client that reads them sees it)

  // Applies an event; returns the text that became sendable.
  std::string apply(const TokenEvent& e, Metrics& metrics) {
    ++n_events;
    std::string out;
    for (int32_t t : e.tokens) {
      if (text->stopped()) break;
      if (n_tokens++ == 0) {
        first_token = Clock::now();
        metrics.first_token(seconds_since(start));
      }
      last_token = Clock::now();
      ++usage.completion_tokens;
      out += text->push(t);
    }
    if (text->stopped()) {
      finish_reason = "stop";  // a stop string
      done = true;
    } else if (e.finished) {
      done = true;
      if (auto reason = finish_reason_text(e.finish_reason)) {
        out += text->finish();
        finish_reason = *reason;
      } else if (e.finish_reason == FinishReason::Error) {
        failed = true;
        error = e.error.empty() ? "the engine failed this request" : e.error;
      } else {
        cancelled = true;
      }
    }
    if (done && !failed && !cancelled && n_tokens > 1)
      metrics.per_output_token(std::chrono::duration<double>(last_token - first_token).count() / (n_tokens - 1));
    return out;
  }
};

// ServingEngine as the server's EngineApi.
class ServingEngineApi : public EngineApi {
 public:
  explicit ServingEngineApi(ServingEngine& e) : e_(e) {}
  uint64_t submit(RequestParams p, ServingEngine::Callback cb) override { return e_.submit(std::move(p), std::move(cb)); }
  void cancel(uint64_t id) override { e_.cancel(id); }
  ServingStats stats() const override { return e_.stats(); }
  int max_positions() const override { return e_.target_config().max_positions; }

 private:
  ServingEngine& e_;
};

// How long a response holds back its status line waiting for the first event,
// so that a request failing in its prefill gets a real HTTP 500. While it is
// held, a client that goes away is not noticed.
constexpr double kHoldStatusMaxS = 30;
// A non-streaming response also holds it for its first heartbeat interval:
// short generations get their final status (200 or 500) and a plain body.
constexpr double kHeartbeatS = 1;

}  // namespace

struct HttpServer::Impl {
  std::unique_ptr<EngineApi> owned_engine;  // the adapter for a ServingEngine
  EngineApi& engine;
  ServerOptions opts;
  Tokenizer tokenizer;
  std::unique_ptr<ChatTemplate> chat_template;
  ProtocolContext ctx;
  Metrics metrics;
  httplib::Server svr;
  std::atomic<uint64_t> next_id{1};
  std::mutex seed_mu;
  std::mt19937_64 seed_gen{std::random_device{}()};
  // A fresh seed for a sampled request that names none.
  uint64_t seeds() {
    std::lock_guard<std::mutex> lk(seed_mu);
    return seed_gen();
  }
  const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();

  Impl(std::unique_ptr<EngineApi> owned, EngineApi& e, const ServerOptions& o)
      : owned_engine(std::move(owned)), engine(e), opts(o), tokenizer(o.tokenizer_dir) {
    try {
      chat_template = std::make_unique<ChatTemplate>(o.tokenizer_dir);
    } catch (const Error&) {
      chat_template.reset();  // completions only
    }
    ctx.tokenizer = &tokenizer;
    ctx.chat_template = chat_template.get();
    ctx.model_name = o.model_name;
    ctx.max_positions = e.max_positions();
    ctx.default_sampling = default_sampling(load_generation_config(o.tokenizer_dir));
    if (chat_template && chat_template->eos_token()) {
      if (auto id = tokenizer.token_to_id(*chat_template->eos_token())) ctx.chat_eos.push_back(*id);
    }
    routes();
  }

  void send_error(httplib::Response& res, int status, const std::string& message, const std::string& type,
                  const std::string& param = {}) {
    res.status = status;
    res.set_content(error_json(message, type, param), "application/json");
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (opts.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + opts.api_key) return true;
    send_error(res, 401, "missing or wrong API key (send 'Authorization: Bearer <key>')", "authentication_error");
    return false;
  }

  void routes() {
    svr.set_payload_max_length(opts.max_body_bytes);
    svr.set_read_timeout(opts.read_timeout_s, 0);
    svr.set_write_timeout(opts.read_timeout_s, 0);
    // Idle keep-alive connections stay open longer than clients keep them pooled, so a client
    // never reuses a connection the server has just closed.
    svr.set_keep_alive_timeout(75);
    svr.set_keep_alive_max_count(1000);
    const int n_threads = opts.n_threads;
    svr.new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
    svr.set_error_handler([this](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 413) {
        send_error(res, 413, "the request body exceeds " + std::to_string(opts.max_body_bytes) + " bytes",
                   "invalid_request_error");
      } else if (res.status == 404) {
        send_error(res, 404, "no such endpoint", "not_found_error");
      } else {
        send_error(res, res.status,
                   res.status == 400 ? "malformed or incomplete HTTP request (a body must arrive within " +
                                           std::to_string(opts.read_timeout_s) + " s)"
                                     : "request failed with HTTP status " + std::to_string(res.status),
                   "invalid_request_error");
      }
    });
    svr.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      send_error(res, 500, what, "server_error");
    });
    svr.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("{\"status\":\"ok\"}", "application/json");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics.render(engine.stats(), opts.model_name), "text/plain; version=0.0.4");
    });
    svr.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      if (!authorized(req, res)) return;
      const nlohmann::json m = {{"id", opts.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "dflash"},
                                {"max_model_len", ctx.max_positions}};
      res.set_content(to_text(nlohmann::json{{"object", "list"}, {"data", {m}}}), "application/json");
    });
    svr.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(req, res, false, "/v1/completions");
    });
    svr.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      complete(req, res, true, "/v1/chat/completions");
    });
  }

  // Answers a completion request: one JSON body, or server-sent events when
  // streaming. The status line waits for the request's first event (up to
  // kHoldStatusMaxS; a non-streaming one also for its first heartbeat
  // interval), so a request that fails by then gets HTTP 500 with OpenAI's
  // error JSON. A failure after a 200 status line ends the response with the
  // error instead: a non-streaming body is then the error JSON (after the
  // heartbeat spaces, still valid JSON); a stream gets `data: {"error": ...}`
  // and `data: [DONE]`. /metrics counts a request when its response ends.
  void complete(const httplib::Request& req, httplib::Response& res, bool chat, const std::string& endpoint) {
    auto answered = [&] { metrics.request_finished(endpoint, res.status < 0 ? 200 : res.status); };
    if (!authorized(req, res)) return answered();
    CompletionRequest cr;
    try {
      cr = parse_completion_request(req.body, chat, ctx);
    } catch (const ApiError& e) {
      send_error(res, e.status, e.what(), e.type, e.param);
      return answered();
    }
    auto gen = std::make_shared<Generation>();
    gen->usage.prompt_tokens = static_cast<int>(cr.prompt_ids.size());
    gen->text = std::make_unique<TextStream>(tokenizer, cr.stop);
    RequestParams rp;
    rp.prompt = cr.prompt_ids;
    rp.max_tokens = cr.max_tokens;
    rp.extra_eos = cr.extra_eos;
    rp.sampling = cr.sampling;
    if (!cr.has_seed) rp.sampling.seed = seeds();
    try {
      auto channel = gen->channel;
      gen->engine_id = engine.submit(rp, [channel](const TokenEvent& e) { channel->push(e); });
    } catch (const Error& e) {
      send_error(res, 400, e.what(), "invalid_request_error");
      return answered();
    }
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);

    std::string held;  // text generated while the status line was held
    const double min_hold_s = cr.stream ? 0 : kHeartbeatS;
    while (!gen->done && seconds_since(gen->start) < kHoldStatusMaxS &&
           (gen->n_events == 0 || seconds_since(gen->start) < min_hold_s)) {
      if (auto e = gen->channel->pop(std::chrono::milliseconds(50))) held += gen->apply(*e, metrics);
    }
    if (gen->done && (gen->failed || gen->cancelled || !cr.stream)) {
      if (gen->text->stopped()) engine.cancel(gen->engine_id);
      if (gen->failed) {
        metrics.request_failed(endpoint);
        send_error(res, 500, gen->error, "server_error");
      } else if (gen->cancelled) {
        send_error(res, 503, "the request was cancelled: the server is stopping", "server_error");
      } else {
        res.set_content(to_text(completion_response(chat, id, opts.model_name, created, held, gen->finish_reason,
                                                    gen->usage)),
                        "application/json");
      }
      return answered();
    }

    // The status line goes out as 200. When the response ends early (the client
    // went away), the request stops and frees its pages.
    auto count = [this, gen, endpoint] {
      if (std::exchange(gen->counted, true)) return;
      if (gen->failed) metrics.request_failed(endpoint);
      metrics.request_finished(endpoint, gen->failed ? 500 : 200);
    };
    auto on_release = [this, gen, count](bool success) {
      if (!success || !gen->done) engine.cancel(gen->engine_id);
      count();
    };
    if (!cr.stream) {
      // While it is generated, a space each second (JSON allows leading
      // whitespace) shows whether the client is still there: one that went
      // away gets its request cancelled and its pages freed.
      res.set_chunked_content_provider(
          "application/json",
          [this, gen, id, chat, count, text = std::move(held), beat = Clock::now()](size_t,
                                                                                   httplib::DataSink& sink) mutable {
            while (!gen->done) {
              if (auto e = gen->channel->pop(std::chrono::milliseconds(200))) text += gen->apply(*e, metrics);
              if (seconds_since(beat) >= kHeartbeatS) {
                beat = Clock::now();
                if (!sink.write(" ", 1)) return false;
              }
            }
            if (gen->cancelled) return false;  // the client went away: nothing to send
            if (gen->text->stopped()) engine.cancel(gen->engine_id);
            count();
            const std::string body =
                gen->failed ? error_json(gen->error, "server_error", "")
                            : to_text(completion_response(chat, id, opts.model_name, created, text, gen->finish_reason,
                                                          gen->usage));
            if (!sink.write(body.data(), body.size())) return false;
            sink.done();
            return true;
          },
          on_release);
      return;
    }
    const bool include_usage = cr.include_usage;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, gen, id, chat, include_usage, count, pending = std::move(held), first = true](
            size_t, httplib::DataSink& sink) mutable {
          auto send_data = [&](const std::string& json_text) {
            const std::string s = "data: " + json_text + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto send = [&](const nlohmann::json& j) { return send_data(to_text(j)); };
          if (first) {
            first = false;
            if (chat && !send(completion_chunk(true, id, opts.model_name, created, "", "", true))) return false;
            if (!pending.empty() && !send(completion_chunk(chat, id, opts.model_name, created, pending, "", false)))
              return false;
          }
          while (!gen->done) {
            auto e = gen->channel->pop(std::chrono::milliseconds(200));
            if (!e) {
              if (!sink.is_writable()) return false;  // the client went away while nothing was generated
              continue;
            }
            const std::string text = gen->apply(*e, metrics);
            if (!text.empty() && !send(completion_chunk(chat, id, opts.model_name, created, text, "", false)))
              return false;
          }
          if (gen->cancelled) return false;  // the client went away: nothing to send
          count();
          if (gen->failed) {
            if (!send_data(error_json(gen->error, "server_error", ""))) return false;
          } else {
            if (gen->text->stopped()) engine.cancel(gen->engine_id);
            if (!send(completion_chunk(chat, id, opts.model_name, created, "", gen->finish_reason, false))) return false;
            if (include_usage && !send(usage_chunk(chat, id, opts.model_name, created, gen->usage))) return false;
          }
          if (!send_data("[DONE]")) return false;
          sink.done();
          return true;
        },
        on_release);
  }
};

HttpServer::HttpServer(ServingEngine& engine, const ServerOptions& opts) {
  auto api = std::make_unique<ServingEngineApi>(engine);
  EngineApi& ref = *api;
  impl_ = std::make_unique<Impl>(std::move(api), ref, opts);
}
HttpServer::HttpServer(EngineApi& engine, const ServerOptions& opts)
    : impl_(std::make_unique<Impl>(nullptr, engine, opts)) {}
HttpServer::~HttpServer() = default;

void HttpServer::run(const std::function<void(int)>& on_listening) {
  int port = impl_->opts.port;
  if (port == 0) {
    port = impl_->svr.bind_to_any_port(impl_->opts.host);
    check(port > 0, "cannot bind to ", impl_->opts.host, " (any port)");
  } else {
    check(impl_->svr.bind_to_port(impl_->opts.host, port), "cannot bind to ", impl_->opts.host, ":", port,
          " (in use, or not an address of this machine)");
  }
  on_listening(port);
  impl_->svr.listen_after_bind();
}

void HttpServer::stop() { impl_->svr.stop(); }

}  // namespace dflash::server
