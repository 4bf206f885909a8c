#include "formats/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dflash {

using nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // real headers are well under 1 MB

// Parses JSON, rejecting duplicate keys in the top-level object (nlohmann
// would silently keep the last one).
json parse_json_unique_keys(const std::string& text, const std::string& what) {
  std::set<std::string> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!keys.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb);
  } catch (const json::exception& e) {
    throw Error(cat(what, ": invalid JSON: ", e.what()));
  }
  check(duplicate.empty(), what, ": duplicate tensor name '", duplicate, "'");
  return j;
}

int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  check(a >= 0 && b >= 0 && (b == 0 || a <= std::numeric_limits<int64_t>::max() / b), what,
        ": shape overflows");
  return a * b;
}

}  // namespace

int64_t TensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& path) {
  SafetensorsHeader out;
  check(size >= 8, path, ": truncated: ", size, " bytes, no room for the 8-byte header length");
  uint64_t header_len;
  std::memcpy(&header_len, data, 8);  // little-endian on every supported host
  check(header_len <= kMaxHeaderBytes, path, ": header length ", header_len, " is implausibly large");
  check(header_len <= size - 8, path, ": header length ", header_len, " points past the end of the file (",
        size, " bytes)");
  const std::string header(reinterpret_cast<const char*>(data) + 8, header_len);
  const json j = parse_json_unique_keys(header, path);
  check(j.is_object(), path, ": header is not a JSON object");

  const uint8_t* data_start = data + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  for (const auto& [name, entry] : j.items()) {
    if (name == "__metadata__") {
      check(entry.is_object(), path, ": __metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        check(v.is_string(), path, ": __metadata__ value '", k, "' is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = cat(path, ": tensor '", name, "'");
    check(entry.is_object(), where, ": entry is not an object");
    check(entry.contains("dtype") && entry["dtype"].is_string(), where, ": missing or non-string dtype");
    check(entry.contains("shape") && entry["shape"].is_array(), where, ": missing or non-array shape");
    check(entry.contains("data_offsets") && entry["data_offsets"].is_array() &&
              entry["data_offsets"].size() == 2,
          where, ": data_offsets must be an array of two integers");
    TensorInfo t;
    t.name = name;
    t.file = path;
    const std::string dtype = entry["dtype"].get<std::string>();
    auto dt = parse_dtype(dtype);
    check(dt.has_value(), where, ": unsupported dtype ", dtype, " (supported: F32, F16, BF16)");
    t.dtype = *dt;
    for (const auto& d : entry["shape"]) {
      check(d.is_number_integer() && d.get<int64_t>() >= 0, where, ": shape entries must be non-negative integers");
      t.shape.push_back(d.get<int64_t>());
    }
    const auto& offs = entry["data_offsets"];
    check(offs[0].is_number_unsigned() && offs[1].is_number_unsigned(), where,
          ": data_offsets must be non-negative integers");
    const uint64_t begin = offs[0].get<uint64_t>(), end = offs[1].get<uint64_t>();
    check(begin <= end, where, ": data_offsets [", begin, ", ", end, "] are reversed");
    check(end <= data_size, where, ": data_offsets [", begin, ", ", end, "] lie outside the data area (",
          data_size, " bytes)");
    int64_t n_bytes = static_cast<int64_t>(dtype_size(t.dtype));
    for (int64_t d : t.shape) n_bytes = checked_mul(n_bytes, d, where);
    check(static_cast<uint64_t>(n_bytes) == end - begin, where, ": shape ", t.shape_str(), " x ", dtype,
          " needs ", n_bytes, " bytes but data_offsets give ", end - begin);
    t.data = data_start + begin;
    t.n_bytes = end - begin;
    out.tensors.push_back(std::move(t));
  }
  // Overlapping byte ranges mean a corrupt (or malicious) file.
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : out.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->data < b->data; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto *prev = by_offset[i - 1], *cur = by_offset[i];
    check(prev->data + prev->n_bytes <= cur->data || prev->n_bytes == 0 || cur->n_bytes == 0, path,
          ": tensors '", prev->name, "' and '", cur->name, "' overlap");
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](auto& a, auto& b) { return a.name < b.name; });
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(std::make_shared<MappedFile>(path)) {
  SafetensorsHeader h = parse_safetensors(file_->data(), file_->size(), path);
  tensors_ = std::move(h.tensors);
  metadata_ = std::move(h.metadata);
}

TensorStore TensorStore::open(const std::string& path) {
  TensorStore store;
  store.path_ = path;
  auto add_file = [&](const std::string& file) {
    auto f = std::make_shared<SafetensorsFile>(file);
    store.files_.push_back(f);
    for (const auto& t : f->tensors()) {
      auto [it, inserted] = store.index_.emplace(t.name, store.tensors_.size());
      if (!inserted) {
        throw Error(cat(path, ": tensor '", t.name, "' appears in both ", store.tensors_[it->second].file, " and ", file));
      }
      store.tensors_.push_back(t);
    }
  };
  const std::string index_path = path + "/model.safetensors.index.json";
  if (file_exists(path)) {
    add_file(path);
  } else if (file_exists(index_path)) {
    const json j = parse_json_unique_keys(read_text_file(index_path), index_path);
    check(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index_path,
          ": missing object 'weight_map'");
    std::set<std::string> shards;
    for (const auto& [name, file] : j["weight_map"].items()) {
      check(file.is_string(), index_path, ": weight_map entry '", name, "' is not a string");
      const auto f = file.get<std::string>();
      check(!f.empty() && f.find('/') == std::string::npos && f != ".." && f != ".", index_path,
            ": weight_map entry '", name, "' names an invalid shard file '", f, "'");
      shards.insert(f);
    }
    for (const auto& f : shards) add_file(path + "/" + f);
    for (const auto& [name, file] : j["weight_map"].items()) {
      auto it = store.index_.find(name);
      check(it != store.index_.end(), index_path, ": tensor '", name, "' is missing from its shard ",
            file.get<std::string>());
      check(store.tensors_[it->second].file == path + "/" + file.get<std::string>(), index_path, ": tensor '",
            name, "' is listed in ", file.get<std::string>(), " but stored in ", store.tensors_[it->second].file);
    }
  } else if (file_exists(path + "/model.safetensors")) {
    add_file(path + "/model.safetensors");
  } else {
    throw Error(cat(path, ": no model.safetensors or model.safetensors.index.json found"));
  }
  std::sort(store.tensors_.begin(), store.tensors_.end(), [](auto& a, auto& b) { return a.name < b.name; });
  store.index_.clear();
  for (size_t i = 0; i < store.tensors_.size(); ++i) store.index_[store.tensors_[i].name] = i;
  return store;
}

const TensorInfo* TensorStore::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& TensorStore::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  check(t != nullptr, path_, ": missing tensor '", name, "'");
  return *t;
}

const TensorInfo& TensorStore::get(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorInfo& t = get(name);
  TensorInfo expected;
  expected.shape = shape;
  check(t.shape == shape, t.file, ": tensor '", name, "' has shape ", t.shape_str(), ", expected ",
        expected.shape_str());
  return t;
}

size_t TensorStore::total_bytes() const {
  size_t n = 0;
  for (const auto& t : tensors_) n += t.n_bytes;
  return n;
}

}  // namespace dflash
