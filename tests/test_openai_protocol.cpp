// The OpenAI protocol layer: request validation (nesting depth, roles,
// malformed parts) with the Qwen3 tokenizer and template, and the HTTP
// server's answers to how a request ends, driven by a scripted engine:
// a failure is a 500 (or, after a 200 status line, an error body or stream
// event), never a normal "stop", and /metrics counts it.
#include <gtest/gtest.h>

#include <httplib.h>

#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "formats/chat_template.h"
#include "server/http_server.h"
#include "server/openai_protocol.h"
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
    client = std::make_unique<httplib::Client>("127.0.0.1", port.get_future().get());
    client->set_read_timeout(30, 0);
  }
  void TearDown() override {
    server->stop();
    thread.join();
  }
  httplib::Result post(const json& body, bool chat = false) {
    return client->Post(chat ? "/v1/chat/completions" : "/v1/completions", body.dump(), "application/json");
  }
  std::string metrics() { return client->Get("/metrics")->body; }
};

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
