// A Jinja template as Hugging Face renders chat templates: jinja2's
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks, loop
// controls, tojson without ASCII escaping, raise_exception and strftime_now.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "formats/jinja/value.h"

namespace dflash::jinja {

struct Stmt;

struct RenderLimits {
  int64_t max_steps = 20'000'000;    // expression and statement evaluations
  int max_call_depth = 100;          // nested macro calls
  size_t max_output = 64u << 20;     // bytes of output and of any one string
};

class Template {
 public:
  // Parses; throws Error naming the line for syntax errors and unsupported constructs.
  explicit Template(const std::string& source);
  ~Template();
  Template(Template&&) noexcept;

  // Renders with these top-level variables; throws Error for render-time
  // failures (raise_exception, undefined attributes, type errors, limits).
  std::string render(const std::vector<std::pair<std::string, Value>>& vars, const RenderLimits& limits = {}) const;

 private:
  std::vector<std::unique_ptr<Stmt>> body_;
};

}  // namespace dflash::jinja
