// safetensors: round trips, files written by hand from the spec, atomic
// writes, one test per corruption class, and a mutation fuzzer.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "quanta.h"
#include "support/temp_dir.h"

using namespace quanta;
using namespace quanta::io;
namespace fs = std::filesystem;

using testing::TempDir;

namespace {

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// A whole file from its header text and data bytes (the header is used as is).
std::string file_bytes(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string raw_bytes(const Tensor& t) {
  Tensor c = t.contiguous();
  if (c.nbytes() == 0) return {};
  return std::string(static_cast<const char*>(c.raw_data()), c.nbytes());
}

void check_same(const Tensor& got, const Tensor& want) {
  CHECK(got.dtype() == want.dtype());
  CHECK(got.shape() == want.shape());
  CHECK(raw_bytes(got) == raw_bytes(want));
}

const Tensor& find(const SafetensorsFile& f, const std::string& name) {
  for (const auto& [n, t] : f.tensors)
    if (n == name) return t;
  FAIL("tensor not found: " << name);
  static Tensor none;
  return none;
}

// One tensor of every dtype, including 0-d, zero-size and non-contiguous ones.
TensorMap every_dtype() {
  std::vector<float> v = {1.5f, -2.25f, 3.0f, 0.0f, -0.5f, 1e3f};
  return {
      {"f32", from_vector<float>(v, {2, 3})},
      {"f64", from_vector<double>({1.0 / 3, -2e300, 5e-310}, {3})},
      {"f16", from_vector<float>(v, {3, 2}).to(DType::f16)},
      {"bf16", from_vector<float>(v, {6}).to(DType::bf16)},
      {"i64", from_vector<int64_t>({-(int64_t(1) << 62), 7}, {2, 1})},
      {"i32", from_vector<int32_t>({-5, 2147483647, 0, 1}, {2, 2})},
      {"u8", from_vector<uint8_t>({0, 255, 17}, {3})},
      {"bool", from_vector<uint8_t>({1, 0, 1}, {3}).to(DType::boolean)},
      {"scalar", scalar(4.5)},
      {"empty", zeros({0, 3})},
      {"empty_i64", zeros({2, 0}, {.dtype = DType::i64})},
      {"transposed", from_vector<float>(v, {2, 3}).t()},
  };
}

// Loads `bytes` from a file and from memory; both must fail with a message
// naming the source and containing `what`.
void check_rejected(const std::string& bytes, const std::string& what) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_file(path, bytes);
  CAPTURE(what);
  try {
    load_safetensors(path);
    FAIL("loaded a corrupt file");
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
    CHECK(msg.find('\n') == std::string::npos);
  }
  try {
    SafetensorsReader reader(path);
    FAIL("opened a corrupt file");
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
  }
  try {
    parse_safetensors(to_bytes(bytes), "buffer.st");
    FAIL("parsed corrupt bytes");
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    CAPTURE(msg);
    CHECK(msg.find("buffer.st") != std::string::npos);
    CHECK(msg.find(what) != std::string::npos);
  }
}

// A one-tensor header with `info` as the tensor's entry.
std::string one(const std::string& info) { return "{\"t\":" + info + "}"; }

}  // namespace

TEST_CASE("safetensors round trip of every dtype with metadata") {
  TempDir dir;
  const TensorMap in = every_dtype();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "é \"q\"\n"}};
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, in, meta);
  for (const SafetensorsFile& out :
       {load_safetensors(path), parse_safetensors(serialize_safetensors(in, meta))}) {
    CHECK(out.metadata == meta);
    REQUIRE(out.tensors.size() == in.size());
    for (std::size_t i = 1; i < out.tensors.size(); ++i)
      CHECK(out.tensors[i - 1].first < out.tensors[i].first);  // sorted by name
    for (const auto& [name, t] : in) {
      CAPTURE(name);
      check_same(find(out, name), t);
    }
  }
  CHECK(find(load_safetensors(path), "f64").to_vector<double>()[2] == 5e-310);
  CHECK(find(load_safetensors(path), "transposed").to_vector<float>() ==
        std::vector<float>{1.5f, 0.0f, -2.25f, -0.5f, 3.0f, 1e3f});
  CHECK(read_file(path) == bytes_of(serialize_safetensors(in, meta)));
}

TEST_CASE("SafetensorsReader reads one tensor at a time what load_safetensors reads") {
  TempDir dir;
  TensorMap in = every_dtype();
  Tensor codes = empty({2, 64}, {.dtype = DType::nf4});  // a byte-only dtype
  for (std::size_t i = 0; i < codes.nbytes(); ++i)
    static_cast<uint8_t*>(codes.raw_data())[i] = uint8_t(i * 37);
  in.emplace_back("codes", codes);
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, in, meta);
  const SafetensorsFile whole = load_safetensors(path);
  const SafetensorsReader reader(path);
  CHECK(reader.path() == path);
  CHECK(reader.metadata() == meta);  // the block dtype's key taken out, as load does
  std::vector<std::string> names;
  for (const auto& [name, t] : whole.tensors) names.push_back(name);
  CHECK(reader.names() == names);
  for (const auto& [name, t] : whole.tensors) {
    CAPTURE(name);
    CHECK(reader.contains(name));
    CHECK(reader.dtype(name) == t.dtype());
    CHECK(reader.shape(name) == t.shape());
    check_same(reader.read(name), t);
  }
  CHECK(reader.dtype("codes") == DType::nf4);
  CHECK_FALSE(reader.contains("absent"));
  CHECK_THROWS_WITH_AS(reader.read("absent"),
                       doctest::Contains((path + ": holds no tensor 'absent'").c_str()),
                       std::runtime_error);
  // The file cut short after its header was read: named, not a crash.
  fs::resize_file(path, 8);
  CHECK_THROWS_WITH_AS(reader.read("f32"), doctest::Contains((path + ": file ended early").c_str()),
                       std::runtime_error);
}

TEST_CASE("safetensors empty file and tensors that require grad") {
  CHECK(parse_safetensors(serialize_safetensors({})).tensors.empty());
  // The reference writer's empty file: "{}" padded to 8 bytes.
  CHECK(bytes_of(serialize_safetensors({})) == le64(8) + "{}      ");
  Tensor w = from_vector<float>({1, 2}).requires_grad_();
  Tensor y = w * 2.0;
  auto f = parse_safetensors(serialize_safetensors({{"w", w}, {"y", y}}));
  CHECK_FALSE(find(f, "w").requires_grad());
  CHECK(find(f, "y").to_vector<float>() == std::vector<float>{2, 4});
}

TEST_CASE("safetensors writes the reference writer's bytes") {
  // The reference implementation's own serialisation tests, rebuilt from the
  // spec: compact JSON, entries in buffer order, header padded with spaces to
  // a multiple of 8, then the little-endian data.
  std::vector<float> v = {0, 1, 2, 3, 4, 5};
  SUBCASE("one f32 tensor, header already a multiple of 8") {
    const std::string h = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
    REQUIRE(h.size() == 64);
    CHECK(bytes_of(serialize_safetensors({{"attn.0", from_vector(v, {1, 2, 3})}})) ==
          le64(64) + h + bytes_of(v));
  }
  SUBCASE("padding with spaces") {
    const std::string h = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
    REQUIRE(h.size() == 65);
    CHECK(bytes_of(serialize_safetensors({{"attn0", from_vector(v, {1, 1, 2, 3})}})) ==
          le64(72) + h + "       " + bytes_of(v));
  }
  SUBCASE("metadata only") {
    const std::string h = R"({"__metadata__":{"framework":"pt"}})";
    CHECK(bytes_of(serialize_safetensors({}, {{"framework", "pt"}})) == le64(40) + h + "     ");
  }
  SUBCASE("several dtypes: largest alignment first, then by name") {
    TensorMap in = {
        {"b", from_vector<uint8_t>({1, 0}).to(DType::boolean)},
        {"a16", from_vector<float>({1}).to(DType::bf16)},
        {"h", from_vector<float>({1, 2}).to(DType::f16)},
        {"f", from_vector<float>({1})},
        {"e", from_vector<float>({2})},
        {"d", from_vector<double>({1})},
        {"l", from_vector<int64_t>({1})},
        {"i", from_vector<int32_t>({1})},
        {"u", from_vector<uint8_t>({9})},
        {"z", scalar(1.0, {.dtype = DType::f64})},
    };
    const std::string h = R"({"__metadata__":{"a":"1","b":"2"},)"
                          R"("l":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                          R"("d":{"dtype":"F64","shape":[1],"data_offsets":[8,16]},)"
                          R"("z":{"dtype":"F64","shape":[],"data_offsets":[16,24]},)"
                          R"("e":{"dtype":"F32","shape":[1],"data_offsets":[24,28]},)"
                          R"("f":{"dtype":"F32","shape":[1],"data_offsets":[28,32]},)"
                          R"("i":{"dtype":"I32","shape":[1],"data_offsets":[32,36]},)"
                          R"("a16":{"dtype":"BF16","shape":[1],"data_offsets":[36,38]},)"
                          R"("h":{"dtype":"F16","shape":[2],"data_offsets":[38,42]},)"
                          R"("u":{"dtype":"U8","shape":[1],"data_offsets":[42,43]},)"
                          R"("b":{"dtype":"BOOL","shape":[2],"data_offsets":[43,45]}})";
    const auto bytes = serialize_safetensors(in, {{"b", "2"}, {"a", "1"}});
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    CHECK(n % 8 == 0);
    const std::string header(bytes.begin() + 8, bytes.begin() + 8 + long(n));
    CHECK(header == h + std::string(n - h.size(), ' '));
    CHECK(bytes.size() == 8 + n + 45);
  }
}

TEST_CASE("safetensors loads a file written by hand from the spec") {
  TempDir dir;
  const std::string path = dir.file("hand.safetensors");
  // Header order differs from buffer order; whitespace inside the JSON and
  // space padding after it are legal.
  const std::string header =
      "{ \"weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [8, 24]},\n"
      "  \"step\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": [0, 8]},\n"
      "  \"mask\": {\"dtype\": \"BOOL\", \"shape\": [3], \"data_offsets\": [28, 31]},\n"
      "  \"half\": {\"dtype\": \"F16\", \"shape\": [2], \"data_offsets\": [24, 28]},\n"
      "  \"none\": {\"dtype\": \"F32\", \"shape\": [0, 5], \"data_offsets\": [31, 31]},\n"
      "  \"__metadata__\": {\"framework\": \"pt\", \"epoch\": \"3\"} }   ";
  std::string data = le64(uint64_t(-7));                          // step = -7
  data += bytes_of(std::vector<float>{1.0f, -2.0f, 0.5f, 8.0f});  // weight
  data += std::string("\x00\x3c\x00\xc0", 4);                     // half = 1.0, -2.0
  data += std::string("\x01\x00\x02", 3);                         // mask (2 reads as true)
  write_file(path, file_bytes(header, data));

  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.metadata == std::map<std::string, std::string>{{"epoch", "3"}, {"framework", "pt"}});
  REQUIRE(f.tensors.size() == 5);
  CHECK(f.tensors[0].first == "half");  // sorted by name
  CHECK(find(f, "step").dtype() == DType::i64);
  CHECK(find(f, "step").dim() == 0);
  CHECK(find(f, "step").item<int64_t>() == -7);
  CHECK(find(f, "weight").shape() == Shape{2, 2});
  CHECK(find(f, "weight").to_vector<float>() == std::vector<float>{1.0f, -2.0f, 0.5f, 8.0f});
  CHECK(find(f, "half").dtype() == DType::f16);
  CHECK(find(f, "half").to_vector<float>() == std::vector<float>{1.0f, -2.0f});
  CHECK(find(f, "mask").dtype() == DType::boolean);
  CHECK(find(f, "mask").to(DType::u8).to_vector<uint8_t>() == std::vector<uint8_t>{1, 0, 1});
  CHECK(find(f, "none").shape() == Shape{0, 5});

  // Extra fields are ignored and null metadata means none, as in the reference loader.
  const auto extra = parse_safetensors(to_bytes(file_bytes(
      R"({"__metadata__":null,"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})",
      "\x05")));
  CHECK(extra.metadata.empty());
  CHECK(find(extra, "t").item<int>() == 5);

  const SafetensorsHeader h = read_safetensors_header(path);
  CHECK(h.header_bytes == header.size());
  CHECK(h.data_bytes == 31);
  REQUIRE(h.tensors.size() == 5);
  CHECK(h.tensors[0].name == "step");  // buffer order
  CHECK(h.tensors[1].dtype == "F32");
  CHECK(h.tensors[1].begin == 8);
  CHECK(h.tensors[1].end == 24);
}

TEST_CASE("safetensors header lists dtypes quanta cannot load") {
  const std::string header = R"({"q":{"dtype":"I8","shape":[4],"data_offsets":[0,4]},)"
                             R"("p":{"dtype":"F4","shape":[2],"data_offsets":[4,5]}})";
  TempDir dir;
  const std::string path = dir.file("i8.safetensors");
  write_file(path, file_bytes(header, "\x01\x02\x03\x04\x05"));
  const SafetensorsHeader h = read_safetensors_header(path);
  REQUIRE(h.tensors.size() == 2);
  CHECK(h.tensors[0].dtype == "I8");
  CHECK(h.tensors[1].dtype == "F4");
  check_rejected(file_bytes(header, "\x01\x02\x03\x04\x05"), "unsupported dtype I8 for tensor 'q'");
}

TEST_CASE("safetensors save is atomic") {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  auto count_files = [&] {
    return std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator());
  };
  const TensorMap good = {{"w", from_vector<float>({1, 2, 3})}};
  save_safetensors(path, good);
  CHECK(count_files() == 1);  // the temporary file is gone
  const std::string before = read_file(path);

  SUBCASE("a tensor that cannot be saved leaves the target intact") {
    CHECK_THROWS_AS(save_safetensors(path, {{"w", zeros({4})}, {"bad", Tensor()}}),
                    std::invalid_argument);
    CHECK_THROWS_AS(save_safetensors(path, {{"w", zeros({4})}, {"w", zeros({4})}}),
                    std::invalid_argument);
    CHECK_THROWS_AS(save_safetensors(path, {{"__metadata__", zeros({4})}}), std::invalid_argument);
    CHECK_THROWS_AS(save_safetensors(path, {{std::string("\xff\xfe"), zeros({1})}}),
                    std::invalid_argument);
    CHECK(read_file(path) == before);
    CHECK(count_files() == 1);
  }
  SUBCASE("a failed rename removes the temporary file") {
    const std::string target = dir.file("is_a_folder");
    fs::create_directories(target + "/inside");
    try {
      save_safetensors(target, good);
      FAIL("saved over a folder");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()).find(target) != std::string::npos);
    }
    CHECK(fs::is_directory(target + "/inside"));
    CHECK(count_files() == 2);
  }
  SUBCASE("a missing folder is an error naming the path") {
    const std::string target = dir.file("no/such/folder/x.safetensors");
    try {
      save_safetensors(target, good);
      FAIL("saved into a missing folder");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()).find(target) != std::string::npos);
    }
  }
  SUBCASE("overwriting replaces the file") {
    save_safetensors(path, {{"v", ones({2}, {.dtype = DType::i32})}});
    const auto f = load_safetensors(path);
    REQUIRE(f.tensors.size() == 1);
    CHECK(f.tensors[0].first == "v");
    CHECK(count_files() == 1);
  }
}

TEST_CASE("save_safetensors_streamed makes each tensor in the file's order, one at a time") {
  TempDir dir;
  TensorMap in = every_dtype();
  Tensor codes = empty({2, 64}, {.dtype = DType::nf4});  // a byte-only dtype
  for (std::size_t i = 0; i < codes.nbytes(); ++i)
    static_cast<uint8_t*>(codes.raw_data())[i] = uint8_t(i * 37);
  in.emplace_back("codes", codes);
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  // Each source remembers when it was made and whether the one before it
  // was let go first (the writer holds one made tensor at a time).
  std::vector<std::string> made;
  std::weak_ptr<Storage> last;
  bool one_at_a_time = true;
  std::vector<TensorSource> sources;
  for (const auto& [name, t] : in)
    sources.push_back({name, t.dtype(), t.shape(), [&, name = name, t = t] {
                         made.push_back(name);
                         if (!last.expired()) one_at_a_time = false;
                         // Bytes of its own, so that letting it go frees them.
                         Tensor copy = empty(t.shape(), {.dtype = t.dtype()});
                         if (t.nbytes() > 0)
                           std::memcpy(copy.raw_data(), t.contiguous().raw_data(), t.nbytes());
                         last = copy.storage();
                         return copy;
                       }});
  const std::string path = dir.file("streamed.safetensors");
  save_safetensors_streamed(path, sources, meta);
  CHECK(one_at_a_time);
  CHECK(read_file(path) == bytes_of(serialize_safetensors(in, meta)));
  // The file's order: the header's entries by their data offsets.
  const SafetensorsHeader h = read_safetensors_header(path);
  std::vector<std::string> file_order;
  for (const SafetensorsEntry& e : h.tensors) file_order.push_back(e.name);
  CHECK(made == file_order);

  SUBCASE("a tensor made with another shape or dtype than declared leaves the file as it was") {
    const std::string before = read_file(path);
    std::vector<TensorSource> wrong = {
        {"a", DType::f32, {2}, [] { return zeros({2}); }},
        {"b", DType::f32, {3}, [] { return zeros({4}); }},
    };
    CHECK_THROWS_WITH_AS(save_safetensors_streamed(path, wrong),
                         doctest::Contains("tensor 'b' was made as f32 [4], not the f32 [3]"),
                         std::runtime_error);
    wrong[1] = {"b", DType::bf16, {4}, [] { return zeros({4}); }};
    CHECK_THROWS_WITH_AS(save_safetensors_streamed(path, wrong),
                         doctest::Contains("was made as f32 [4], not the bf16 [4]"),
                         std::runtime_error);
    wrong[1] = {
        "b", DType::f32, {4}, []() -> Tensor { throw std::runtime_error("out of memory"); }};
    CHECK_THROWS_WITH_AS(save_safetensors_streamed(path, wrong), "out of memory",
                         std::runtime_error);
    CHECK(read_file(path) == before);
    CHECK(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()) == 1);
  }
  SUBCASE("what the declarations alone refuse is refused before anything is made") {
    made.clear();
    sources.push_back({"f32", DType::f32, {1}, [] { return zeros({1}); }});
    CHECK_THROWS_WITH_AS(save_safetensors_streamed(path, sources),
                         doctest::Contains("duplicate tensor name 'f32'"), std::invalid_argument);
    sources.back() = {"neg", DType::f32, {-1}, [] { return zeros({1}); }};
    CHECK_THROWS_WITH_AS(save_safetensors_streamed(path, sources),
                         doctest::Contains("tensor 'neg' has shape [-1], which has no size"),
                         std::invalid_argument);
    CHECK(made.empty());
  }
}

TEST_CASE("safetensors rejects every corruption class with a clear error") {
  const std::string f32x2 = bytes_of(std::vector<float>{1, 2});
  const std::string ok = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  // Sanity: the baseline loads.
  CHECK(parse_safetensors(to_bytes(file_bytes(one(ok), f32x2))).tensors.size() == 1);

  SUBCASE("file structure") {
    check_rejected("", "shorter than the 8-byte header length");
    check_rejected("\x01\x02\x03", "shorter than the 8-byte header length");
    check_rejected(le64(100) + "{}", "exceeds the 2 bytes after it");
    check_rejected(le64(200'000'000) + "{}", "exceeds the 100000000-byte limit");
    check_rejected(le64(uint64_t(-1)) + "{}", "exceeds the 100000000-byte limit");
    check_rejected(file_bytes(one(ok), f32x2).substr(0, 50), "exceeds");
  }
  SUBCASE("header JSON") {
    check_rejected(file_bytes("", ""), "not valid JSON");
    check_rejected(file_bytes("{\"t\":", ""), "not valid JSON");
    check_rejected(file_bytes(one(ok) + std::string(3, '\0'), f32x2), "not valid JSON");
    check_rejected(file_bytes("[]", ""), "not a JSON object");
    check_rejected(file_bytes("\"x\"", ""), "not a JSON object");
    check_rejected(file_bytes("{\"t\":\"\xff\"}", ""), "not valid JSON");
    check_rejected(file_bytes(R"({"t":{"dtype":"F32","shape":[[[1]]],"data_offsets":[0,4]}})", ""),
                   "deeper than the format allows");
    check_rejected(file_bytes(R"({"t":[1]})", ""), "tensor 't': header entry is not an object");
  }
  SUBCASE("missing or mistyped fields") {
    check_rejected(file_bytes(one(R"({"shape":[2],"data_offsets":[0,8]})"), f32x2),
                   "tensor 't': missing field 'dtype'");
    check_rejected(file_bytes(one(R"({"dtype":"F32","data_offsets":[0,8]})"), f32x2),
                   "missing field 'shape'");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2]})"), f32x2),
                   "missing field 'data_offsets'");
    check_rejected(file_bytes(one(R"({"dtype":5,"shape":[2],"data_offsets":[0,8]})"), f32x2),
                   "field 'dtype' must be a string");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})"), f32x2),
                   "field 'shape' must be a list");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})"), f32x2),
                   "field 'data_offsets' must be two non-negative integers");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,"8"]})"), f32x2),
                   "field 'data_offsets' must be two non-negative integers");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,9]})"), f32x2),
                   "field 'data_offsets' must be two non-negative integers");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[-1,8]})"), f32x2),
                   "field 'data_offsets' must be two non-negative integers");
  }
  SUBCASE("dtypes and shapes") {
    check_rejected(file_bytes(one(R"({"dtype":"Q7","shape":[2],"data_offsets":[0,8]})"), f32x2),
                   "unknown dtype 'Q7' for tensor 't'");
    check_rejected(file_bytes(one(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"), f32x2),
                   "unknown dtype 'f32'");
    check_rejected(file_bytes(one(R"({"dtype":"U16","shape":[4],"data_offsets":[0,8]})"), f32x2),
                   "unsupported dtype U16 for tensor 't'");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), f32x2),
                   "shape must hold non-negative integers");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), f32x2),
                   "shape must hold non-negative integers");
    check_rejected(
        file_bytes(one(R"({"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]})"),
                   f32x2),
        "overflows 64-bit sizes");
    check_rejected(
        file_bytes(one(R"({"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]})"),
                   ""),
        "overflows 64-bit sizes");
    check_rejected(
        file_bytes(one(R"({"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]})"),
                   f32x2),
        "shape must hold non-negative integers");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), f32x2),
                   "shape [3] of F32 needs 12 bytes but data_offsets [0,8] span 8");
    check_rejected(file_bytes(one(R"({"dtype":"F4","shape":[3],"data_offsets":[0,2]})"), "ab"),
                   "do not fill whole bytes");
  }
  SUBCASE("offsets") {
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[2],"data_offsets":[4,12]})"), f32x2),
                   "lie outside the 8-byte data buffer");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[0],"data_offsets":[8,0]})"), f32x2),
                   "begin after they end");
    check_rejected(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              f32x2),
                   "tensors 'a' and 'b' overlap");
    check_rejected(file_bytes(one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})"), f32x2),
                   "4-byte hole before tensor 't'");
    check_rejected(file_bytes(one(ok), f32x2 + "xyz"), "3 bytes after the last tensor");
  }
  SUBCASE("names and metadata") {
    check_rejected(file_bytes("{\"t\":" + ok + ",\"t\":" + ok + "}", f32x2 + f32x2),
                   "duplicate key 't'");
    check_rejected(
        file_bytes(R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                   f32x2),
        "duplicate key 'dtype'");
    check_rejected(file_bytes(R"({"__metadata__":{"k":1}})", ""),
                   "__metadata__ value for key 'k' is not a string");
    check_rejected(file_bytes(R"({"__metadata__":{"k":null}})", ""), "is not a string");
    check_rejected(file_bytes(R"({"__metadata__":["k"]})", ""),
                   "__metadata__ must be an object of strings");
    check_rejected(file_bytes(R"({"__metadata__":{},"__metadata__":{}})", ""),
                   "duplicate key '__metadata__'");
  }
  SUBCASE("files that are not files") {
    TempDir dir;
    try {
      load_safetensors(dir.file("missing.safetensors"));
      FAIL("loaded a missing file");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()).find("missing.safetensors: cannot open") != std::string::npos);
    }
    try {
      load_safetensors(dir.path().string());
      FAIL("loaded a folder");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()).find("is a directory") != std::string::npos);
    }
  }
}

TEST_CASE("safetensors says when a file is not a safetensors file") {
  const std::string f32x2 = bytes_of(std::vector<float>{1, 2});
  const std::string ok = one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})");
  // Text read as safetensors: its first 8 bytes make a length of ~8.4e18.
  check_rejected("import torch\nprint('not a checkpoint')\n",
                 "is not a safetensors file (header length 8367816142499114345 exceeds");
  check_rejected("hello\n", "is not a safetensors file (it is 6 bytes, shorter than the 8-byte");
  // A plausible length, then something that is not a JSON object.
  check_rejected(le64(2) + "\x89PNG\r\n",
                 "is not a safetensors file (the header is not a "
                 "JSON object: it starts with byte 0x89, not '{')");
  check_rejected(le64(4) + "[1] ",
                 "is not a safetensors file (the header is not a JSON "
                 "object: it starts with '[', not '{')");
  // Truncated past the header start: still says what it starts with.
  check_rejected(le64(1000) + "<html>",
                 "is not a safetensors file (the header is not a JSON "
                 "object: it starts with '<'");
  // A UTF-8 byte order mark before the JSON (nlohmann would skip it silently).
  check_rejected(file_bytes("\xEF\xBB\xBF" + ok, f32x2),
                 "is not a safetensors file (the header starts with a UTF-8 byte order mark "
                 "(EF BB BF)");
  // A real file still loads, and a real truncation still says so.
  CHECK(parse_safetensors(to_bytes(file_bytes(ok, f32x2))).tensors.size() == 1);
  check_rejected(le64(1000) + ok, "exceeds the 54 bytes after it (truncated file?)");
}

TEST_CASE("safetensors refuses block-dtype shapes whose sizes overflow; so does make_tensor") {
  // nf4 [2^63 - 1, 2]: the element count wrapped to -2 and the byte count to 0,
  // so an empty U8 entry matched it; slicing and cloning it then crashed.
  auto nf4_file = [](const std::string& shape) {
    return file_bytes(R"({"__metadata__":{"quanta.dtype.w":"nf4 )" + shape +
                          R"("},"w":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})",
                      "");
  };
  check_rejected(nf4_file("[9223372036854775807, 2]"),
                 "tensor 'w': metadata 'quanta.dtype.w' gives shape [9223372036854775807, 2], "
                 "which overflows 64-bit sizes");
  check_rejected(nf4_file("[3037000500, 3037000500]"), "which overflows 64-bit sizes");
  // Zero elements, but the non-zero sizes multiply out in the strides.
  check_rejected(nf4_file("[0, 4611686018427387904, 4]"), "which overflows 64-bit sizes");
  // A sane nf4 entry of zero bytes still loads.
  const auto f = parse_safetensors(to_bytes(nf4_file("[0, 64]")));
  CHECK(find(f, "w").dtype() == DType::nf4);
  CHECK(find(f, "w").shape() == Shape{0, 64});

  // make_tensor checks the same products, naming the shape.
  const int64_t big = std::numeric_limits<int64_t>::max();
  CHECK_THROWS_WITH_AS(empty({big, 2}, {.dtype = DType::nf4}),
                       "[empty] shape [9223372036854775807, 2] of nf4 overflows 64-bit sizes",
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(empty({int64_t{1} << 61}, {.dtype = DType::f64}),
                       doctest::Contains("overflows 64-bit sizes"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(empty({0, int64_t{1} << 62, 4}), doctest::Contains("overflows 64-bit sizes"),
                       std::invalid_argument);
  CHECK(empty({0, int64_t{1} << 40}).numel() == 0);
  // The helper itself.
  CHECK(checked_mul(big, 1) == big);
  CHECK(!checked_mul(big, 2));
  CHECK(!checked_mul(-1, 2));
  CHECK(checked_numel({3, 0, 5}) == 0);
  CHECK(!checked_numel({big, 2}));
}

TEST_CASE("safetensors survives random corruption") {
  TensorMap in = every_dtype();
  const std::vector<uint8_t> valid = serialize_safetensors(in, {{"k", "v"}, {"x", "y"}});
  uint64_t header_end = 0;
  std::memcpy(&header_end, valid.data(), 8);
  header_end += 8;

  std::mt19937_64 rng(20240611);
  auto pick = [&](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int loaded = 0, rejected = 0, iterations = 0;
  for (; iterations < 30000 && std::chrono::steady_clock::now() < deadline; ++iterations) {
    std::vector<uint8_t> b = valid;
    switch (pick(6)) {
      case 0:  // flip a few bytes anywhere
        for (uint64_t k = 0, m = 1 + pick(4); k < m; ++k) b[pick(b.size())] ^= 1 + pick(255);
        break;
      case 1:  // flip a byte inside the header, where it changes the meaning
        b[8 + pick(header_end - 8)] = static_cast<uint8_t>(pick(128));
        break;
      case 2:  // truncate
        b.resize(pick(b.size()));
        break;
      case 3:  // a random header length
        for (int k = 0; k < 8; ++k) b[k] = static_cast<uint8_t>(k < 2 ? pick(256) : 0);
        break;
      case 4:  // insert or delete bytes in the header
        if (pick(2))
          b.insert(b.begin() + long(8 + pick(header_end - 8)), static_cast<uint8_t>(pick(256)));
        else
          b.erase(b.begin() + long(8 + pick(header_end - 8)));
        break;
      case 5:  // change a digit of the header (offsets, shapes)
        for (int tries = 0; tries < 50; ++tries) {
          auto& c = b[8 + pick(header_end - 8)];
          if (c >= '0' && c <= '9') {
            c = static_cast<uint8_t>('0' + pick(10));
            break;
          }
        }
        break;
    }
    try {
      parse_safetensors(b);
      ++loaded;
    } catch (const std::invalid_argument&) {
      ++rejected;
    } catch (const std::runtime_error&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL("unexpected exception type: " << e.what());
    } catch (...) {
      FAIL("non-standard exception");
    }
  }
  MESSAGE(iterations << " mutations: " << loaded << " loaded, " << rejected << " rejected");
  CHECK(iterations >= 1000);
  CHECK(rejected > 0);
  CHECK(loaded > 0);
}
