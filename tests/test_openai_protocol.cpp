// The OpenAI protocol layer: request validation (nesting depth, roles,
// malformed parts) with the Qwen3 tokenizer and template, and the HTTP
// server's answers to how a request ends, driven by a scripted engine:
// a failure is a 500 (or, after a 200 status line, an error body or stream
// event), never a normal "stop", and /metrics counts it.
#include <gtest/gtest.h>

#include <httplib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#include "formats/chat_template.h"
#include "server/http_server.h"
#include "server/openai_protocol.h"
#include "server/reasoning.h"
#include "server/server_sockets.h"
#include "server/tool_calls.h"
#include "tokenizer/tokenizer.h"

namespace dflash::server {
namespace {

using nlohmann::json;

std::string qwen3_dir() { return std::string(DFLASH_GENERATED_FIXTURES) + "/qwen3"; }

struct Protocol : ::testing::Test {
  static void SetUpTestSuite() {
    tok = new Tokenizer(qwen3_dir());
    tmpl = new ChatTemplate(qwen3_dir());
  }
  static void TearDownTestSuite() {
    delete tmpl;
    delete tok;
  }
  ProtocolContext ctx() const {
    ProtocolContext c;
    c.tokenizer = tok;
    c.chat_template = tmpl;
    c.model_name = "m";
    c.max_positions = 4096;
    return c;
  }
  // The ApiError a body gets; fails the test when it is accepted.
  ApiError refusal(const std::string& body, bool chat) const {
    try {
      parse_completion_request(body, chat, ctx());
    } catch (const ApiError& e) {
      return e;
    }
    ADD_FAILURE() << "accepted: " << body.substr(0, 200);
    return ApiError(0, "");
  }
  static Tokenizer* tok;
  static ChatTemplate* tmpl;
};
Tokenizer* Protocol::tok = nullptr;
ChatTemplate* Protocol::tmpl = nullptr;

std::string nested(size_t depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

TEST(JsonDepth, CountsArraysAndObjectsNotStrings) {
  EXPECT_FALSE(json_depth_exceeds("{\"a\": [1, {\"b\": []}]}", 4));
  EXPECT_TRUE(json_depth_exceeds("{\"a\": [1, {\"b\": []}]}", 3));
  EXPECT_FALSE(json_depth_exceeds("\"[[[[[[\"", 1));
  EXPECT_FALSE(json_depth_exceeds(R"(["\"[[[[", "\\", "[[[["])", 1));  // escaped quotes and backslashes
  EXPECT_TRUE(json_depth_exceeds(R"(["\\", [[1]]])", 2));             // "\\" ends its string
  EXPECT_FALSE(json_depth_exceeds(nested(128), 128));
  EXPECT_TRUE(json_depth_exceeds(nested(129), 128));
  EXPECT_FALSE(json_depth_exceeds("]]]][[[[", 2));  // the parser stops at the stray closer
}

// The request that crashed `dflash serve` (stack overflow): 100,000 levels in 200 KB.
TEST_F(Protocol, DeepNestingIsRefusedBeforeParsing) {
  const ApiError e = refusal("{\"prompt\":" + nested(100000, "") + "}", false);
  EXPECT_EQ(e.status, 400);
  EXPECT_NE(std::string(e.what()).find("128 levels"), std::string::npos) << e.what();
  EXPECT_EQ(refusal("{\"prompt\": \"a\", \"stop\": " + nested(20000, "\"x\"") + "}", false).status, 400);
  EXPECT_EQ(refusal("{\"messages\": [{\"role\": \"user\", \"content\": " + nested(5000, "") + "}]}", true).status, 400);
}

TEST_F(Protocol, NestingWithinTheLimitIsAccepted) {
  // A tool schema nested 100 levels deep renders like any other.
  json schema = {{"type", "string"}};
  for (int i = 0; i < 48; ++i) schema = {{"type", "object"}, {"properties", {{"x", schema}}}};
  const json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", schema}}}}}},
                     {"max_tokens", 4}};
  ASSERT_FALSE(json_depth_exceeds(body.dump(), kMaxJsonDepth));
  EXPECT_GT(parse_completion_request(body.dump(), true, ctx()).prompt_ids.size(), 10u);
  // Brackets inside strings are text.
  const auto r = parse_completion_request("{\"prompt\": \"" + nested(1000) + "\"}", false, ctx());
  EXPECT_FALSE(r.prompt_ids.empty());
}

TEST_F(Protocol, UnknownRolesAreRefused) {
  const ApiError e = refusal(R"({"messages": [{"role": "user", "content": "a"}, {"role": "bogus", "content": "x"}]})", true);
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "messages[1].role");
  EXPECT_NE(std::string(e.what()).find("'bogus'"), std::string::npos) << e.what();
  for (const char* role : {"system", "developer", "user", "assistant", "tool", "function"}) {
    const json body = {{"messages", {{{"role", role}, {"content", "x"}}, {{"role", "user"}, {"content", "y"}}}}};
    try {
      parse_completion_request(body.dump(), true, ctx());
    } catch (const ApiError& err) {
      EXPECT_NE(err.param, "messages[0].role") << role;  // the template may refuse it; the role check does not
    }
  }
}

TEST_F(Protocol, MalformedContentPartsAreA400) {
  // A non-string "type" used to escape as a JSON type_error (HTTP 500).
  for (const char* part : {R"({"type": 1, "text": "a"})", R"({"type": null})", R"({"type": "image_url"})", "3"}) {
    const std::string body = std::string(R"({"messages": [{"role": "user", "content": [)") + part + "]}]}";
    EXPECT_EQ(refusal(body, true).status, 400) << part;
  }
}

TEST(FinishReason, MapsToOpenAIStrings) {
  EXPECT_EQ(finish_reason_text(FinishReason::Eos), "stop");
  EXPECT_EQ(finish_reason_text(FinishReason::Length), "length");
  EXPECT_EQ(finish_reason_text(FinishReason::Context), "length");
  EXPECT_EQ(finish_reason_text(FinishReason::Cancelled), std::nullopt);
  EXPECT_EQ(finish_reason_text(FinishReason::Error), std::nullopt);
}

// An engine that answers every request with the events of `script`, each
// after its delay, on a thread of its own.
class ScriptedEngine : public EngineApi {
 public:
  struct Step {
    int delay_ms;
    TokenEvent event;
  };
  std::vector<Step> script;

  ~ScriptedEngine() override {
    for (auto& t : threads_) t.join();
  }
  uint64_t submit(RequestParams, ServingEngine::Callback on_event) override {
    std::lock_guard<std::mutex> lk(mu_);
    threads_.emplace_back([steps = script, on_event] {
      for (const auto& s : steps) {
        std::this_thread::sleep_for(std::chrono::milliseconds(s.delay_ms));
        on_event(s.event);
      }
    });
    return threads_.size();
  }
  void cancel(uint64_t) override {}
  ServingStats stats() const override { return {}; }
  int max_positions() const override { return 4096; }

 private:
  std::mutex mu_;
  std::vector<std::thread> threads_;
};

TokenEvent tokens(std::vector<int32_t> ids) {
  TokenEvent e;
  e.tokens = std::move(ids);
  return e;
}
TokenEvent finished(FinishReason r, std::string error = {}) {
  TokenEvent e;
  e.finished = true;
  e.finish_reason = r;
  e.error = std::move(error);
  return e;
}

struct Server : ::testing::Test {
  ScriptedEngine engine;
  std::unique_ptr<HttpServer> server;
  std::thread thread;
  std::unique_ptr<httplib::Client> client;
  std::vector<int32_t> hello;  // token ids of "Hello world"
  int port = 0;

  void SetUp() override {
    ServerOptions o;
    o.port = 0;
    o.model_name = "m";
    o.tokenizer_dir = qwen3_dir();
    static const std::vector<int32_t> ids = Tokenizer(qwen3_dir()).encode("Hello world");
    hello = ids;
    server = std::make_unique<HttpServer>(engine, o);
    std::promise<int> port;
    thread = std::thread([&] { server->run([&](int p) { port.set_value(p); }); });
    this->port = port.get_future().get();
    client = std::make_unique<httplib::Client>("127.0.0.1", this->port);
    client->set_read_timeout(30, 0);
  }
  void TearDown() override {
    server->stop();
    if (thread.joinable()) thread.join();
  }
  httplib::Result post(const json& body, bool chat = false) {
    return client->Post(chat ? "/v1/chat/completions" : "/v1/completions", body.dump(), "application/json");
  }
  std::string metrics() { return client->Get("/metrics")->body; }
  // The server's address, for raw sockets.
  sockaddr_in address() const {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }
};

// A burst of clients connecting at once: every handshake completes at once, whether or not the
// accepting thread has taken the earlier connections yet (a full listen queue drops handshakes,
// which a client repeats only after a second).
TEST_F(Server, ABurstOfConnectionsIsAcceptedAtOnce) {
  constexpr int kClients = 256;
  const sockaddr_in addr = address();
  std::vector<pollfd> socks;
  for (int i = 0; i < kClients; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ASSERT_GE(fd, 0);
    socks.push_back({fd, POLLOUT, 0});
    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    ASSERT_TRUE(rc == 0 || errno == EINPROGRESS) << std::strerror(errno);
  }
  // Connected sockets become writable; a dropped handshake leaves its socket waiting a second.
  int connected = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
  for (pollfd& p : socks) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          give_up - std::chrono::steady_clock::now()).count());
    int err = -1;
    socklen_t len = sizeof err;
    if (::poll(&p, 1, std::max(left, 0)) == 1 && (p.revents & POLLOUT) &&
        ::getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0)
      ++connected;
  }
  for (const pollfd& p : socks) ::close(p.fd);
  EXPECT_EQ(connected, kClients);
  auto r = client->Get("/health");  // and the server still answers
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// A second server on a port in use fails to start with a message naming the port, instead of
// sharing the port's connections with the first.
TEST_F(Server, ASecondServerOnThePortFailsToStart) {
  ServerOptions o;
  o.port = port;
  o.model_name = "m";
  o.tokenizer_dir = qwen3_dir();
  const std::string expected = "cannot bind to 127.0.0.1:" + std::to_string(port);
  try {
    check_can_bind("127.0.0.1", port);  // what serve asks before it loads the model
    ADD_FAILURE() << "check_can_bind took a port in use";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  HttpServer second(engine, o);
  try {
    // Announcing throws, so that a server that did start stops at once.
    second.run([](int) { throw std::runtime_error("the second server started"); });
    ADD_FAILURE() << "run returned";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  auto r = client->Get("/health");  // the first one goes on
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

// Connections that a client keeps open hold no thread that a new connection needs: with 300
// idle connections open (more than a fixed pool's threads), /health still answers at once.
TEST_F(Server, IdleConnectionsDoNotKeepOthersWaiting) {
  const sockaddr_in addr = address();
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server has taken them all
  httplib::Client probe("127.0.0.1", port);
  probe.set_connection_timeout(5, 0);
  probe.set_read_timeout(5, 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = probe.Get("/health");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int fd : idle) ::close(fd);
  ASSERT_TRUE(r) << "no answer in 5 s";
  EXPECT_EQ(r->status, 200);
  EXPECT_LT(s, 2.0);
}

// A stopping server does not wait for a kept-alive connection's next request (up to the 75 s
// keep-alive timeout): run() returns at once.
TEST_F(Server, StopsAtOnceWithAKeptAliveConnectionOpen) {
  const sockaddr_in addr = address();
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  const std::string get = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
  ASSERT_EQ(::write(fd, get.data(), get.size()), static_cast<ssize_t>(get.size()));
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf);  // the answer; the connection stays open
  ASSERT_GT(n, 0);
  EXPECT_EQ(std::string(buf, static_cast<size_t>(n)).rfind("HTTP/1.1 200", 0), 0u);
  const auto t0 = std::chrono::steady_clock::now();
  server->stop();
  thread.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  EXPECT_LT(s, 3.0);
}

// A stopping server lets a stream in flight finish, then ends its kept-alive connection.
TEST_F(Server, StoppingLetsAStreamInFlightFinish) {
  engine.script = {{0, tokens(hello)}, {1500, finished(FinishReason::Length)}};
  httplib::Client keep("127.0.0.1", port);
  keep.set_keep_alive(true);
  keep.set_read_timeout(30, 0);
  std::optional<httplib::Result> r;
  std::thread request([&] {
    r.emplace(keep.Post("/v1/completions", json{{"prompt", "hi"}, {"stream", true}}.dump(), "application/json"));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the stream has begun
  const auto t0 = std::chrono::steady_clock::now();
  server->stop();
  thread.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  request.join();
  ASSERT_TRUE(r && *r);
  const httplib::Response& res = r->value();
  EXPECT_EQ(res.status, 200);
  EXPECT_NE(res.body.find(R"("finish_reason":"length")"), std::string::npos) << res.body;
  EXPECT_NE(res.body.find("data: [DONE]"), std::string::npos) << res.body;
  EXPECT_GT(s, 0.8);  // it waited for the stream
  EXPECT_LT(s, 4.0);  // and not for the connection's keep-alive timeout
}

TEST_F(Server, EndsMapToStopAndLength) {
  for (auto [reason, text] : {std::pair{FinishReason::Eos, "stop"}, std::pair{FinishReason::Length, "length"},
                              std::pair{FinishReason::Context, "length"}}) {
    engine.script = {{0, tokens(hello)}, {0, finished(reason)}};
    auto r = post({{"prompt", "hi"}});
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    EXPECT_EQ(j["choices"][0]["finish_reason"], text);
    EXPECT_EQ(j["choices"][0]["text"], "Hello world");
  }
}

TEST_F(Server, AFailedPrefillIsA500WithTheEnginesMessage) {
  engine.script = {{20, finished(FinishReason::Error, "CUDA error: out of memory")}};
  for (bool stream : {false, true}) {
    auto r = post({{"prompt", "hi"}, {"stream", stream}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 500) << r->body;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["type"], "server_error");
    EXPECT_EQ(e["message"], "CUDA error: out of memory");
  }
  auto r = post({{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, true);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 500);
  const std::string m = metrics();
  EXPECT_NE(m.find("dflash_request_failures_total{endpoint=\"/v1/completions\"} 2"), std::string::npos) << m;
  EXPECT_NE(m.find("dflash_requests_total{endpoint=\"/v1/completions\",status=\"500\"} 2"), std::string::npos) << m;
  EXPECT_NE(m.find("dflash_request_failures_total{endpoint=\"/v1/chat/completions\"} 1"), std::string::npos) << m;
}

TEST_F(Server, AFailureAfterTheStatusLineEndsTheBodyWithTheError) {
  // Past the first heartbeat interval the status is committed as 200: the body
  // is the error JSON after the heartbeat spaces, which is still valid JSON.
  engine.script = {{0, tokens(hello)}, {1600, finished(FinishReason::Error, "step failed")}};
  auto r = post({{"prompt", "hi"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["error"]["message"], "step failed");
  EXPECT_EQ(j["error"]["type"], "server_error");
  EXPECT_FALSE(j.contains("choices"));
  EXPECT_NE(metrics().find("dflash_requests_total{endpoint=\"/v1/completions\",status=\"500\"} 1"), std::string::npos);
}

TEST_F(Server, AStreamThatFailsGetsAnErrorEventThenDone) {
  engine.script = {{0, tokens(hello)}, {50, finished(FinishReason::Error, "step failed")}};
  auto r = post({{"prompt", "hi"}, {"stream", true}, {"stream_options", {{"include_usage", true}}}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const std::string& b = r->body;
  const size_t text = b.find("\"text\":\"Hello world\"");
  const size_t error = b.find("data: {\"error\":{");
  const size_t done = b.find("data: [DONE]\n\n");
  ASSERT_NE(text, std::string::npos) << b;
  ASSERT_NE(error, std::string::npos) << b;
  ASSERT_NE(done, std::string::npos) << b;
  EXPECT_LT(text, error);
  EXPECT_LT(error, done);
  EXPECT_EQ(b.find("finish_reason\":\"stop"), std::string::npos) << b;  // not dressed up as success
  EXPECT_EQ(b.find("\"usage\""), std::string::npos) << b;
  const std::string event = b.substr(error + 6, b.find("\n\n", error) - error - 6);
  EXPECT_EQ(json::parse(event)["error"]["message"], "step failed");
  EXPECT_NE(metrics().find("dflash_request_failures_total{endpoint=\"/v1/completions\"} 1"), std::string::npos);
}

TEST_F(Server, AStreamThatEndsNormallyEndsWithItsFinishReason) {
  engine.script = {{0, tokens(hello)}, {30, finished(FinishReason::Context)}};
  auto r = post({{"prompt", "hi"}, {"stream", true}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("\"finish_reason\":\"length\""), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos);
  EXPECT_EQ(r->body.find("error"), std::string::npos);
}

TEST_F(Server, DeepNestingAndUnknownRolesAre400sAndTheServerGoesOn) {
  auto deep = client->Post("/v1/completions", "{\"prompt\":" + nested(100000, "") + "}", "application/json");
  ASSERT_TRUE(deep);
  EXPECT_EQ(deep->status, 400);
  EXPECT_NE(json::parse(deep->body)["error"]["message"].get<std::string>().find("128"), std::string::npos);
  auto role = post({{"messages", {{{"role", "bogus"}, {"content", "x"}}}}}, true);
  ASSERT_TRUE(role);
  EXPECT_EQ(role->status, 400);
  EXPECT_EQ(json::parse(role->body)["error"]["param"], "messages[0].role");
  engine.script = {{0, tokens(hello)}, {0, finished(FinishReason::Eos)}};
  auto ok = post({{"prompt", "hi"}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

}  // namespace
}  // namespace dflash::server

namespace dflash::server {
namespace {

// Every split of the output (one piece, or one character at a time) gives the same result.
template <typename Parser, typename Out, typename Merge>
Out feed(Parser& p, const std::string& text, size_t piece, Merge merge) {
  Out all;
  for (size_t i = 0; i < text.size(); i += piece) merge(all, p.push(std::string_view(text).substr(i, piece)));
  merge(all, p.finish());
  return all;
}

ReasoningSplitter::Split split(const std::string& text, bool open, size_t piece) {
  ReasoningSplitter r(open);
  return feed<ReasoningSplitter, ReasoningSplitter::Split>(r, text, piece, [](auto& a, const auto& b) {
    a.reasoning += b.reasoning;
    a.content += b.content;
  });
}

TEST(Reasoning, ThinkBlocksBecomeReasoningStreamedOrNot) {
  struct Case {
    std::string text;
    bool open;
    std::string reasoning, content;
  };
  const std::vector<Case> cases = {
      {"<think>\nLet me see.\n</think>\n\nThe answer is 4.", false, "Let me see.", "The answer is 4."},
      {"Let me see.\n</think>\n\n4", true, "Let me see.", "4"},  // the prompt opened the block
      {"No thinking here.", false, "", "No thinking here."},
      {"  <thin", false, "", "  <thin"},                         // a partial tag at the end is content
      {"<think>\n\n</think>\n\nHi", false, "", "Hi"},             // an empty block
      {"<think>still thinking", false, "still thinking", ""},    // cut off inside the block
      {"a <think> b", false, "", "a <think> b"},                 // only a leading block counts
  };
  for (const auto& c : cases) {
    for (size_t piece : {size_t{1}, size_t{3}, c.text.size()}) {
      const auto s = split(c.text, c.open, piece);
      EXPECT_EQ(s.reasoning, c.reasoning) << c.text << " piece " << piece;
      EXPECT_EQ(s.content, c.content) << c.text << " piece " << piece;
    }
  }
  EXPECT_TRUE(prompt_opens_think("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])");

ToolCallParser::Output parse_calls(ToolCallFormat f, const std::string& text, size_t piece) {
  ToolCallParser p(f, kTools);
  return feed<ToolCallParser, ToolCallParser::Output>(p, text, piece, [](auto& a, const auto& b) {
    a.content += b.content;
    a.calls.insert(a.calls.end(), b.calls.begin(), b.calls.end());
  });
}

TEST(ToolCalls, HermesCallsSeveralPerTurnStreamedOrNot) {
  const std::string text =
      "I will check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": [2, \"}\"]}}\n</tool_call>\n";
  for (size_t piece : {size_t{1}, size_t{5}, text.size()}) {
    const auto o = parse_calls(ToolCallFormat::Hermes, text, piece);
    EXPECT_EQ(o.content, "I will check.") << piece;  // whitespace before a call is dropped
    ASSERT_EQ(o.calls.size(), 2u) << piece;
    EXPECT_EQ(o.calls[0].name, "get_weather");
    EXPECT_EQ(json::parse(o.calls[0].arguments), json({{"city", "Paris"}}));
    EXPECT_EQ(o.calls[1].name, "add");
    EXPECT_EQ(json::parse(o.calls[1].arguments), json::parse(R"({"a": 1, "b": [2, "}"]})"));
  }
}

TEST(ToolCalls, LookalikesStayContent) {
  for (const std::string& text : {
           std::string("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>"),  // bad JSON
           std::string("<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>"),  // unknown function
           std::string("<tool_call>\n{\"name\": \"add\", \"arguments\": [1]}\n</tool_call>"),   // not an object
           std::string("<tool_call>\n{\"name\": \"add\", \"argum"),                             // cut off
           std::string("Use <tool_ call> tags."),
       }) {
    for (size_t piece : {size_t{1}, text.size()}) {
      const auto o = parse_calls(ToolCallFormat::Hermes, text, piece);
      EXPECT_TRUE(o.calls.empty()) << text;
      EXPECT_EQ(o.content, text) << text << " piece " << piece;
    }
  }
}

TEST(ToolCalls, QwenXmlBodiesAndLlamaJson) {
  const std::string xml =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
      "</parameter>\n</function>\n</tool_call>";
  const auto x = parse_calls(ToolCallFormat::Hermes, xml, 2);
  ASSERT_EQ(x.calls.size(), 1u);
  EXPECT_EQ(json::parse(x.calls[0].arguments), json({{"city", "New York"}, {"days", 3}}));
  EXPECT_EQ(x.content, "");

  const std::string llama = "{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"get_weather\", \"parameters\": {}}";
  for (size_t piece : {size_t{1}, llama.size()}) {
    const auto l = parse_calls(ToolCallFormat::Llama3Json, llama, piece);
    ASSERT_EQ(l.calls.size(), 2u);
    EXPECT_EQ(l.calls[0].name, "add");
    EXPECT_EQ(json::parse(l.calls[0].arguments), json({{"a", 1}}));
    EXPECT_EQ(l.calls[1].arguments, "{}");
    EXPECT_EQ(l.content, "");
  }
  EXPECT_EQ(parse_calls(ToolCallFormat::Llama3Json, "{\"name\": \"nope\"}", 1).content, "{\"name\": \"nope\"}");
  EXPECT_EQ(parse_calls(ToolCallFormat::Llama3Json, "Plain answer.", 1).content, "Plain answer.");
  EXPECT_EQ(parse_tool_call_format("auto", "{{ '<|start_header_id|>' }}"), ToolCallFormat::Llama3Json);
  EXPECT_EQ(parse_tool_call_format("auto", "<tool_call>"), ToolCallFormat::Hermes);
}

}  // namespace
}  // namespace dflash::server

namespace dflash::server {
namespace {

// Chat output as the Qwen3 template's model writes it: a think block, text, two tool calls.
const std::string kAgentOutput =
    "<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n"
    "</tool_call>";

struct Agent : Server {
  void script(const std::string& text, FinishReason end = FinishReason::Eos) {
    const auto ids = Tokenizer(qwen3_dir()).encode(text);
    engine.script.clear();
    for (size_t i = 0; i < ids.size(); i += 3)  // a few tokens per event, as DFlash steps deliver them
      engine.script.push_back({0, tokens({ids.begin() + i, ids.begin() + std::min(ids.size(), i + 3)})});
    engine.script.push_back({0, finished(end)});
  }
  json chat(json extra = json::object()) {
    json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"tools", kTools}};
    body.update(extra);
    auto r = post(body, true);
    EXPECT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    return json::parse(r->body);
  }
  // The events of a streamed response.
  std::vector<json> stream(json extra = json::object()) {
    extra["stream"] = true;
    json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"tools", kTools}};
    body.update(extra);
    auto r = post(body, true);
    EXPECT_TRUE(r);
    std::vector<json> events;
    size_t at = 0;
    while ((at = r->body.find("data: ", at)) != std::string::npos) {
      const size_t end = r->body.find("\n\n", at);
      const std::string data = r->body.substr(at + 6, end - at - 6);
      if (data != "[DONE]") events.push_back(json::parse(data));
      at = end;
    }
    return events;
  }
};

TEST_F(Agent, ToolCallsAndReasoningComeBackStructured) {
  script(kAgentOutput);
  const json m = chat()["choices"][0];
  EXPECT_EQ(m["finish_reason"], "tool_calls");
  EXPECT_EQ(m["message"]["reasoning_content"], "The user wants weather.");
  EXPECT_EQ(m["message"]["content"], "Checking.");
  ASSERT_EQ(m["message"]["tool_calls"].size(), 2u);
  const json& c = m["message"]["tool_calls"][0];
  EXPECT_EQ(c["type"], "function");
  EXPECT_EQ(c["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(c["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}, {"days", 2}}));
  EXPECT_TRUE(c["id"].get<std::string>().starts_with("call_"));
  EXPECT_NE(c["id"], m["message"]["tool_calls"][1]["id"]);

  // Streamed: the same pieces as deltas, each call's name before its arguments.
  std::string reasoning, content;
  std::vector<std::string> names(2), args(2);
  std::string finish;
  for (const json& e : stream()) {
    const json& ch = e["choices"][0];
    const json& d = ch["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content") && d["content"].is_string()) content += d["content"].get<std::string>();
    if (d.contains("tool_calls")) {
      const json& tc = d["tool_calls"][0];
      const size_t k = tc["index"].get<size_t>();
      ASSERT_LT(k, 2u);
      if (tc["function"].contains("name")) {
        EXPECT_TRUE(args[k].empty());
        names[k] = tc["function"]["name"];
      }
      args[k] += tc["function"]["arguments"].get<std::string>();
    }
    if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
  }
  EXPECT_EQ(reasoning, "The user wants weather.");
  EXPECT_EQ(content, "Checking.");
  EXPECT_EQ(names, (std::vector<std::string>{"get_weather", "add"}));
  EXPECT_EQ(args[0], m["message"]["tool_calls"][0]["function"]["arguments"]);
  EXPECT_EQ(args[1], m["message"]["tool_calls"][1]["function"]["arguments"]);
  EXPECT_EQ(finish, "tool_calls");
}

TEST_F(Agent, ToolChoiceNoneAndSingleCallsAndRefusals) {
  script(kAgentOutput);
  // "none": nothing is parsed (and the tools are not rendered).
  const json none = chat({{"tool_choice", "none"}})["choices"][0];
  EXPECT_EQ(none["finish_reason"], "stop");
  EXPECT_FALSE(none["message"].contains("tool_calls"));
  EXPECT_NE(none["message"]["content"].get<std::string>().find("<tool_call>"), std::string::npos);
  // Without parallel calls the choice ends after the first.
  const json one = chat({{"parallel_tool_calls", false}})["choices"][0];
  EXPECT_EQ(one["finish_reason"], "tool_calls");
  EXPECT_EQ(one["message"]["tool_calls"].size(), 1u);
  // What needs constrained decoding is refused, naming the field.
  for (const json& choice : {json("required"), json({{"type", "function"}, {"function", {{"name", "add"}}}}), json("x")}) {
    auto r = post({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", kTools}, {"tool_choice", choice}}, true);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    EXPECT_EQ(json::parse(r->body)["error"]["param"], "tool_choice");
  }
  auto bad = post({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"tools", {{{"type", "function"}}}}}, true);
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "tools[0]");
}

TEST_F(Agent, ChoicesAndLogprobsComeFromTheEngineEvents) {
  TokenEvent e = tokens(hello);
  for (size_t i = 0; i < hello.size(); ++i) e.logprobs.push_back({-0.5f * static_cast<float>(i + 1), {{hello[i], -0.1f}, {7, -2.0f}}});
  engine.script = {{0, e}, {0, finished(FinishReason::Length)}};
  auto r = post({{"prompt", "hi"}, {"n", 3}, {"logprobs", 1}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], "Hello world");
    EXPECT_EQ(c["logprobs"]["token_logprobs"], json({-0.5, -1.0}));
    EXPECT_EQ(c["logprobs"]["tokens"], json({"Hello", " world"}));
    EXPECT_EQ(c["logprobs"]["top_logprobs"][0].size(), 1u);
    EXPECT_EQ(c["logprobs"]["text_offset"], json({0, 5}));
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], 6);
  const json chat = json::parse(post({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"logprobs", true},
                                      {"top_logprobs", 2}}, true)->body);
  const json& lp = chat["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[1]["token"], " world");
  EXPECT_EQ(lp[1]["bytes"], json({32, 119, 111, 114, 108, 100}));
  EXPECT_EQ(lp[1]["top_logprobs"].size(), 2u);
  for (const json& body : {json{{"prompt", "x"}, {"n", 17}}, json{{"prompt", "x"}, {"logprobs", 21}},
                           json{{"prompt", "x"}, {"logprobs", true}}, json{{"prompt", "x"}, {"logit_bias", {{"abc", 1}}}},
                           json{{"prompt", "x"}, {"presence_penalty", 3}}, json{{"prompt", "x"}, {"min_tokens", 99}},
                           json{{"prompt", "x"}, {"repetition_penalty", 0}}}) {
    auto bad = post(body);
    ASSERT_TRUE(bad);
    EXPECT_EQ(bad->status, 400) << body.dump() << " " << bad->body;
  }
  auto top = post({{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"top_logprobs", 2}}, true);
  EXPECT_EQ(json::parse(top->body)["error"]["param"], "top_logprobs");
}

TEST_F(Agent, TokenizeAndDetokenizeAsVllmNamesThem) {
  auto t = client->Post("/tokenize", R"({"prompt": "Hello world"})", "application/json");
  ASSERT_TRUE(t);
  ASSERT_EQ(t->status, 200) << t->body;
  const json tj = json::parse(t->body);
  EXPECT_EQ(tj["tokens"], json(hello));
  EXPECT_EQ(tj["count"], hello.size());
  EXPECT_EQ(tj["max_model_len"], 4096);
  auto c = client->Post("/tokenize", R"({"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": true})",
                        "application/json");
  ASSERT_EQ(c->status, 200) << c->body;
  EXPECT_EQ(json::parse(c->body)["token_strs"][0], "<|im_start|>");
  auto d = client->Post("/detokenize", json{{"tokens", hello}}.dump(), "application/json");
  ASSERT_EQ(d->status, 200);
  EXPECT_EQ(json::parse(d->body)["prompt"], "Hello world");
  EXPECT_EQ(client->Post("/detokenize", R"({"tokens": [-1]})", "application/json")->status, 400);
  EXPECT_EQ(client->Post("/tokenize", R"({"prompt": 5})", "application/json")->status, 400);
  EXPECT_EQ(client->Post("/tokenize", R"({"prompt": "x", "model": "other"})", "application/json")->status, 404);
}

}  // namespace
}  // namespace dflash::server
