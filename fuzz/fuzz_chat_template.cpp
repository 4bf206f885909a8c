// Fuzz target: chat template parsing and rendering. Any source must parse or
// fail with dflash::Error, and rendering must finish within the limits or
// fail with dflash::Error.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "formats/jinja/template.h"
#include "util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi <b>there</b> \u00e9\u4f60"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello", "reasoning_content": "r",
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}}]},
    {"role": "tool", "content": "{\"ok\": true}"},
    {"role": "user", "content": "again"}])");
  static const nlohmann::ordered_json tools = nlohmann::ordered_json::parse(
      R"([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}])");
  const std::string source(reinterpret_cast<const char*>(data), size);
  try {
    const dflash::jinja::Template t(source);
    dflash::jinja::RenderLimits limits;
    limits.max_steps = 200000;
    limits.max_output = 1 << 20;
    limits.max_call_depth = 50;
    for (bool gen : {false, true}) {
      t.render({{"messages", dflash::jinja::Value::from_json(messages)},
                {"tools", dflash::jinja::Value::from_json(tools)},
                {"add_generation_prompt", dflash::jinja::Value(gen)},
                {"bos_token", dflash::jinja::Value("<s>")},
                {"enable_thinking", dflash::jinja::Value(gen)}},
               limits);
    }
  } catch (const dflash::Error&) {
  }
  return 0;
}
