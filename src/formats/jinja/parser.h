// Tokens -> syntax tree. Unsupported tags, filters and tests are errors here,
// so a template that loads renders exactly as jinja2 would or fails loudly.
#pragma once

#include <string>

#include "formats/jinja/ast.h"

namespace dflash::jinja {

Body parse(const std::string& source);

}  // namespace dflash::jinja
