// FSQ and ResidualFSQ invariants: codes on the level grid, exact index round
// trips and coverage, straight-through gradients, layouts, zero-size inputs,
// noise dropout, rotation and quantize dropout.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>

#include "quant/scalar/fsq.h"
#include "quant/scalar/residual_fsq.h"
#include "scalar_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using namespace scalar_test;

namespace {

FSQOptions fsq_opts(std::vector<int64_t> levels, bool symmetric = false) {
  FSQOptions o;
  o.levels = std::move(levels);
  o.preserve_symmetry = symmetric;
  return o;
}

// Is every code component one of the L grid values of its dimension?
void check_on_grid(const FSQ& fsq, const Tensor& codes) {
  const auto& L = fsq.options().levels;
  const int64_t d = int64_t(L.size());
  const auto v = vals(codes);
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t l = L[i % d];
    const double level = fsq.options().preserve_symmetry ? (v[i] + 1) * double(l - 1) / 2
                                                         : v[i] * double(l / 2) + double(l / 2);
    REQUIRE(std::abs(level - std::round(level)) < 1e-5);
    REQUIRE(level > -0.5);
    REQUIRE(level < double(l) - 0.5);
  }
}

}  // namespace

TEST_CASE("FSQ codes lie on the level grid and round-trip through indices") {
  Generator gen(7);
  for (bool symmetric : {false, true}) {
    for (const auto& levels :
         std::vector<std::vector<int64_t>>{{8, 5, 5, 5}, {8, 6, 5}, {7, 5, 5, 5, 5}, {3, 4}}) {
      FSQ fsq(fsq_opts(levels, symmetric), gen);
      const Tensor x = randn({3, 50, int64_t(levels.size())}, gen) * 3.0;
      const QuantizeOutput out = fsq.forward(x, Tensor());
      CHECK(out.indices.dtype() == DType::i32);
      CHECK(out.indices.shape() == Shape{3, 50});
      check_on_grid(fsq, out.quantized);
      // indices -> codes gives the quantized output (to the last f32 bit: the
      // symmetric grid is step * level - 1 computed two ways)
      CHECK(max_abs_diff(fsq.indices_to_codes(out.indices), out.quantized) < 1e-7);
      CHECK(out.loss.item() == 0.0);
    }
  }
}

TEST_CASE("FSQ indices cover exactly prod(levels) values") {
  Generator gen(3);
  for (bool symmetric : {false, true}) {
    FSQ fsq(fsq_opts({8, 6, 5}, symmetric), gen);
    CHECK(fsq.codebook_size() == 240);
    CHECK(fsq.basis() == std::vector<int64_t>{1, 8, 48});
    const Tensor book = fsq.implicit_codebook();
    CHECK(book.shape() == Shape{240, 3});
    const auto idx = fsq.codes_to_indices(book).to_vector<int64_t>();
    for (int64_t i = 0; i < 240; ++i) CHECK(idx[i] == i);
    // Quantizing the whole codebook's pre-images hits every index once.
    std::set<std::vector<double>> distinct;
    const auto v = vals(book);
    for (int64_t i = 0; i < 240; ++i) distinct.insert({v[3 * i], v[3 * i + 1], v[3 * i + 2]});
    CHECK(distinct.size() == 240);
    // Level indices invert the basis.
    const auto lv = fsq.indices_to_level_indices(arange(240)).to_vector<int64_t>();
    for (int64_t i = 0; i < 240; ++i)
      CHECK(lv[3 * i] + 8 * lv[3 * i + 1] + 48 * lv[3 * i + 2] == i);
  }
  // Many dense random inputs reach every one of the 1000 codes of [8, 5, 5, 5].
  FSQ fsq(fsq_opts({8, 5, 5, 5}), gen);
  const auto idx =
      fsq.forward(randn({1, 40000, 4}, gen) * 2.0, Tensor()).indices.to_vector<int64_t>();
  std::set<int64_t> seen(idx.begin(), idx.end());
  CHECK(seen.size() == 1000);
  CHECK(*seen.begin() == 0);
  CHECK(*seen.rbegin() == 999);
}

TEST_CASE("FSQ gradient is straight through the rounding (f64)") {
  Generator gen(11);
  // With projections: autograd of FSQ equals central differences of the same
  // network with the rounding removed, for the input and every parameter.
  FSQOptions o = fsq_opts({8, 5, 5});
  o.dim = 6;
  FSQ fsq(o, gen);
  fsq.to(DType::f64);
  const Tensor x = randn({2, 5, 6}, gen, {.dtype = DType::f64}).requires_grad_();
  const Tensor w = randn({2, 5, 6}, gen, {.dtype = DType::f64});
  const Tensor W_in = fsq.find("project_in.weight"), b_in = fsq.find("project_in.bias");
  const Tensor W_out = fsq.find("project_out.weight");
  const std::vector<double> half_l{7 * 1.001 / 2, 4 * 1.001 / 2, 4 * 1.001 / 2};
  const std::vector<double> offset{0.5, 0, 0}, hw{4, 2, 2};
  auto surrogate = [&]() {
    const Tensor z = linear(x.detach(), W_in.detach(), b_in.detach());
    std::vector<Tensor> cols;
    for (int i = 0; i < 3; ++i) {
      const double shift = std::atanh(offset[i] / half_l[i]);
      cols.push_back((tanh(select(z, -1, i) + shift) * half_l[i] - offset[i]) / hw[i]);
    }
    const Tensor y = linear(stack(cols, -1), W_out.detach(), fsq.find("project_out.bias"));
    return sum(y * w).item();
  };
  const QuantizeOutput out = fsq.forward(x, Tensor());
  sum(out.quantized * w).backward();
  CHECK(rel_err(x.grad(), numeric_grad(x, surrogate)) < 1e-6);
  CHECK(rel_err(W_in.grad(), numeric_grad(W_in, surrogate)) < 1e-6);
  CHECK(rel_err(b_in.grad(), numeric_grad(b_in, surrogate)) < 1e-6);
  // project_out sees constant codes: plain central differences of FSQ itself.
  auto real = [&]() { return sum(fsq.forward(x.detach(), Tensor()).quantized * w).item(); };
  CHECK(rel_err(W_out.grad(), numeric_grad(W_out, real)) < 1e-6);
}

TEST_CASE("FSQ symmetric bound gradient: straight through the floor") {
  Generator gen(0);
  FSQ fsq(fsq_opts({2, 4}, true), gen);
  const Tensor x = from_vector<double>({0.3, -0.7, 1.2, 0.1}, {1, 2, 2}).requires_grad_();
  sum(fsq.forward(x, Tensor()).quantized).backward();
  // d/dz [2/(L-1) * (L-1)(tanh z + 1)/2] = 1 - tanh(z)^2
  const auto g = vals(x.grad());
  const std::vector<double> xv{0.3, -0.7, 1.2, 0.1};
  for (int i = 0; i < 4; ++i) CHECK(g[i] == doctest::Approx(1 - std::pow(std::tanh(xv[i]), 2)));
}

TEST_CASE("FSQ layouts: channel-first, image maps, several codebooks") {
  Generator gen(5);
  FSQOptions o = fsq_opts({8, 5, 5, 5});
  o.num_codebooks = 2;
  FSQ fsq(o, gen);
  const Tensor x = randn({2, 3, 8}, gen);
  const QuantizeOutput a = fsq.forward(x, Tensor());
  CHECK(a.indices.shape() == Shape{2, 3, 2});
  CHECK(max_abs_diff(fsq.indices_to_codes(a.indices), a.quantized) == 0.0);
  // The same tokens as an image [B, D, H, W]: same codes, channel-first.
  const Tensor img = permute(reshape(x, {2, 3, 1, 8}), {0, 3, 1, 2});
  const QuantizeOutput b = fsq.forward(img, Tensor());
  CHECK(b.quantized.shape() == Shape{2, 8, 3, 1});
  CHECK(b.indices.shape() == Shape{2, 3, 1, 2});
  CHECK(vals(b.indices) == vals(a.indices));
  CHECK(max_abs_diff(fsq.indices_to_codes(b.indices), b.quantized) == 0.0);
  FSQOptions cf = fsq_opts({8, 5, 5, 5});
  cf.channel_first = true;
  FSQ fcf(cf, gen);
  const Tensor seq = randn({2, 4, 7}, gen);
  const QuantizeOutput c = fcf.forward(seq, Tensor());
  CHECK(c.quantized.shape() == Shape{2, 4, 7});
  FSQ fcl(fsq_opts({8, 5, 5, 5}), gen);
  CHECK(max_abs_diff(c.quantized, transpose(fcl.forward(transpose(seq, 1, 2)), 1, 2)) == 0.0);
  CHECK_THROWS_WITH_AS(fsq.forward(randn({2, 3, 5}, gen), Tensor()), doctest::Contains("[FSQ]"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(FSQ(fsq_opts({2, 5}), gen), doctest::Contains("preserve_symmetry"),
                       std::invalid_argument);
}

TEST_CASE("FSQ zero-size inputs give zero-size outputs and zero loss") {
  Generator gen(0);
  FSQOptions o = fsq_opts({8, 5, 5, 5});
  o.dim = 16;
  FSQ fsq(o, gen);
  for (const Shape& s : {Shape{0, 4, 16}, Shape{2, 0, 16}}) {
    const Tensor x = zeros(s).requires_grad_();
    const QuantizeOutput out = fsq.forward(x, Tensor());
    CHECK(out.quantized.shape() == s);
    CHECK(out.indices.numel() == 0);
    CHECK(out.loss.item() == 0.0);
    sum(out.quantized).backward();
    CHECK(x.grad().shape() == s);
  }
}

TEST_CASE("FSQ noise dropout and orthogonal rotation") {
  Generator gen(9);
  FSQOptions o = fsq_opts({5, 5, 5}, true);
  o.noise_dropout = 0.5;
  FSQ noisy(o, gen);
  FSQ clean(fsq_opts({5, 5, 5}, true), gen);
  const Tensor x = randn({4, 64, 3}, gen);
  const QuantizeOutput a = noisy.forward(x, Tensor());
  const QuantizeOutput b = clean.forward(x, Tensor());
  CHECK(vals(a.indices) == vals(b.indices));  // indices come from the clean codes
  CHECK(max_abs(a.quantized) <= 1.0);
  const double changed = max_abs_diff(a.quantized, b.quantized);
  CHECK(changed > 0.0);
  CHECK(changed <= 0.5 + 1e-6);
  noisy.eval();
  CHECK(max_abs_diff(noisy.forward(x, Tensor()).quantized, b.quantized) == 0.0);

  FSQOptions r = fsq_opts({8, 5, 5, 5});
  r.orthogonal_rotation = true;
  FSQ rot(r, gen);
  const Tensor R = rot.find("orthogonal_rot");
  CHECK(max_abs_diff(matmul(R, R.t()), eye(4)) < 1e-5);
  const QuantizeOutput q = rot.forward(randn({2, 10, 4}, gen), Tensor());
  CHECK(max_abs_diff(rot.indices_to_codes(q.indices), q.quantized) < 1e-6);
}

TEST_CASE("ResidualFSQ: outputs from indices, scales, quantize dropout") {
  Generator gen(21);
  ResidualFSQOptions o;
  o.fsq.levels = {8, 5, 5, 5};
  o.fsq.dim = 12;
  o.num_quantizers = 4;
  ResidualFSQ rfsq(o, gen);
  const Tensor x = randn({2, 9, 12}, gen);
  const QuantizeOutput out = rfsq.forward(x, Tensor());
  CHECK(out.indices.shape() == Shape{2, 9, 4});
  CHECK(max_abs_diff(rfsq.get_output_from_indices(out.indices), out.quantized) < 1e-5);
  CHECK(rfsq.get_codes_from_indices(out.indices).shape() == Shape{4, 2, 9, 4});
  CHECK(vals(select(rfsq.scales(), 0, 2)) == std::vector<double>{1.0 / 64, 0.04f, 0.04f, 0.04f});
  // Each added layer quantizes the residual more finely.
  double prev = 1e9;
  for (int64_t q = 1; q <= 4; ++q) {
    ResidualFSQOptions oq = o;
    oq.fsq.dim = 0;
    oq.num_quantizers = q;
    ResidualFSQ rq(oq, gen);
    const Tensor z = rand({1, 200, 4}, gen) * 1.6 - 0.8;  // inside the soft clamp's range
    const Tensor v = from_vector<float>({8.0f / 7.0f, 1.25f, 1.25f, 1.25f}, {4});
    const double err = max_abs_diff(rq.forward(z), tanh(z / v) * v);
    if (q > 1) CHECK(err < prev);
    prev = err;
  }

  ResidualFSQOptions d = o;
  d.fsq.dim = 0;
  d.quantize_dropout = true;
  d.quantize_dropout_cutoff_index = 1;
  ResidualFSQ drop(d, gen);
  std::set<int64_t> kept;
  for (int i = 0; i < 40; ++i) {
    const auto idx = drop.forward(randn({1, 3, 4}, gen), Tensor()).indices.to_vector<int64_t>();
    int64_t last = 3;
    while (last > 0 && idx[last] == -1) --last;
    for (int64_t t = 0; t < 3; ++t)  // one draw per batch: every token drops alike
      for (int64_t q = 0; q < 4; ++q) CHECK((idx[t * 4 + q] == -1) == (q > last));
    kept.insert(last);
  }
  CHECK(kept == std::set<int64_t>{1, 2, 3});  // uniform on [cutoff, Q - 1]
  // The same seed replays the same draws; eval draws nothing.
  Generator seed_a(77), seed_b(77);
  ResidualFSQ again(d, seed_a);
  ResidualFSQ again2(d, seed_b);
  for (int i = 0; i < 5; ++i) CHECK(again.draw_dropout() == again2.draw_dropout());
  // One rule for every family (quant/quantize_dropout.h): training decides,
  // grad mode does not (a no-grad forward used to keep every layer).
  Generator seed_c(78), seed_d(78);
  ResidualFSQ with_grad(d, seed_c), without_grad(d, seed_d);
  for (int i = 0; i < 5; ++i) {
    const Tensor z = randn({1, 3, 4}, gen);
    const std::vector<double> a = vals(with_grad.forward(z, Tensor()).indices);
    NoGradGuard ng;
    CHECK(vals(without_grad.forward(z, Tensor()).indices) == a);
  }
  drop.eval();
  for (int i = 0; i < 5; ++i)
    CHECK(vals(drop.forward(randn({1, 3, 4}, gen), Tensor()).indices).back() != -1);
}

TEST_CASE("GroupedResidualFSQ splits features into groups") {
  Generator gen(2);
  GroupedResidualFSQOptions o;
  o.rfsq.fsq.levels = {8, 5, 5, 5};
  o.rfsq.fsq.dim = 8;
  o.rfsq.num_quantizers = 2;
  o.groups = 2;
  GroupedResidualFSQ g(o, gen);
  const Tensor x = randn({2, 6, 8}, gen).requires_grad_();
  const QuantizeOutput out = g.forward(x, Tensor());
  CHECK(out.quantized.shape() == Shape{2, 6, 8});
  CHECK(out.indices.shape() == Shape{2, 2, 6, 2});
  CHECK(max_abs_diff(g.get_output_from_indices(out.indices), out.quantized) < 1e-5);
  sum(out.quantized).backward();
  CHECK(x.grad().shape() == x.shape());
}

TEST_CASE("FSQ with more than 2^31 codes returns int64 indices") {
  Generator gen(13);
  FSQ fsq(fsq_opts({256, 256, 256, 256}), gen);
  CHECK(fsq.codebook_size() == int64_t(1) << 32);
  const QuantizeOutput out = fsq.forward(randn({2, 50, 4}, gen) * 2.0, Tensor());
  CHECK(out.indices.dtype() == DType::i64);
  CHECK(max_abs_diff(fsq.indices_to_codes(out.indices), out.quantized) == 0.0);
  const auto idx = out.indices.to_vector<int64_t>();
  CHECK(*std::max_element(idx.begin(), idx.end()) > (int64_t(1) << 31));
}

namespace {

// Names of a module's parameters and buffers.
std::set<std::string> state_names(const Module& m) {
  std::set<std::string> names;
  for (const auto& [name, t] : m.state_dict()) names.insert(name);
  return names;
}

// rows [T, in] times W^T for W [out, in], plain loops.
std::vector<double> times_transposed(const std::vector<double>& rows, const std::vector<double>& W,
                                     int64_t in, int64_t out) {
  const int64_t t_count = int64_t(rows.size()) / in;
  std::vector<double> y(size_t(t_count * out), 0.0);
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) y[t * out + o] += W[o * in + i] * rows[t * in + i];
  return y;
}

}  // namespace

TEST_CASE("FSQ projection_has_bias = false: no bias parameters, y = codes W_out^T") {
  Generator gen(4);
  FSQOptions o = fsq_opts({8, 5, 5});
  o.dim = 7;
  CHECK(state_names(FSQ(o, gen)) == std::set<std::string>{"project_in.weight", "project_in.bias",
                                                          "project_out.weight",
                                                          "project_out.bias"});
  o.projection_has_bias = false;
  FSQ fsq(o, gen);
  CHECK(state_names(fsq) == std::set<std::string>{"project_in.weight", "project_out.weight"});
  CHECK_FALSE(fsq.find("project_in.bias").defined());
  // Zero in, zero out: z = 0 W_in^T = 0 is the grid's centre code 0 on every
  // dimension, level L // 2 = (4, 2, 2), index 4 + 2 * 8 + 2 * 40 = 100.
  const QuantizeOutput zero = fsq.forward(zeros({1, 3, 7}), Tensor());
  CHECK(vals(zero.quantized) == std::vector<double>(21, 0.0));
  CHECK(vals(zero.indices) == std::vector<double>{100, 100, 100});
  // Random input: the index is that of the grid point of x W_in^T, and the
  // output that point times W_out^T, without a bias anywhere.
  const Tensor x = randn({2, 5, 7}, gen);
  const QuantizeOutput out = fsq.forward(x, Tensor());
  const auto z = times_transposed(vals(x), vals(fsq.find("project_in.weight")), 7, 3);
  const Tensor codes = fsq.quantize(from_vector<double>(z, {2, 5, 3}).to(DType::f32));
  CHECK(vals(out.indices) == vals(fsq.codes_to_indices(codes)));
  const auto y = times_transposed(vals(codes), vals(fsq.find("project_out.weight")), 3, 7);
  CHECK(max_abs_diff(out.quantized, from_vector<double>(y, {2, 5, 7})) < 1e-6);
}

TEST_CASE("FSQ keep_num_codebooks_dim: index shapes") {
  Generator gen(6);
  const Tensor x = randn({2, 7, 3}, gen);
  FSQ plain(fsq_opts({8, 5, 5}), gen);
  const QuantizeOutput a = plain.forward(x, Tensor());
  CHECK(a.indices.shape() == Shape{2, 7});
  FSQOptions o = fsq_opts({8, 5, 5});
  o.keep_num_codebooks_dim = true;
  FSQ keep(o, gen);
  CHECK(keep.keep_num_codebooks_dim());
  const QuantizeOutput b = keep.forward(x, Tensor());
  CHECK(b.indices.shape() == Shape{2, 7, 1});
  CHECK(vals(b.indices) == vals(a.indices));
  CHECK(max_abs_diff(keep.indices_to_codes(b.indices), b.quantized) == 0.0);
  // Image maps keep it too: [B, H, W, 1].
  const Tensor img = randn({2, 3, 4, 5}, gen);
  CHECK(keep.forward(img, Tensor()).indices.shape() == Shape{2, 4, 5, 1});
  CHECK(plain.forward(img, Tensor()).indices.shape() == Shape{2, 4, 5});
  // Several codebooks keep it by default; dropping it is refused as the
  // reference asserts.
  o = fsq_opts({8, 5, 5});
  o.num_codebooks = 2;
  const QuantizeOutput c = FSQ(o, gen).forward(randn({2, 7, 6}, gen), Tensor());
  CHECK(c.indices.shape() == Shape{2, 7, 2});
  o.keep_num_codebooks_dim = false;
  CHECK_THROWS_WITH_AS(FSQ(o, gen), doctest::Contains("keep_num_codebooks_dim"),
                       std::invalid_argument);
}

TEST_CASE("FSQ and ResidualFSQ ignore a mask, as the reference (which takes none)") {
  Generator gen(8);
  // The reference's FSQ and ResidualFSQ forwards have no mask argument, so
  // masked tokens are quantized like the others: no zeroed output, no -1.
  const Tensor x = randn({2, 5, 4}, gen);
  const Tensor mask =
      to_dtype(from_vector<uint8_t>({1, 0, 1, 0, 0, 1, 1, 0, 1, 1}, {2, 5}), DType::boolean);
  FSQ fsq(fsq_opts({8, 5, 5, 5}), gen);
  const QuantizeOutput a = fsq.forward(x, mask), b = fsq.forward(x, Tensor());
  CHECK(max_abs_diff(a.quantized, b.quantized) == 0.0);
  CHECK(vals(a.indices) == vals(b.indices));
  for (double i : vals(a.indices)) CHECK(i >= 0);
  ResidualFSQOptions ro;
  ro.fsq.levels = {8, 5, 5, 5};
  ro.num_quantizers = 3;
  ResidualFSQ rfsq(ro, gen);
  const QuantizeOutput ra = rfsq.forward(x, mask), rb = rfsq.forward(x, Tensor());
  CHECK(max_abs_diff(ra.quantized, rb.quantized) == 0.0);
  CHECK(vals(ra.indices) == vals(rb.indices));
  for (double i : vals(ra.indices)) CHECK(i >= 0);
  // A mask must still fit the tokens.
  const Tensor wrong = to_dtype(ones({2, 4}), DType::boolean);
  CHECK_THROWS_AS(fsq.forward(x, wrong), std::invalid_argument);
  CHECK_THROWS_AS(rfsq.forward(x, wrong), std::invalid_argument);
}
