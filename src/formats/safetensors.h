// safetensors checkpoints: one file or a sharded directory
// (model.safetensors.index.json). Files are memory-mapped and every field of
// the header is validated, because checkpoints are untrusted input.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "util/dtype.h"
#include "util/mapped_file.h"

namespace dflash {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping; valid while the store lives
  size_t n_bytes = 0;
  std::string file;               // the file it came from, for messages

  int64_t n_elements() const;
  std::string shape_str() const;  // "[4096, 1024]"
};

// The validated header of a safetensors image in memory: tensors (data
// pointing into that memory) and metadata. `where` names it in messages.
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
};
SafetensorsHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& where);

// Parses and validates one safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::shared_ptr<MappedFile> file_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory (or of a single .safetensors file).
class TensorStore {
 public:
  static TensorStore open(const std::string& path);

  const TensorInfo* find(const std::string& name) const;
  // Throws Error naming the checkpoint and the tensor when it is absent.
  const TensorInfo& get(const std::string& name) const;
  // Same, and checks the shape; the message names tensor, expected and actual shape.
  const TensorInfo& get(const std::string& name, const std::vector<int64_t>& shape) const;
  const std::vector<TensorInfo>& all() const { return tensors_; }  // sorted by name
  const std::string& path() const { return path_; }
  size_t total_bytes() const;

 private:
  std::string path_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
};

}  // namespace dflash
