// The NF4 subcommands run through the real binary (QUANTA_EXE): `quanta
// quantize` in every format on a tiny checkpoint made here (tensors, dtypes,
// metadata and the printed per-tensor error checked against the library),
// `quanta inspect`'s NF4 bits lines and `quanta bench nf4 --json`.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cli_runner.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_interop.h"
#include "quanta.h"

using namespace quanta;
using quanta::test::contains;
using quanta::test::run_quanta;
using quanta::test::ScratchDir;

namespace {

// A checkpoint with two eligible weights ([64, 128] and [128, 128]: the
// second holds 16384 elements, as torchao needs at block 64) and tensors that
// are copied as they are (a bias, a 1-d weight, a non-weight).
io::TensorMap tiny_checkpoint() {
  Generator gen(77);
  return {{"layer0.weight", randn({64, 128}, gen)},
          {"layer0.bias", randn({64}, gen)},
          {"layer1.weight", randn({128, 128}, gen) * 0.5},
          {"norm.weight", ones({64})},
          {"embed", randn({10, 8}, gen)}};
}

const Tensor& find(const io::TensorMap& m, const std::string& name) {
  for (const auto& [n, t] : m)
    if (n == name) return t;
  FAIL("no tensor " << name);
  static Tensor none;
  return none;
}

std::map<std::string, Tensor> as_map(const io::SafetensorsFile& f) {
  return {f.tensors.begin(), f.tensors.end()};
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// The printed row of `name`: rmse, max_abs, bytes, nf4_bytes (after the shape).
struct Row {
  double rmse = -1, max_abs = -1;
  long long bytes = -1, nf4_bytes = -1;
};

Row printed_row(const std::string& out, const std::string& name) {
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(name + " ", 0) != 0 || !contains(line, "]")) continue;
    Row r;
    std::istringstream rest(line.substr(line.find(']') + 1));
    rest >> r.rmse >> r.max_abs >> r.bytes >> r.nf4_bytes;
    return r;
  }
  return {};
}

std::string line_with(const std::string& out, const std::string& part) {
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line))
    if (contains(line, part)) return line;
  return "";
}

// RMSE and max |error| of `values` against `weight`.
std::pair<double, double> error_of(const Tensor& weight, const Tensor& values) {
  const Tensor w = weight.to(DType::f32).contiguous();
  const Tensor v = values.to(DType::f32).contiguous();
  double sq = 0, mx = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    const double e = std::abs(double(w.data<float>()[i]) - double(v.data<float>()[i]));
    sq += e * e;
    mx = std::max(mx, e);
  }
  return {std::sqrt(sq / double(w.numel())), mx};
}

// The printed row matches the error of `values` (printed with 5 digits).
void check_row(const std::string& out, const std::string& name, const Tensor& weight,
               const Tensor& values, long long nf4_bytes) {
  CAPTURE(name);
  const Row r = printed_row(out, name);
  const auto [rmse, max_abs] = error_of(weight, values);
  CHECK(rmse > 0);
  CHECK(r.rmse == doctest::Approx(rmse).epsilon(1e-4));
  CHECK(r.max_abs == doctest::Approx(max_abs).epsilon(1e-4));
  CHECK(r.bytes == static_cast<long long>(weight.nbytes()));
  CHECK(r.nf4_bytes == nf4_bytes);
}

// The copied tensors are byte for byte the input's.
void check_copied(const std::map<std::string, Tensor>& out, const io::TensorMap& in) {
  for (const char* name : {"layer0.bias", "norm.weight", "embed"}) {
    CAPTURE(name);
    REQUIRE(out.count(name));
    CHECK(out.at(name).dtype() == DType::f32);
    CHECK(bytes_of(out.at(name)) == bytes_of(find(in, name)));
  }
}

}  // namespace

TEST_CASE("quanta quantize --format quanta writes nf4 tensors and prints their error") {
  ScratchDir dir("nf4_cli");
  const io::TensorMap in = tiny_checkpoint();
  const std::string src = dir.file("in.safetensors"), dst = dir.file("out.safetensors");
  io::save_safetensors(src, in, {{"note", "kept"}});
  const auto r = run_quanta({"quantize", src, dst, "--format", "quanta"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  CHECK(r.err.empty());

  // dtype metadata as the file stores it, then the tensors as they load.
  const io::SafetensorsHeader h = io::read_safetensors_header(dst);
  CHECK(h.metadata.at("quanta.dtype.layer0.weight") == "nf4 [64,128]");
  CHECK(h.metadata.at("quanta.dtype.layer1.weight") == "nf4 [128,128]");
  CHECK(h.metadata.at("note") == "kept");
  const auto meta = nlohmann::json::parse(h.metadata.at("quanta.nf4"));
  CHECK(meta.at("format") == "quanta");
  CHECK(meta.at("block_size") == 64);
  CHECK(meta.at("double_quant") == true);
  const auto out = as_map(io::load_safetensors(dst));
  CHECK(out.size() == 5);
  check_copied(out, in);
  for (const char* name : {"layer0.weight", "layer1.weight"}) {
    const Tensor& q = out.at(name);
    CHECK(q.dtype() == DType::nf4);
    CHECK(q.shape() == find(in, name).shape());
    // Exactly what the library computes with the default options.
    const Tensor want = quant::quantize_nf4(find(in, name));
    CHECK(bytes_of(q) == bytes_of(want));
    check_row(r.out, name, find(in, name), quant::dequantize(q),
              static_cast<long long>(q.nbytes()));
  }
  const std::string summary = line_with(r.out, "tensors quantized");
  CHECK(contains(summary, "2 tensors quantized (quanta, block 64, double quant on)"));
  CHECK(contains(summary, "4.500 bits per parameter in this file"));
  CHECK(contains(summary, "quanta holds 4.500, bitsandbytes' layout 4.127"));
}

TEST_CASE("quanta quantize --format bnb writes bitsandbytes' state at the chosen block size") {
  ScratchDir dir("nf4_cli");
  const io::TensorMap in = tiny_checkpoint();
  const std::string src = dir.file("in.safetensors");
  io::save_safetensors(src, in);
  struct Case {
    std::vector<std::string> flags;
    int64_t block;
    bool dq;
  };
  for (const Case& c :
       {Case{{}, 64, true}, Case{{"--block-size", "32", "--no-double-quant"}, 32, false},
        Case{{"--block-size", "32"}, 32, true}}) {
    CAPTURE(c.block);
    CAPTURE(c.dq);
    const std::string dst = dir.file("bnb.safetensors");
    std::vector<std::string> args = {"quantize", src, dst, "--format", "bnb"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    const auto r = run_quanta(args);
    CAPTURE(r.out);
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    const auto out = as_map(io::load_safetensors(dst));
    check_copied(out, in);
    quant::NF4Options o;
    o.block_size = c.block;
    o.double_quant = c.dq;
    uint64_t payload = 0;
    for (const char* name : {"layer0.weight", "layer1.weight"}) {
      CAPTURE(name);
      const std::string n = name;
      REQUIRE(quant::has_bnb_tensors(out, n));
      CHECK(out.at(n).dtype() == DType::u8);
      CHECK(out.at(n).shape() == Shape{find(in, n).numel() / 2, 1});
      CHECK(out.at(n + ".absmax").dtype() == (c.dq ? DType::u8 : DType::f32));
      CHECK(out.at(n + ".absmax").numel() == find(in, n).numel() / c.block);
      CHECK(out.count(n + ".nested_absmax") == (c.dq ? 1u : 0u));
      const Tensor& js = out.at(n + ".quant_state.bitsandbytes__nf4");
      const auto meta =
          nlohmann::json::parse(std::string(js.data<uint8_t>(), js.data<uint8_t>() + js.numel()));
      CHECK(meta.at("quant_type") == "nf4");
      CHECK(meta.at("blocksize") == c.block);
      CHECK(meta.at("shape") == find(in, n).shape());
      CHECK(meta.contains("nested_offset") == c.dq);
      const quant::BnbNF4State s = quant::read_bnb_tensors(out, n);
      const quant::BnbNF4State want = quant::quantize_bnb(find(in, n), o);
      CHECK(bytes_of(s.packed) == bytes_of(want.packed));
      CHECK(bytes_of(s.absmax) == bytes_of(want.absmax));
      check_row(r.out, n, find(in, n), quant::dequantize(s),
                static_cast<long long>(quant::bnb_payload_bytes(s)));
      payload += quant::bnb_payload_bytes(s);
    }
    char bits[64];
    std::snprintf(bits, sizeof bits, "%.3f bits per parameter in this file",
                  8.0 * double(payload) / (64 * 128 + 128 * 128));
    CHECK(contains(line_with(r.out, "tensors quantized"), bits));
  }
}

TEST_CASE("quanta quantize --format torchao, its re-import, and refused combinations") {
  ScratchDir dir("nf4_cli");
  const io::TensorMap in = tiny_checkpoint();
  const std::string src = dir.file("in.safetensors"), ao = dir.file("ao.safetensors");
  io::save_safetensors(src, in);
  const auto r = run_quanta({"quantize", src, ao, "--format", "torchao"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  // 8192 elements: torchao cannot hold it at block 64; it is copied and said so.
  CHECK(contains(line_with(r.out, "layer0.weight"), "skipped: torchao needs numel % 16384"));
  const io::SafetensorsFile f = io::load_safetensors(ao);
  const auto out = as_map(f);
  CHECK(out.at("layer0.weight").dtype() == DType::f32);
  check_copied(out, in);
  const auto meta = nlohmann::json::parse(f.metadata.at("layer1.weight.torchao_nf4"));
  CHECK(meta.at("shape") == Shape{128, 128});
  CHECK(meta.at("block_size") == 64);
  CHECK(out.at("layer1.weight.quantized_data").numel() == 8192);
  CHECK(out.at("layer1.weight.quantized_scalers").numel() == 256);
  const quant::TorchaoNF4State s = quant::read_torchao_tensors(out, f.metadata, "layer1.weight");
  check_row(r.out, "layer1.weight", find(in, "layer1.weight"), quant::torchao_dequantize(s),
            8192 + 256 + 4);

  // Importing the torchao file into the nf4 dtype keeps its codes.
  const std::string back = dir.file("back.safetensors");
  const auto r2 = run_quanta({"quantize", ao, back, "--format", "quanta"});
  CAPTURE(r2.out);
  REQUIRE(r2.code == 0);
  CHECK(contains(line_with(r2.out, "layer1.weight"), "imported NF4 [128, 128] (block 64)"));
  const auto b = as_map(io::load_safetensors(back));
  CHECK(b.at("layer1.weight").dtype() == DType::nf4);
  CHECK(quant::nf4_codes(b.at("layer1.weight")).to_vector<int>() ==
        quant::nf4_codes(quant::from_torchao(s)).to_vector<int>());
  // layer0.weight was plain f32 in the torchao file: quantized now.
  CHECK(b.at("layer0.weight").dtype() == DType::nf4);

  // Block 32 does not fit the nf4 dtype; torchao always double-quantizes.
  quanta::test::check_one_line_error(
      run_quanta({"quantize", src, dir.file("x.safetensors"), "--block-size", "32"}), 2,
      "needs --format bnb or torchao");
  quanta::test::check_one_line_error(run_quanta({"quantize", src, dir.file("x.safetensors"),
                                                 "--format", "torchao", "--no-double-quant"}),
                                     2, "always double-quantizes");
  quanta::test::check_one_line_error(
      run_quanta({"quantize", src, dir.file("x.safetensors"), "--block-size", "48"}), 2,
      "block_size must be 32, 64, 128 or 256");
}

TEST_CASE("quanta quantize refuses to write over its input, by name or through a link") {
  ScratchDir dir("nf4_cli_same");
  const std::string src = dir.file("in.safetensors"), link = dir.file("link.safetensors");
  io::save_safetensors(src, tiny_checkpoint());
  const std::string before = quanta::test::slurp(src);
  std::filesystem::create_symlink(src, link);
  for (const std::string& out : {src, link}) {
    CAPTURE(out);
    const auto r = run_quanta({"quantize", src, out});
    quanta::test::check_one_line_error(r, 2, "OUT " + out + " is the input checkpoint IN");
    CHECK(contains(r.err, "writing it would destroy that input"));
    CHECK(quanta::test::slurp(src) == before);  // untouched
  }
}

TEST_CASE("quanta inspect reports the bits per parameter of each NF4 layout") {
  ScratchDir dir("nf4_cli");
  const std::string src = dir.file("in.safetensors");
  io::save_safetensors(src, tiny_checkpoint());
  const std::string q = dir.file("q.safetensors"), bnb = dir.file("bnb.safetensors"),
                    ao = dir.file("ao.safetensors");
  REQUIRE(run_quanta({"quantize", src, q}).code == 0);
  REQUIRE(run_quanta({"quantize", src, bnb, "--format", "bnb"}).code == 0);
  REQUIRE(run_quanta({"quantize", src, ao, "--format", "torchao"}).code == 0);

  // quanta layout: 36 bytes per 64 elements, and what bitsandbytes' layout of
  // the same tensors costs: 8192 and 16384 elements at block 64 with double
  // quant are 4096 + 128 + 4 and 8192 + 256 + 4 bytes.
  const auto rq = run_quanta({"inspect", q});
  CAPTURE(rq.out);
  REQUIRE(rq.code == 0);
  char want[200];
  std::snprintf(want, sizeof want,
                "nf4 (quanta layout): 2 tensors, 24576 parameters, 13824 bytes: 4.500 bits per "
                "parameter; bitsandbytes' layout at block 64: %.3f (double quant)",
                8.0 * (4096 + 128 + 4 + 8192 + 256 + 4) / 24576);
  CHECK(line_with(rq.out, "nf4 (") == want);
  CHECK(!contains(rq.out, "nf4 (bitsandbytes"));

  const auto rb = run_quanta({"inspect", bnb});
  CAPTURE(rb.out);
  REQUIRE(rb.code == 0);
  std::snprintf(want, sizeof want,
                "nf4 (bitsandbytes layout): 2 tensors, 24576 parameters, %d bytes: %.3f bits "
                "per parameter",
                4096 + 128 + 4 + 8192 + 256 + 4, 8.0 * (4096 + 128 + 4 + 8192 + 256 + 4) / 24576);
  CHECK(line_with(rb.out, "nf4 (") == want);

  // torchao: codes, int8 scalers and one f32 factor per 256 blocks (4.127).
  const auto ra = run_quanta({"inspect", ao});
  CAPTURE(ra.out);
  REQUIRE(ra.code == 0);
  CHECK(line_with(ra.out, "nf4 (") ==
        "nf4 (torchao layout): 1 tensors, 16384 parameters, 8452 bytes: 4.127 bits per "
        "parameter");

  // --json: one object per layout.
  const auto rj = run_quanta({"inspect", q, "--json"});
  REQUIRE(rj.code == 0);
  const auto j = nlohmann::json::parse(rj.out).at("nf4");
  CHECK(j.at("quanta").at("bits_per_parameter") == 4.5);
  CHECK(j.at("quanta").at("double_quant") == true);
  CHECK(j.at("quanta").at("bnb_export").at("block_size") == 64);
  CHECK(j.at("quanta").at("bnb_export").at("no_double_quant").get<double>() ==
        doctest::Approx(8.0 * (4096 + 512 + 8192 + 1024) / 24576));
  const auto ja = nlohmann::json::parse(run_quanta({"inspect", ao, "--json"}).out).at("nf4");
  CHECK(ja.at("torchao").at("bits_per_parameter").get<double>() ==
        doctest::Approx(8.0 * 8452 / 16384));
  CHECK(!ja.contains("quanta"));
}

// The JSON state bitsandbytes stores with weight `name`.
nlohmann::json bnb_json(const std::map<std::string, Tensor>& m, const std::string& name) {
  const Tensor& js = m.at(name + ".quant_state.bitsandbytes__nf4");
  return nlohmann::json::parse(std::string(js.data<uint8_t>(), js.data<uint8_t>() + js.numel()));
}

// Every tensor bitsandbytes' state of `name` has in `m`, as bytes.
std::map<std::string, std::vector<uint8_t>> bnb_entries(const std::map<std::string, Tensor>& m,
                                                        const std::string& name) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& [n, t] : m)
    if (n.rfind(name, 0) == 0) out[n] = bytes_of(t);
  return out;
}

TEST_CASE("quanta quantize converts quanta-layout NF4 files to bitsandbytes' layout and back") {
  ScratchDir dir("nf4_cli");
  const io::TensorMap in = tiny_checkpoint();
  const std::string src = dir.file("in.safetensors"), q = dir.file("q.safetensors"),
                    bnb = dir.file("bnb.safetensors"), back = dir.file("back.safetensors");
  io::save_safetensors(src, in);
  struct Case {
    std::vector<std::string> flags;
    int64_t block;
    bool dq;
  };
  for (const Case& c :
       {Case{{"--no-double-quant"}, 64, false},
        Case{{"--block-size", "128", "--no-double-quant"}, 128, false}, Case{{}, 64, true}}) {
    CAPTURE(c.block);
    CAPTURE(c.dq);
    std::vector<std::string> args = {"quantize", src, q};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    REQUIRE(run_quanta(args).code == 0);
    const auto qf = as_map(io::load_safetensors(q));

    // quanta -> bnb: bitsandbytes' state at the recorded block size and
    // double-quant setting, never the quanta bytes under a bnb label.
    const auto r = run_quanta({"quantize", q, bnb, "--format", "bnb"});
    CAPTURE(r.out);
    CAPTURE(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.empty());
    const io::SafetensorsHeader h = io::read_safetensors_header(bnb);
    const auto out = as_map(io::load_safetensors(bnb));
    check_copied(out, in);
    for (const char* name : {"layer0.weight", "layer1.weight"}) {
      CAPTURE(name);
      const std::string n = name;
      CHECK(h.metadata.count("quanta.dtype." + n) == 0);
      REQUIRE(quant::has_bnb_tensors(out, n));
      CHECK(out.at(n).dtype() == DType::u8);
      CHECK(out.at(n).shape() == Shape{find(in, n).numel() / 2, 1});
      const auto meta = bnb_json(out, n);
      CHECK(meta.at("quant_type") == "nf4");
      CHECK(meta.at("blocksize") == c.block);
      CHECK(meta.at("shape") == find(in, n).shape());
      CHECK(meta.contains("nested_offset") == c.dq);
      const quant::BnbNF4State s = quant::read_bnb_tensors(out, n);
      // The codes bitsandbytes' quantize_4bit gives the original weight.
      quant::NF4Options o;
      o.block_size = c.block;
      o.double_quant = false;
      const quant::BnbNF4State want = quant::quantize_bnb(find(in, n), o);
      CHECK(bytes_of(s.packed) == bytes_of(want.packed));
      const std::string line = line_with(r.out, n + " ");
      CHECK(contains(line, "from the quanta layout"));
      if (!c.dq) {
        // Exact scales: bitsandbytes' own bytes, the quanta file's values.
        CHECK(bytes_of(s.absmax) == bytes_of(want.absmax));
        CHECK(quant::dequantize(s).to_vector<float>() ==
              quant::dequantize(qf.at(n)).to_vector<float>());
        CHECK(contains(line, "values unchanged"));
      } else {
        CHECK(out.at(n + ".absmax").dtype() == DType::u8);
        CHECK(max(abs(quant::dequantize(s) - quant::dequantize(qf.at(n)))).item() <
              0.01 * max(abs(find(in, n))).item());
      }
    }
    CHECK(contains(r.out, "nothing to quantize"));
    CHECK(contains(r.out, "NF4 tensors already in the input: 2 written as bnb"));

    // And back: bnb -> quanta gives the nf4 tensors again (the same bytes
    // when no scale was rounded on the way).
    const auto r2 = run_quanta({"quantize", bnb, back, "--format", "quanta"});
    CAPTURE(r2.out);
    REQUIRE(r2.code == 0);
    const auto b = as_map(io::load_safetensors(back));
    for (const char* name : {"layer0.weight", "layer1.weight"}) {
      CAPTURE(name);
      REQUIRE(b.at(name).dtype() == DType::nf4);
      if (!c.dq) {
        CHECK(bytes_of(b.at(name)) == bytes_of(qf.at(name)));
      } else {
        CHECK(quant::nf4_codes(b.at(name)).to_vector<int>() ==
              quant::nf4_codes(qf.at(name)).to_vector<int>());
      }
    }
  }

  // quanta -> torchao: converted where torchao can hold it (16384 elements);
  // the 8192-element weight is refused, kept in the quanta layout, exit 1.
  REQUIRE(run_quanta({"quantize", src, q}).code == 0);
  const std::string ao = dir.file("ao.safetensors");
  const auto r3 = run_quanta({"quantize", q, ao, "--format", "torchao"});
  CAPTURE(r3.out);
  CAPTURE(r3.err);
  CHECK(r3.code == 1);
  CHECK(contains(line_with(r3.out, "layer0.weight "), "refused: [to_torchao] torchao needs"));
  CHECK(contains(r3.err, "1 NF4 tensor refused ('layer0.weight'"));
  const io::SafetensorsFile f = io::load_safetensors(ao);
  const auto a = as_map(f);
  CHECK(a.at("layer0.weight").dtype() == DType::nf4);
  const quant::TorchaoNF4State t = quant::read_torchao_tensors(a, f.metadata, "layer1.weight");
  CHECK(quant::nf4_codes(quant::from_torchao(t)).to_vector<int>() ==
        quant::nf4_codes(as_map(io::load_safetensors(q)).at("layer1.weight")).to_vector<int>());
}

TEST_CASE("quanta quantize keeps the double quantization of imported weights unless asked") {
  ScratchDir dir("nf4_cli");
  const io::TensorMap in = tiny_checkpoint();
  const std::string src = dir.file("in.safetensors"), plain = dir.file("plain.safetensors"),
                    dq = dir.file("dq.safetensors"), out = dir.file("out.safetensors");
  io::save_safetensors(src, in);
  REQUIRE(run_quanta({"quantize", src, plain, "--format", "bnb", "--no-double-quant"}).code == 0);
  REQUIRE(run_quanta({"quantize", src, dq, "--format", "bnb"}).code == 0);
  const auto p = as_map(io::load_safetensors(plain));
  const auto d = as_map(io::load_safetensors(dq));

  // bnb without double quant -> bnb: the same bytes (the scales used to be
  // double-quantized, up to 0.055 off).
  auto r = run_quanta({"quantize", plain, out, "--format", "bnb"});
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  auto o = as_map(io::load_safetensors(out));
  for (const char* name : {"layer0.weight", "layer1.weight"}) {
    CAPTURE(name);
    CHECK(bnb_entries(o, name) == bnb_entries(p, name));
    CHECK(o.at(std::string(name) + ".absmax").dtype() == DType::f32);
    CHECK(contains(line_with(r.out, std::string(name) + " "),
                   "double quant off; written as bnb, double quant off: values unchanged"));
  }
  CHECK(nlohmann::json::parse(io::load_safetensors(out).metadata.at("quanta.nf4"))
            .at("double_quant") == false);

  // Asked for: --double-quant rounds the scales, the codes stay.
  r = run_quanta({"quantize", plain, out, "--format", "bnb", "--double-quant"});
  REQUIRE(r.code == 0);
  o = as_map(io::load_safetensors(out));
  for (const char* name : {"layer0.weight", "layer1.weight"}) {
    CAPTURE(name);
    const std::string n = name;
    CHECK(o.at(n + ".absmax").dtype() == DType::u8);
    CHECK(o.count(n + ".nested_absmax") == 1);
    CHECK(bytes_of(o.at(n)) == bytes_of(p.at(n)));
    CHECK(contains(line_with(r.out, n + " "), "values change by at most"));
  }

  // bnb with double quant -> bnb: the same bytes; --no-double-quant stores
  // the scales bitsandbytes reconstructs, so the values stay.
  r = run_quanta({"quantize", dq, out, "--format", "bnb"});
  REQUIRE(r.code == 0);
  o = as_map(io::load_safetensors(out));
  CHECK(bnb_entries(o, "layer1.weight") == bnb_entries(d, "layer1.weight"));
  r = run_quanta({"quantize", dq, out, "--format", "bnb", "--no-double-quant"});
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  o = as_map(io::load_safetensors(out));
  const quant::BnbNF4State s = quant::read_bnb_tensors(o, "layer1.weight");
  CHECK(!s.double_quant);
  CHECK(quant::dequantize(s).to_vector<float>() ==
        quant::dequantize(quant::read_bnb_tensors(d, "layer1.weight")).to_vector<float>());
  CHECK(contains(line_with(r.out, "layer1.weight "), "values unchanged"));

  // Both flags at once is a usage error.
  CHECK(run_quanta({"quantize", plain, out, "--double-quant", "--no-double-quant"}).code == 2);
}

TEST_CASE("quanta quantize applies --exclude to imported NF4 weights and refuses per tensor") {
  ScratchDir dir("nf4_cli");
  Generator gen(5);
  quant::NF4Options b32;
  b32.block_size = 32;
  io::TensorMap m;
  const Tensor w0 = randn({16, 64}, gen), w1 = randn({8, 128}, gen);
  quant::append_bnb_tensors(m, "layer0.weight", quant::quantize_bnb(w0, b32));
  quant::append_bnb_tensors(m, "layer1.weight", quant::quantize_bnb(w1));
  m.emplace_back("layer2.weight", randn({4, 64}, gen));
  const std::string src = dir.file("in.safetensors"), out = dir.file("out.safetensors");
  io::save_safetensors(src, m);
  const auto in = as_map(io::load_safetensors(src));

  // Block 32 cannot be the nf4 dtype: that weight alone is refused and kept
  // in its layout; the others are written; the run fails at the end.
  auto r = run_quanta({"quantize", src, out, "--format", "quanta"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  CHECK(r.code == 1);
  CHECK(contains(line_with(r.out, "layer0.weight "), "refused: block size 32 needs two scales"));
  CHECK(contains(line_with(r.out, "layer0.weight "), "copied in its bitsandbytes layout"));
  CHECK(contains(line_with(r.out, "layer1.weight "), "written as quanta"));
  CHECK(contains(r.out, "1 tensors quantized"));
  CHECK(r.err.rfind("quanta: error: 1 NF4 tensor refused ('layer0.weight', see above)", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  auto o = as_map(io::load_safetensors(out));
  CHECK(bnb_entries(o, "layer0.weight") == bnb_entries(in, "layer0.weight"));
  CHECK(o.at("layer1.weight").dtype() == DType::nf4);
  CHECK(o.at("layer2.weight").dtype() == DType::nf4);

  // --exclude reaches imported weights: layer0 is copied, nothing refused.
  r = run_quanta({"quantize", src, out, "--format", "quanta", "--exclude", "layer0"});
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  CHECK(contains(line_with(r.out, "layer0.weight "), "not selected by --include/--exclude"));
  o = as_map(io::load_safetensors(out));
  CHECK(bnb_entries(o, "layer0.weight") == bnb_entries(in, "layer0.weight"));
  CHECK(o.at("layer1.weight").dtype() == DType::nf4);

  r = run_quanta(
      {"quantize", src, out, "--format", "quanta", "--exclude", "layer0", "--exclude", "layer1"});
  REQUIRE(r.code == 0);
  o = as_map(io::load_safetensors(out));
  CHECK(bnb_entries(o, "layer1.weight") == bnb_entries(in, "layer1.weight"));
}

TEST_CASE("quanta inspect counts odd bnb weights exactly; nothing to quantize says so") {
  ScratchDir dir("nf4_cli");
  Generator gen(6);
  io::TensorMap m;
  quant::append_bnb_tensors(m, "odd.weight", quant::quantize_bnb(randn({5, 77}, gen)));
  const std::string odd = dir.file("odd.safetensors");
  io::save_safetensors(odd, m);
  const auto r = run_quanta({"inspect", odd});
  CAPTURE(r.out);
  REQUIRE(r.code == 0);
  CHECK(
      contains(line_with(r.out, "nf4 ("), "nf4 (bitsandbytes layout): 1 tensors, 385 parameters"));
  const auto j = nlohmann::json::parse(run_quanta({"inspect", odd, "--json"}).out);
  CHECK(j.at("nf4").at("bitsandbytes").at("parameters") == 385);

  // No eligible tensor: exit 0, and a line that says so instead of bits.
  const std::string none = dir.file("none.safetensors"), out = dir.file("out.safetensors");
  io::save_safetensors(none, {{"bias", randn({4}, gen)}, {"embed", randn({3, 3}, gen)}});
  const auto q = run_quanta({"quantize", none, out});
  CAPTURE(q.out);
  CHECK(q.code == 0);
  CHECK(contains(q.out, "nothing to quantize: " + none +
                            " has no 2-d floating tensor whose name ends in 'weight'\n"));
  CHECK(!contains(q.out, "bits per parameter"));
  CHECK(!contains(q.out, "smaller"));
  CHECK(contains(q.out, "every tensor copied as it was to " + out));
  io::save_safetensors(none, {{"layer.weight", randn({4, 64}, gen)}});
  const auto x = run_quanta({"quantize", none, out, "--exclude", "layer"});
  CHECK(x.code == 0);
  CHECK(contains(x.out, "'weight' and that --include/--exclude select"));

  // A file of another kind is named as such.
  const std::string text = dir.file("notes.txt");
  std::FILE* fp = std::fopen(text.c_str(), "w");
  REQUIRE(fp != nullptr);
  std::fputs("these are notes, not tensors\n", fp);
  std::fclose(fp);
  quanta::test::check_one_line_error(run_quanta({"inspect", text}), 1,
                                     text + " is not a safetensors file (header length");
}

TEST_CASE("quanta bench nf4 --size small --json gives every row with positive times") {
  const auto r = run_quanta({"bench", "nf4", "--size", "small", "--json", "--repeat", "1"});
  CAPTURE(r.out);
  CAPTURE(r.err);
  REQUIRE(r.code == 0);
  const auto rows = nlohmann::json::parse(r.out);
  std::set<std::string> names;
  for (const auto& row : rows) {
    const std::string name = row.at("name");
    CAPTURE(name);
    names.insert(name);
    CHECK(row.at("ms").get<double>() > 0);
    CHECK(row.at("floor_ms").get<double>() > 0);
    CHECK(row.at("ratio").get<double>() > 0);
  }
  for (const char* want :
       {"nf4_quantize", "nf4_dequantize", "nf4_linear_b1", "nf4_linear_b16", "nf4_linear_b512"})
    CHECK(names.count(want) == 1);
}
