// safetensors loading: valid files in every supported dtype, sharded
// directories, and a clear error (naming file and tensor) for each kind of
// malformed input.
#include <gtest/gtest.h>

#include "formats/safetensors.h"
#include "util/error.h"
#include "test_util.h"

namespace dflash {
namespace {

using test::TempDir;

// Expects TensorStore::open(path) to fail with a message containing every `parts`.
void expect_error(const std::string& path, const std::vector<std::string>& parts) {
  try {
    TensorStore::open(path);
    FAIL() << "no error for " << path;
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

std::string header_for(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b,
                       uint64_t e) {
  return "{\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(b) + "," + std::to_string(e) + "]}}";
}

TEST(Safetensors, ReadsF32F16AndBF16) {
  TempDir dir;
  // 1.5 and -2 in each encoding.
  std::string data;
  const float f32[2] = {1.5f, -2.0f};
  data.append(reinterpret_cast<const char*>(f32), 8);
  const uint16_t f16[2] = {0x3e00, 0xc000}, bf16[2] = {0x3fc0, 0xc000};
  data.append(reinterpret_cast<const char*>(f16), 4);
  data.append(reinterpret_cast<const char*>(bf16), 4);
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F16","shape":[1,2],"data_offsets":[8,12]},"c":{"dtype":"BF16","shape":[2,1],"data_offsets":[12,16]}})";
  test::write_file(dir.file("m.safetensors"), test::safetensors_bytes(header, data));
  const TensorStore s = TensorStore::open(dir.file("m.safetensors"));
  ASSERT_EQ(s.all().size(), 3u);
  for (const char* name : {"a", "b", "c"}) {
    const TensorInfo& t = s.get(name);
    float out[2];
    convert_to_f32(t.dtype, t.data, out, 2);
    EXPECT_EQ(out[0], 1.5f) << name;
    EXPECT_EQ(out[1], -2.0f) << name;
  }
  EXPECT_EQ(s.get("b").shape, (std::vector<int64_t>{1, 2}));
  EXPECT_THROW(s.get("a", {3}), Error);
}

TEST(Safetensors, ShardedDirectory) {
  TempDir dir;
  test::write_file(dir.file("s1.safetensors"), test::make_safetensors({{"x", {2}, {1, 2}}}));
  test::write_file(dir.file("s2.safetensors"), test::make_safetensors({{"y", {1}, {3}}}));
  test::write_file(dir.file("model.safetensors.index.json"),
                   R"({"metadata":{},"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}})");
  const TensorStore s = TensorStore::open(dir.path());
  EXPECT_EQ(s.all().size(), 2u);
  EXPECT_NE(s.find("y"), nullptr);
}

TEST(Safetensors, ShardedErrors) {
  {
    TempDir dir;  // index names a tensor its shard does not hold
    test::write_file(dir.file("s1.safetensors"), test::make_safetensors({{"x", {1}, {1}}}));
    test::write_file(dir.file("model.safetensors.index.json"), R"({"weight_map":{"x":"s1.safetensors","z":"s1.safetensors"}})");
    expect_error(dir.path(), {"'z'", "missing"});
  }
  {
    TempDir dir;  // path traversal in a shard name
    test::write_file(dir.file("model.safetensors.index.json"), R"({"weight_map":{"x":"../evil.safetensors"}})");
    expect_error(dir.path(), {"invalid shard file"});
  }
  {
    TempDir dir;  // the same tensor in two shards
    test::write_file(dir.file("s1.safetensors"), test::make_safetensors({{"x", {1}, {1}}}));
    test::write_file(dir.file("s2.safetensors"), test::make_safetensors({{"x", {1}, {2}}}));
    test::write_file(dir.file("model.safetensors.index.json"), R"({"weight_map":{"x":"s1.safetensors","y":"s2.safetensors"}})");
    expect_error(dir.path(), {"'x'", "appears in both"});
  }
  {
    TempDir dir;  // missing shard file
    test::write_file(dir.file("model.safetensors.index.json"), R"({"weight_map":{"x":"nope.safetensors"}})");
    expect_error(dir.path(), {"nope.safetensors"});
  }
  {
    TempDir dir;  // no weights at all
    expect_error(dir.path(), {"no model.safetensors"});
  }
}

struct BadFile {
  const char* what;
  std::string bytes;
  std::vector<std::string> message_parts;
};

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  const std::string eight(8, 'x'), sixteen(16, 'x');
  std::string huge_len(8, '\0');
  const uint64_t big = 1000;
  std::memcpy(huge_len.data(), &big, 8);
  const std::vector<BadFile> cases = {
      {"empty file", "", {"truncated"}},
      {"truncated length", "abc", {"truncated"}},
      {"header past end", huge_len + "{}", {"header length 1000", "past the end"}},
      {"invalid json", test::safetensors_bytes("{not json", ""), {"invalid JSON"}},
      {"not an object", test::safetensors_bytes("[1,2]", ""), {"not a JSON object"}},
      {"unsupported dtype", test::safetensors_bytes(header_for("w", "I64", "[1]", 0, 8), eight), {"'w'", "unsupported dtype I64"}},
      {"offsets outside data", test::safetensors_bytes(header_for("w", "F32", "[4]", 0, 16), eight), {"'w'", "outside the data area"}},
      {"reversed offsets", test::safetensors_bytes(header_for("w", "F32", "[0]", 8, 4), eight), {"'w'", "reversed"}},
      {"wrong byte length", test::safetensors_bytes(header_for("w", "F32", "[3]", 0, 8), eight), {"'w'", "needs 12 bytes"}},
      {"wrong dtype size", test::safetensors_bytes(header_for("w", "BF16", "[2]", 0, 8), eight), {"'w'", "needs 4 bytes"}},
      {"negative shape", test::safetensors_bytes(header_for("w", "F32", "[-2]", 0, 8), eight), {"'w'", "non-negative"}},
      {"shape overflow", test::safetensors_bytes(header_for("w", "F32", "[4294967296,4294967296]", 0, 8), eight), {"'w'", "overflow"}},
      {"missing dtype", test::safetensors_bytes(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight), {"'w'", "dtype"}},
      {"bad offsets type", test::safetensors_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", eight), {"'w'", "data_offsets"}},
      {"overlap", test::safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", sixteen), {"'a'", "'b'", "overlap"}},
      {"duplicate name", test::safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight), {"duplicate tensor name 'a'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TempDir dir;
    const std::string path = dir.file("bad.safetensors");
    test::write_file(path, c.bytes);
    auto parts = c.message_parts;
    parts.push_back("bad.safetensors");
    expect_error(path, parts);
  }
}

TEST(Safetensors, TruncatedRealCheckpointIsRejected) {
  const std::string src = test::fixture("targets/qwen3_gqa_tied/model.safetensors");
  const std::string bytes = read_text_file(src);
  TempDir dir;
  test::write_file(dir.file("model.safetensors"), bytes.substr(0, bytes.size() - 100));
  expect_error(dir.path(), {"outside the data area"});
}

}  // namespace
}  // namespace dflash
