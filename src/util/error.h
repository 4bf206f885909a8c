// Error type for recoverable, user-facing failures (bad files, bad arguments).
// Messages name the offending file, tensor or field; they are printed as-is.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dflash {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates its arguments with operator<< into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// Throws Error unless `cond` holds; checks untrusted input in every build type.
template <typename... Args>
void check(bool cond, const Args&... args) {
  if (!cond) throw Error(cat(args...));
}

}  // namespace dflash
