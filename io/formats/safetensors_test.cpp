// safetensors: byte layout, bit-exact round trips (single file, shards + index), reading BF16 /
// F16 / F64 written by hand, and one clear error per kind of damage.
#include "io/formats/safetensors.h"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>

#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;
namespace fs = std::filesystem;

namespace {

HostTensor random_tensor(Shape s, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  HostTensor t{s, std::vector<float>(size_t(s.numel()))};
  for (float& x : t.data) x = n(gen);
  return t;
}

void check_equal(const TensorMap& a, const TensorMap& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    REQUIRE(b.count(name));
    CHECK(b.at(name).shape == t.shape);
    REQUIRE(b.at(name).data.size() == t.data.size());
    // Bits, not values (a NaN must survive); an empty tensor's vectors have no data pointer.
    if (!t.data.empty()) CHECK(std::memcmp(b.at(name).data.data(), t.data.data(), t.data.size() * 4) == 0);
  }
}

// A safetensors file from a header text and the data bytes.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

template <class T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

}  // namespace

TEST_CASE("safetensors: byte layout and bit-exact round trip") {
  TempDir tmp;
  TensorMap m;
  m["b.weight"] = random_tensor({3, 5}, 1);
  m["a.bias"] = random_tensor({5}, 2);
  m["c.cube"] = random_tensor({2, 3, 4}, 3);
  m["d.scalar"] = HostTensor{Shape{}, {-1e4f}};
  m["e.empty"] = HostTensor{Shape{0, 7}, {}};
  m["a.bias"].data[0] = std::numeric_limits<float>::quiet_NaN();  // bits, not values, must survive
  m["a.bias"].data[1] = -0.0f;
  write_safetensors(tmp / "m.safetensors", m, {{"format", "pt"}, {"note", "tiny"}});
  CHECK_FALSE(fs::exists(tmp / "m.safetensors.tmp"));

  const std::string bytes = read_file(tmp / "m.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);  // data 8-byte aligned
  REQUIRE(8 + n <= bytes.size());
  CHECK(bytes[8] == '{');
  const auto header = nlohmann::json::parse(bytes.substr(8, n));
  CHECK(header["__metadata__"]["format"] == "pt");
  CHECK(header["b.weight"]["dtype"] == "F32");
  CHECK(header["b.weight"]["shape"] == nlohmann::json({3, 5}));
  CHECK(header["d.scalar"]["shape"] == nlohmann::json::array());
  uint64_t data_bytes = 0;
  for (const auto& [name, t] : m) data_bytes += t.data.size() * 4;
  CHECK(bytes.size() == 8 + n + data_bytes);
  // The raw data of one tensor sits where its offsets say.
  const auto off = header["c.cube"]["data_offsets"];
  CHECK(std::memcmp(bytes.data() + 8 + n + off[0].get<uint64_t>(), m["c.cube"].data.data(), 24 * 4) == 0);

  SafetensorsMetadata meta;
  TensorMap back = read_safetensors(tmp / "m.safetensors", &meta);
  check_equal(m, back);
  CHECK(meta == SafetensorsMetadata{{"format", "pt"}, {"note", "tiny"}});
  check_equal(m, load_safetensors_model(tmp / "m.safetensors"));

  SafetensorsFile f(tmp / "m.safetensors");
  CHECK(f.entry("c.cube").shape == std::vector<int64_t>{2, 3, 4});
  CHECK_THROWS_WITH_AS(f.read("nope"), doctest::Contains("has no tensor 'nope'"), Error);

  m["bad"] = HostTensor{Shape{2, 2}, {1, 2, 3}};
  CHECK_THROWS_WITH_AS(write_safetensors(tmp / "x.safetensors", m), doctest::Contains("tensor 'bad' has shape (2, 2)"),
                       Error);
}

TEST_CASE("safetensors: BF16, F16 and F64 are read into fp32; integer dtypes are listed but refused") {
  TempDir tmp;
  // 1.0, -2.5, pi rounded to bf16 (3.140625), the smallest normal, -inf
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC020, 0x4049, 0x0080, 0xFF80};
  // 1.0, 2^-24 (smallest subnormal), -2^-15 (subnormal), 65504 (max), +inf, -0
  const std::vector<uint16_t> f16 = {0x3C00, 0x0001, 0x8200, 0x7BFF, 0x7C00, 0x8000};
  const std::vector<double> f64 = {0.1, -3.0};
  const std::vector<int32_t> i32 = {7, 8};
  std::string data = raw(bf16) + raw(f16) + raw(f64) + raw(i32);
  const std::string header = R"({"bf":{"dtype":"BF16","shape":[5],"data_offsets":[0,10]},)"
                             R"("h":{"dtype":"F16","shape":[2,3],"data_offsets":[10,22]},)"
                             R"("d":{"dtype":"F64","shape":[2],"data_offsets":[22,38]},)"
                             R"("i":{"dtype":"I32","shape":[2],"data_offsets":[38,46]}})";
  write_file(tmp / "h.safetensors", file_bytes(header, data));
  SafetensorsFile f(tmp / "h.safetensors");
  const HostTensor b = f.read("bf");
  CHECK(b.data == std::vector<float>{1.0f, -2.5f, 3.140625f, std::numeric_limits<float>::min(),
                                     -std::numeric_limits<float>::infinity()});
  const HostTensor h = f.read("h");
  CHECK(h.shape == Shape{2, 3});
  CHECK(h.data[0] == 1.0f);
  CHECK(h.data[1] == std::ldexp(1.0f, -24));
  CHECK(h.data[2] == -std::ldexp(1.0f, -15));
  CHECK(h.data[3] == 65504.0f);
  CHECK(h.data[4] == std::numeric_limits<float>::infinity());
  CHECK(std::bit_cast<uint32_t>(h.data[5]) == 0x80000000u);
  CHECK(f.read("d").data == std::vector<float>{0.1f, -3.0f});
  CHECK(f.entry("i").dtype == "I32");
  CHECK_THROWS_WITH_AS(f.read("i"), doctest::Contains("tensor 'i' is I32; only floating-point"), Error);
}

TEST_CASE("safetensors: sharded models with an index, like save_pretrained") {
  TempDir tmp;
  TensorMap m;
  for (int i = 0; i < 5; ++i) m["layer." + std::to_string(i)] = random_tensor({10, 10}, 10 + i);  // 400 bytes each
  m["big"] = random_tensor({40, 10}, 20);                                                        // 1600 bytes

  // Everything fits: one file, no index.
  auto files = save_safetensors_model(tmp / "one", m);
  CHECK(files == std::vector<std::string>{tmp / "one/model.safetensors"});
  check_equal(m, load_safetensors_model(tmp / "one"));

  // 1000-byte shards in name order: [big] (larger than a shard: alone), [layer.0, layer.1], [layer.2, layer.3], [layer.4].
  const std::string dir = tmp / "sharded";
  write_file(dir + "/model.safetensors", "stale");  // an earlier single-file save is removed
  files = save_safetensors_model(dir, m, 1000);
  REQUIRE(files.size() == 5);
  CHECK(files[0] == dir + "/model-00001-of-00004.safetensors");
  CHECK(files[3] == dir + "/model-00004-of-00004.safetensors");
  CHECK(files[4] == dir + "/model.safetensors.index.json");
  CHECK_FALSE(fs::exists(dir + "/model.safetensors"));
  const auto index = nlohmann::json::parse(read_file(dir + "/model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 5 * 400 + 1600);
  CHECK(index["weight_map"]["big"] == "model-00001-of-00004.safetensors");
  CHECK(index["weight_map"]["layer.1"] == "model-00002-of-00004.safetensors");
  CHECK(index["weight_map"]["layer.2"] == "model-00003-of-00004.safetensors");
  CHECK(index["weight_map"]["layer.4"] == "model-00004-of-00004.safetensors");
  CHECK(read_safetensors(dir + "/model-00002-of-00004.safetensors").size() == 2);
  check_equal(m, load_safetensors_model(dir));
  check_equal(m, load_safetensors_model(dir + "/model.safetensors.index.json"));

  // Saving again with fewer shards leaves no stale shard behind.
  save_safetensors_model(dir, m, 1200);  // [big], [layer.0-2], [layer.3-4]
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir)) shards += e.path().filename().string().starts_with("model-");
  CHECK(shards == 3);
  check_equal(m, load_safetensors_model(dir));

  // Index and shards must agree.
  std::string text = read_file(dir + "/model.safetensors.index.json");
  auto broken = nlohmann::json::parse(text);
  broken["weight_map"]["ghost"] = "model-00001-of-00003.safetensors";
  write_file(dir + "/model.safetensors.index.json", broken.dump());
  CHECK_THROWS_WITH_AS(load_safetensors_model(dir), doctest::Contains("puts tensor 'ghost' in"), Error);
  broken = nlohmann::json::parse(text);
  broken["weight_map"].erase("layer.4");
  write_file(dir + "/model.safetensors.index.json", broken.dump());
  CHECK_THROWS_WITH_AS(load_safetensors_model(dir), doctest::Contains("holds tensor 'layer.4', which the index"), Error);
  broken = nlohmann::json::parse(text);
  broken["weight_map"]["big"] = "../elsewhere.safetensors";
  write_file(dir + "/model.safetensors.index.json", broken.dump());
  CHECK_THROWS_WITH_AS(load_safetensors_model(dir), doctest::Contains("is not a file name in the model directory"), Error);
  write_file(dir + "/model.safetensors.index.json", text);
  fs::remove(dir + "/model-00002-of-00003.safetensors");
  CHECK_THROWS_WITH_AS(load_safetensors_model(dir), doctest::Contains("model-00002-of-00003.safetensors"), Error);

  write_file(tmp / "both/model.safetensors", "x");
  write_file(tmp / "both/model.safetensors.index.json", "{}");
  CHECK_THROWS_WITH_AS(load_safetensors_model(tmp / "both"), doctest::Contains("holds both"), Error);
  fs::create_directories(tmp / "empty");
  CHECK_THROWS_WITH_AS(load_safetensors_model(tmp / "empty"), doctest::Contains("holds neither"), Error);
}

TEST_CASE("safetensors: damaged files are errors naming the file and the tensor") {
  TempDir tmp;
  const std::string p = tmp / "bad.safetensors";
  auto fails_with = [&](const std::string& bytes, const char* what) {
    CAPTURE(what);
    write_file(p, bytes);
    CHECK_THROWS_WITH_AS(SafetensorsFile{p}, doctest::Contains(what), Error);
    CHECK_THROWS_WITH_AS(SafetensorsFile{p}, doctest::Contains("bad.safetensors"), Error);
  };
  const std::string data(16, '\0');  // four F32 zeros
  auto one = [&](const std::string& entry) { return file_bytes("{\"w\":" + entry + "}", data); };
  // Sanity: the well-formed variant opens.
  write_file(p, one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})"));
  CHECK(SafetensorsFile(p).read("w").data == std::vector<float>(4, 0.0f));

  fails_with("abc", "shorter than the 8-byte header length");
  std::string huge = file_bytes("{}", "");
  huge[4] = 1;  // header length 2^32
  fails_with(huge, "exceeds the");
  std::string beyond = one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})");
  beyond[0] = char(200);
  fails_with(beyond, "runs beyond the end of the");
  fails_with(file_bytes("[1, 2]  ", data), "does not start with '{'");
  fails_with(file_bytes("{\"w\": ", data), "not valid JSON");
  fails_with(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,20]})"), "tensor 'w': data_offsets [0, 20] lie outside");
  fails_with(one(R"({"dtype":"F32","shape":[3,2],"data_offsets":[0,16]})"), "tensor 'w': shape [3, 2] of F32 needs 24 bytes");
  fails_with(one(R"({"dtype":"F33","shape":[2,2],"data_offsets":[0,16]})"), "tensor 'w' has unknown dtype 'F33'");
  fails_with(one(R"({"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]})"), "not a non-negative integer");
  fails_with(one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[16,0]})"), "lie outside");
  fails_with(one(R"({"dtype":"F32","shape":[2,2]})"), "tensor 'w': \"data_offsets\" null is not [begin, end]");
  fails_with(one(R"({"shape":[2,2],"data_offsets":[0,16]})"), "tensor 'w' has no \"dtype\"");
  fails_with(file_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"a":1}})", data),
             "metadata 'a' = 1 is not a string");
  fails_with(file_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data),
             "tensors 'a' (bytes [0, 12)) and 'b' (bytes [8, 16)) overlap");
  CHECK_THROWS_WITH_AS(SafetensorsFile(tmp / "missing.safetensors"), doctest::Contains("missing.safetensors"), Error);

  // A truncated download: header intact, data cut.
  TensorMap m;
  m["w"] = random_tensor({8, 8}, 5);
  write_safetensors(p, m);
  truncate_file(p, fs::file_size(p) - 4);
  CHECK_THROWS_WITH_AS(SafetensorsFile{p}, doctest::Contains("tensor 'w': data_offsets [0, 256] lie outside"), Error);
}
