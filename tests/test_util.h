// Helpers shared by the tests: fixture paths, temporary directories, raw
// safetensors writing and error measures.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "util/mapped_file.h"

namespace dflash::test {

// Paths compiled in from the source tree; the environment variables of the same
// names override them where the tests run from another checkout (the device).
inline std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}
inline std::string fixture(const std::string& rel) { return env_or("DFLASH_FIXTURES_DIR", DFLASH_FIXTURES_DIR) + "/" + rel; }
inline std::string models_dir() { return env_or("DFLASH_MODELS_DIR", DFLASH_MODELS_DIR); }

inline nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text_file(path)); }

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dflash-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file: 8-byte little-endian header length, header, data.
inline std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// A well-formed file holding F32 tensors with the given shapes and values.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};
inline std::string make_safetensors(const std::vector<TensorSpec>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& t : tensors) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * 4);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {begin, data.size()}}};
  }
  return safetensors_bytes(header.dump(), data);
}

// max |a - b| / max |b|: relative to the reference's scale.
inline double max_rel_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    max_diff = std::max(max_diff, std::abs(static_cast<double>(a[i]) - ref[i]));
    max_ref = std::max(max_ref, std::abs(static_cast<double>(ref[i])));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

// ||a - ref|| / ||ref|| (infinite when a holds a NaN or an infinity).
inline double rel_l2_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline std::vector<float> random_vector(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

}  // namespace dflash::test
