#include "server/http_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "engine/sampling.h"
#include "formats/chat_template.h"
#include "formats/model_config.h"
#include "server/connection_threads.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "server/reasoning.h"
#include "server/server_sockets.h"
#include "server/openai_response.h"
#include "server/tokenize.h"
#include "server/text_stream.h"
#include "tokenizer/tokenizer.h"
#include "util/error.h"

namespace dflash::server {

namespace {

using Clock = std::chrono::steady_clock;
// JSON text; bytes that are not UTF-8 (none are expected) become U+FFFD instead of throwing.
std::string to_text(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Token events of one request's choices, handed from the engine thread to the HTTP thread.
struct Channel {
  using Item = std::pair<int, TokenEvent>;  // choice index, event
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Item> events;

  void push(int choice, const TokenEvent& e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      events.emplace_back(choice, e);
    }
    cv.notify_all();
  }
  // Waits up to `timeout` for the next event.
  std::optional<Item> pop(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_for(lk, timeout, [&] { return !events.empty(); })) return std::nullopt;
    Item e = std::move(events.front());
    events.pop_front();
    return e;
  }
};

// One choice in flight: its engine request, output assembly and stream state.
struct Choice {
  uint64_t engine_id = 0;
  std::unique_ptr<ChoiceOutput> out;
  std::string finish_reason;  // set when it ended normally
  bool done = false;
  ChunkState chunks;
};

// What an event changed for one choice: the delta to send, and its finish_reason once it ended.
struct Update {
  int index = 0;
  ChoiceDelta delta;
  std::string finish_reason;
};

// One request in flight: its choices, usage, timing and outcome.
struct Generation {
  std::shared_ptr<Channel> channel = std::make_shared<Channel>();
  std::vector<Choice> choices;
  Usage usage;
  std::string error;          // failed: the engine's message
  Clock::time_point start = Clock::now(), first_token, last_token;
  int n_tokens = 0, n_events = 0, n_done = 0;
  bool failed = false, cancelled = false;
  bool counted = false;  // in /metrics (before its last bytes, so a client that reads them sees it)

  bool done() const { return failed || cancelled || n_done == static_cast<int>(choices.size()); }

  // Applies an event of choice `index`. A choice that ends on the server's side (a stop string,
  // its first tool call without parallel calls) is cancelled in the engine.
  Update apply(int index, const TokenEvent& e, Metrics& metrics, EngineApi& engine) {
    ++n_events;
    Choice& c = choices[static_cast<size_t>(index)];
    Update u;
    u.index = index;
    if (c.done || done()) return u;  // e.g. the cancellation of a choice that ended already
    for (size_t i = 0; i < e.tokens.size() && !c.out->ended(); ++i) {
      if (n_tokens++ == 0) {
        first_token = Clock::now();
        metrics.first_token(seconds_since(start));
      }
      last_token = Clock::now();
      ++usage.completion_tokens;
      const ChoiceDelta d = c.out->push(e.tokens[i], i < e.logprobs.size() ? &e.logprobs[i] : nullptr);
      append_delta(u.delta, d);
    }
    if (c.out->ended()) {
      c.finish_reason = c.out->n_calls() > 0 ? "tool_calls" : "stop";
      if (!e.finished) engine.cancel(c.engine_id);
    } else if (e.finished) {
      if (auto reason = finish_reason_text(e.finish_reason)) {
        append_delta(u.delta, c.out->finish());
        c.finish_reason = *reason == "stop" && c.out->n_calls() > 0 ? "tool_calls" : *reason;
      } else if (e.finish_reason == FinishReason::Error) {
        failed = true;
        error = e.error.empty() ? "the engine failed this request" : e.error;
      } else {
        cancelled = true;
      }
      if (failed || cancelled) {
        for (const Choice& other : choices)
          if (!other.done && &other != &c) engine.cancel(other.engine_id);
      }
    }
    if (!c.finish_reason.empty()) {
      c.done = true;
      ++n_done;
      u.finish_reason = c.finish_reason;
    }
    if (done() && !failed && !cancelled && n_tokens > 1)
      metrics.per_output_token(std::chrono::duration<double>(last_token - first_token).count() / (n_tokens - 1));
    return u;
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
  std::atomic<bool> stop_requested{false};  // stop() was called (maybe before the server ran)
  int listen_socket = -1;                    // the socket bind_to_port bound last
  int bound_port = 0;
  // Clients with a request in flight (peer_name), from the request's routing to its logging, which
  // comes once the response has been written.
  std::mutex busy_mu;
  std::multiset<std::string> busy_peers;
  bool busy(const std::string& peer) {
    std::lock_guard<std::mutex> lk(busy_mu);
    return busy_peers.count(peer) > 0;
  }
  // A fresh seed for a sampled request that names none.
  uint64_t seeds() {
    std::lock_guard<std::mutex> lk(seed_mu);
    return seed_gen();
  }
  const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch()).count();

  Impl(std::unique_ptr<EngineApi> owned, EngineApi& e, const ServerOptions& o)
      : owned_engine(std::move(owned)), engine(e), opts(o), tokenizer(o.tokenizer_dir) {
    if (!o.chat_template_file.empty()) {
      chat_template = std::make_unique<ChatTemplate>(o.tokenizer_dir, o.chat_template_file);  // errors are fatal
    } else {
      try {
        chat_template = std::make_unique<ChatTemplate>(o.tokenizer_dir);
      } catch (const Error&) {
        chat_template.reset();  // completions only
      }
    }
    ctx.tokenizer = &tokenizer;
    ctx.chat_template = chat_template.get();
    ctx.model_name = o.model_name;
    ctx.max_positions = e.max_positions();
    ctx.default_sampling = default_sampling(load_generation_config(o.tokenizer_dir));
    const std::string source = chat_template ? chat_template->source() : std::string();
    ctx.tool_format = parse_tool_call_format(o.tool_call_parser, source);
    // Reasoning is split where the template writes think blocks (Qwen3 and its kind).
    check(o.reasoning_parser == "auto" || o.reasoning_parser == "on" || o.reasoning_parser == "off",
          "unknown reasoning parser '", o.reasoning_parser, "' (auto | on | off)");
    ctx.reasoning = o.reasoning_parser == "on" ||
                    (o.reasoning_parser == "auto" && source.find(std::string(kThinkOpen)) != std::string::npos);
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
    svr.set_socket_options([this](socket_t sock) {
      reuse_address(sock);
      listen_socket = sock;
    });
    const int n_threads = opts.n_threads;
    svr.new_task_queue = [this, n_threads] {
      auto* threads = new ConnectionThreads(static_cast<size_t>(n_threads));
      threads->end_idle = [this] {
        end_idle_connections(bound_port, [this](const std::string& peer) { return busy(peer); });
      };
      return threads;
    };
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response&) {
      std::lock_guard<std::mutex> lk(busy_mu);
      busy_peers.insert(peer_name(req.remote_addr, req.remote_port));
      return httplib::Server::HandlerResponse::Unhandled;
    });
    svr.set_logger([this](const httplib::Request& req, const httplib::Response&) {
      std::lock_guard<std::mutex> lk(busy_mu);
      auto it = busy_peers.find(peer_name(req.remote_addr, req.remote_port));
      if (it != busy_peers.end()) busy_peers.erase(it);
    });
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
    auto tokenizing = [this](const std::string& endpoint, nlohmann::json (*answer)(const std::string&, const ProtocolContext&)) {
      return [this, endpoint, answer](const httplib::Request& req, httplib::Response& res) {
        if (authorized(req, res)) {
          try {
            res.set_content(to_text(answer(req.body, ctx)), "application/json");
          } catch (const ApiError& e) {
            send_error(res, e.status, e.what(), e.type, e.param);
          }
        }
        metrics.request_finished(endpoint, res.status < 0 ? 200 : res.status);
      };
    };
    svr.Post("/tokenize", tokenizing("/tokenize", tokenize_response));
    svr.Post("/detokenize", tokenizing("/detokenize", detokenize_response));
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
    gen->usage.prompt_tokens = static_cast<int>(cr.prompt_ids.size());  // once, as OpenAI counts it
    if (!submit_choices(cr, *gen)) {
      send_error(res, 400, gen->error, "invalid_request_error");
      return answered();
    }
    ResponseHead head;
    head.chat = chat;
    head.id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(next_id++);
    head.model = opts.model_name;
    head.created = created;
    head.logprobs = cr.logprobs;
    head.tokenizer = &tokenizer;

    std::vector<Update> held;  // updates that arrived while the status line was held
    const double min_hold_s = cr.stream ? 0 : kHeartbeatS;
    while (!gen->done() && seconds_since(gen->start) < kHoldStatusMaxS &&
           (gen->n_events == 0 || seconds_since(gen->start) < min_hold_s)) {
      if (auto e = gen->channel->pop(std::chrono::milliseconds(50)))
        held.push_back(gen->apply(e->first, e->second, metrics, engine));
    }
    if (gen->done() && (gen->failed || gen->cancelled || !cr.stream)) {
      if (gen->failed) {
        metrics.request_failed(endpoint);
        send_error(res, 500, gen->error, "server_error");
      } else if (gen->cancelled) {
        send_error(res, 503, "the request was cancelled: the server is stopping", "server_error");
      } else {
        res.set_content(to_text(final_response(head, *gen)), "application/json");
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
      if (!success || !gen->done())
        for (const Choice& c : gen->choices) engine.cancel(c.engine_id);
      count();
    };
    if (!cr.stream) {
      // While it is generated, a space each second (JSON allows leading
      // whitespace) shows whether the client is still there: one that went
      // away gets its request cancelled and its pages freed.
      res.set_chunked_content_provider(
          "application/json",
          [this, gen, head, count, beat = Clock::now()](size_t, httplib::DataSink& sink) mutable {
            while (!gen->done()) {
              if (auto e = gen->channel->pop(std::chrono::milliseconds(200))) gen->apply(e->first, e->second, metrics, engine);
              if (seconds_since(beat) >= kHeartbeatS) {
                beat = Clock::now();
                if (!sink.write(" ", 1)) return false;
              }
            }
            if (gen->cancelled) return false;  // the client went away: nothing to send
            count();
            const std::string body =
                gen->failed ? error_json(gen->error, "server_error", "") : to_text(final_response(head, *gen));
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
        [this, gen, head, include_usage, count, pending = std::move(held), first = true](
            size_t, httplib::DataSink& sink) mutable {
          auto send_data = [&](const std::string& json_text) {
            const std::string s = "data: " + json_text + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto send = [&](const Update& u) {
            Choice& c = gen->choices[static_cast<size_t>(u.index)];
            for (const auto& chunk : completion_chunks(head, u.index, u.delta, u.finish_reason, c.chunks))
              if (!send_data(to_text(chunk))) return false;
            return true;
          };
          if (first) {
            first = false;
            for (size_t i = 0; i < gen->choices.size(); ++i)  // the assistant role first, in choice order
              if (head.chat && !send(Update{static_cast<int>(i), {}, {}})) return false;
            for (const Update& u : pending)
              if (!send(u)) return false;
          }
          while (!gen->done()) {
            auto e = gen->channel->pop(std::chrono::milliseconds(200));
            if (!e) {
              if (!sink.is_writable()) return false;  // the client went away while nothing was generated
              continue;
            }
            if (!send(gen->apply(e->first, e->second, metrics, engine))) return false;
          }
          if (gen->cancelled) return false;  // the client went away: nothing to send
          count();
          if (gen->failed) {
            if (!send_data(error_json(gen->error, "server_error", ""))) return false;
          } else if (include_usage && !send_data(to_text(usage_chunk(head, gen->usage)))) {
            return false;
          }
          if (!send_data("[DONE]")) return false;
          sink.done();
          return true;
        },
        on_release);
  }

  // Submits one engine request per choice (choice i samples with seed + i; choices after the
  // first share the prompt's pages). False, with gen.error, when the engine refuses one.
  bool submit_choices(const CompletionRequest& cr, Generation& gen) {
    RequestParams rp;
    rp.prompt = cr.prompt_ids;
    rp.max_tokens = cr.max_tokens;
    rp.extra_eos = cr.extra_eos;
    rp.sampling = cr.sampling;
    rp.ignore_eos = cr.ignore_eos;
    rp.logprobs = cr.logprobs;
    const uint64_t seed = cr.has_seed ? cr.sampling.seed : seeds();
    const std::string call_prefix = random_call_prefix();
    for (int i = 0; i < cr.n; ++i) {
      Choice c;
      OutputOptions oo = cr.output;
      oo.call_id_prefix = call_prefix + std::to_string(i) + "_";
      c.out = std::make_unique<ChoiceOutput>(tokenizer, oo);
      gen.choices.push_back(std::move(c));
    }
    for (int i = 0; i < cr.n; ++i) {
      rp.sampling.seed = seed + static_cast<uint64_t>(i);
      rp.share_prefix_with = i > 0 ? gen.choices[0].engine_id : 0;
      try {
        auto channel = gen.channel;
        gen.choices[static_cast<size_t>(i)].engine_id =
            engine.submit(rp, [channel, i](const TokenEvent& e) { channel->push(i, e); });
      } catch (const Error& e) {
        for (int k = 0; k < i; ++k) engine.cancel(gen.choices[static_cast<size_t>(k)].engine_id);
        gen.error = e.what();
        return false;
      }
    }
    return true;
  }

  // "call_" and 16 random hex digits: tool call ids unique across requests.
  std::string random_call_prefix() {
    char buf[40];
    std::snprintf(buf, sizeof buf, "call_%016llx_", static_cast<unsigned long long>(seeds()));
    return buf;
  }

  nlohmann::json final_response(const ResponseHead& head, const Generation& gen) const {
    std::vector<FinishedChoice> list;
    for (const Choice& c : gen.choices) list.push_back({&c.out->total(), c.finish_reason});
    return completion_response(head, list, gen.usage);
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
    check(impl_->svr.bind_to_port(impl_->opts.host, port), bind_error(impl_->opts.host, port));
  }
  // cpp-httplib listens with a backlog of 5. A burst of clients connecting at once (a benchmark's
  // 32) overflows it before the accepting thread drains it, and the kernel drops their handshakes,
  // which clients repeat only after a second: those requests started a second late
  // (bench/results/serving_h200x2_qwen3-8b-shape_tp1_listen_backlog.txt). The bound socket listens
  // again with the system's largest backlog.
  impl_->bound_port = port;
  check(::listen(impl_->listen_socket, SOMAXCONN) == 0, "cannot listen on ", impl_->opts.host, ":", port, ": ",
        std::strerror(errno));
  // The first exchange of a fresh server starts its worker threads and request path: about 4 ms
  // to accept the first connection and 5-7 ms more before its handler ran (H200, 8B shape:
  // bench/results/ttft_h200_qwen3-8b-shape_timeline.txt). A helper thread asks the server for
  // /health once it accepts, and only then calls on_listening, so that its first client's request
  // is as fast as the later ones. on_listening is called exactly once, also when the server stops
  // or fails to listen first; what it throws stops the server and is rethrown here.
  std::atomic<bool> listen_ended{false};
  std::exception_ptr failure;
  std::thread announcer([&] {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!impl_->svr.is_running() && !listen_ended && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    try {
      if (impl_->stop_requested) impl_->svr.stop();  // a stop() that came before the server ran
      if (impl_->svr.is_running()) {
        const std::string& h = impl_->opts.host;
        httplib::Client self(h == "0.0.0.0" ? "127.0.0.1" : h == "::" ? "::1" : h, port);
        self.set_connection_timeout(10);
        self.Get("/health");
      }
      on_listening(port);
    } catch (...) {
      failure = std::current_exception();
      impl_->stop_requested = true;
      while (!listen_ended) {  // stop() does nothing until the server runs
        impl_->svr.stop();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  });
  impl_->svr.listen_after_bind();
  listen_ended = true;
  announcer.join();
  if (failure) std::rethrow_exception(failure);
}

void HttpServer::stop() {
  impl_->stop_requested = true;  // run() stops the server once it runs, if this came before
  impl_->svr.stop();
}

}  // namespace dflash::server
