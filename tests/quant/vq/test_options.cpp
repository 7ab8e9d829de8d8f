// VectorQuantize options, each checked against values computed in the test:
// sync_update_v, layernorm_after_project_in, channel_last = false, an
// explicit rotation_trick, the cross-entropy commitment, stochastic sampling,
// the Gumbel straight-through, the codebook-diversity loss and
// forward_with_indices. The naive references are plain loops in f64.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "vq_test_util.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::max_abs_diff;

namespace {

using Vec = std::vector<double>;

VectorQuantizeOptions small(int64_t dim, int64_t k) {
  VectorQuantizeOptions o;
  o.dim = dim;
  o.codebook_size = k;
  return o;
}

Vec vals(const Tensor& t) { return t.detach().to_vector<double>(); }

void set_codes(VectorQuantize& vq, const Tensor& embed) {
  NoGradGuard no_grad;
  copy_(vq.codebook().embed(), embed);
  copy_(vq.codebook().embed_avg(), embed);
}

// The reference's distances -sqrt(max(|x_t - c_k|^2, 1e-8)): [T * K] for rows
// x [T, d] and codes c [K, d].
Vec naive_dist(const Vec& x, const Vec& c, int64_t d) {
  const int64_t t_count = int64_t(x.size()) / d, k_count = int64_t(c.size()) / d;
  Vec out(size_t(t_count * k_count));
  for (int64_t t = 0; t < t_count; ++t)
    for (int64_t k = 0; k < k_count; ++k) {
      double s = 0;
      for (int64_t e = 0; e < d; ++e) s += std::pow(x[t * d + e] - c[k * d + e], 2);
      out[t * k_count + k] = -std::sqrt(std::max(s, 1e-8));
    }
  return out;
}

// softmax of row t of a [T, K] matrix, scaled by `scale`.
Vec softmax_row(const Vec& m, int64_t t, int64_t k_count, double scale = 1.0) {
  double mx = -1e300;
  for (int64_t k = 0; k < k_count; ++k) mx = std::max(mx, scale * m[t * k_count + k]);
  Vec p(static_cast<size_t>(k_count));
  double s = 0;
  for (int64_t k = 0; k < k_count; ++k) s += p[k] = std::exp(scale * m[t * k_count + k] - mx);
  for (double& v : p) v /= s;
  return p;
}

int64_t argmax_row(const Vec& m, int64_t t, int64_t k_count) {
  int64_t best = 0;
  for (int64_t k = 1; k < k_count; ++k)
    if (m[t * k_count + k] > m[t * k_count + best]) best = k;
  return best;
}

// Cross entropy of rows of logits [T, K] against targets (-1 ignored), mean
// over the others; 0 when none.
double naive_cross_entropy(const Vec& logits, const std::vector<int64_t>& target, int64_t k_count) {
  double total = 0;
  int64_t n = 0;
  for (size_t t = 0; t < target.size(); ++t) {
    if (target[t] < 0) continue;
    const Vec p = softmax_row(logits, int64_t(t), k_count);
    total -= std::log(p[size_t(target[t])]);
    ++n;
  }
  return n ? total / double(n) : 0.0;
}

// lambda R^T g for one row (the rotation trick's input gradient), with R built
// as an explicit matrix: R = I - 2 w w^T + 2 q^ u^T.
Vec rotation_grad(const Vec& x, const Vec& q, const Vec& g) {
  const size_t d = x.size();
  double xn = 0, qn = 0;
  for (size_t i = 0; i < d; ++i) xn += x[i] * x[i], qn += q[i] * q[i];
  xn = std::sqrt(xn), qn = std::sqrt(qn);
  Vec u(d), qh(d), w(d);
  double wn = 0;
  for (size_t i = 0; i < d; ++i)
    u[i] = x[i] / xn, qh[i] = q[i] / qn, wn += std::pow(u[i] + qh[i], 2);
  for (size_t i = 0; i < d; ++i) w[i] = (u[i] + qh[i]) / std::sqrt(wn);
  Vec out(d, 0.0);
  for (size_t i = 0; i < d; ++i)
    for (size_t j = 0; j < d; ++j)
      out[i] += qn / xn * ((i == j ? 1.0 : 0.0) - 2 * w[j] * w[i] + 2 * qh[j] * u[i]) * g[j];
  return out;
}

Vec row(const Vec& m, int64_t r, int64_t d) {
  return Vec(m.begin() + r * d, m.begin() + (r + 1) * d);
}

Tensor bool_mask(const std::vector<uint8_t>& keep, const Shape& shape) {
  return to_dtype(from_vector<uint8_t>(keep, shape), DType::boolean);
}

}  // namespace

TEST_CASE("sync_update_v: the value is the code, the input gradient scales by 1 + v") {
  for (bool rotation : {false, true}) {
    CAPTURE(rotation);
    VectorQuantizeOptions o = small(5, 9);
    o.rotation_trick = rotation;
    o.commitment_weight = 0;
    Generator g1(3), g2(3), data(4);
    VectorQuantize plain(o, g1);
    o.sync_update_v = 0.5;
    VectorQuantize synced(o, g2);
    const Tensor codes = synced.codebook().embed().clone();
    const Tensor x0 = randn({2, 6, 5}, data), w = randn({2, 6, 5}, data);
    Tensor xa = x0.clone(), xb = x0.clone();
    xa.requires_grad_(true);
    xb.requires_grad_(true);
    const QuantizeOutput a = plain.forward(xa), b = synced.forward(xb);
    // q + v (q - sg(q)) has the value q: the code of each token, before the EMA.
    const Tensor picked =
        reshape(index_select(reshape(codes, {9, 5}), 0, reshape(b.indices, {12})), {2, 6, 5});
    CHECK(max_abs_diff(b.quantized, picked) < 1e-6);
    CHECK(max_abs_diff(b.quantized, a.quantized) == 0.0);
    sum(a.quantized * w).backward();
    sum(b.quantized * w).backward();
    CHECK(max_abs_diff(xb.grad(), xa.grad() * 1.5) < 1e-6);
    if (!rotation) CHECK(max_abs_diff(xb.grad(), w * 1.5) < 1e-6);  // STE: (1 + v) * identity
  }
}

TEST_CASE("layernorm_after_project_in: project_in is Sequential(Linear, LayerNorm)") {
  Generator gen(5), data(6);
  VectorQuantizeOptions o = small(6, 7);
  o.codebook_dim = 4;
  o.layernorm_after_project_in = true;
  // Keep the forward's rows: the codebook's candidate pool holds exactly the
  // features the codebook saw, after project_in.
  o.threshold_ema_dead_code = 1e-9;
  o.update_in_forward = false;
  VectorQuantize vq(o, gen);
  const StateDict sd = vq.state_dict();
  const std::map<std::string, Shape> want = {
      {"project_in.0.weight", {4, 6}}, {"project_in.0.bias", {4}},     {"project_in.1.weight", {4}},
      {"project_in.1.bias", {4}},      {"project_out.weight", {6, 4}}, {"project_out.bias", {6}}};
  for (const auto& [name, shape] : want) {
    const Tensor* t = find_tensor(sd, name);
    REQUIRE_MESSAGE(t != nullptr, name);
    CHECK(t->shape() == shape);
  }
  CHECK(find_tensor(sd, "project_in.weight") == nullptr);

  const Tensor x = randn({2, 5, 6}, data) * 3.0 + 1.0;
  auto features = [&] {
    vq.forward(x);
    const auto& pool = vq.codebook().pending().candidates;
    REQUIRE(pool.size() == 1);
    REQUIRE(!pool[0].empty());
    const Tensor rows = pool[0].back();
    vq.codebook().update_state();  // clears the pending statistics
    return rows;
  };
  // Default LayerNorm (weight 1, bias 0): every token has mean 0, variance 1.
  const Tensor rows = features();
  REQUIRE(rows.shape() == Shape{10, 4});
  const Vec r = vals(rows);
  for (int64_t t = 0; t < 10; ++t) {
    double m = 0, v = 0;
    for (int e = 0; e < 4; ++e) m += r[t * 4 + e] / 4;
    for (int e = 0; e < 4; ++e) v += std::pow(r[t * 4 + e] - m, 2) / 4;
    CHECK(std::abs(m) < 1e-6);
    CHECK(v == doctest::Approx(1.0).epsilon(1e-4));
  }
  // With an affine LayerNorm: (Wx + b - mean) / sqrt(var + 1e-5) * gamma + beta.
  {
    NoGradGuard ng;
    copy_(vq.find("project_in.1.weight"), from_vector<float>({0.5f, -2.0f, 1.5f, 3.0f}, {4}));
    copy_(vq.find("project_in.1.bias"), from_vector<float>({0.1f, 0.2f, -0.3f, 0.0f}, {4}));
  }
  const Vec W = vals(vq.find("project_in.0.weight")), b = vals(vq.find("project_in.0.bias"));
  const Vec gamma{0.5, -2.0, 1.5, 3.0}, beta{0.1, 0.2, -0.3, 0.0}, xv = vals(x);
  Vec expect;
  for (int64_t t = 0; t < 10; ++t) {
    Vec z(4);
    double m = 0, v = 0;
    for (int o2 = 0; o2 < 4; ++o2) {
      z[o2] = b[o2];
      for (int i = 0; i < 6; ++i) z[o2] += W[o2 * 6 + i] * xv[t * 6 + i];
      m += z[o2] / 4;
    }
    for (int e = 0; e < 4; ++e) v += std::pow(z[e] - m, 2) / 4;
    for (int e = 0; e < 4; ++e)
      expect.push_back((z[e] - m) / std::sqrt(v + 1e-5) * gamma[e] + beta[e]);
  }
  const Tensor affine_rows = features();
  CHECK(max_abs_diff(affine_rows, from_vector<double>(expect, {10, 4})) < 1e-5);
  // The indices are the nearest codes of those normalised features.
  vq.eval();
  const auto idx = vq.forward(x).indices.to_vector<int64_t>();
  const Vec dist = naive_dist(expect, vals(vq.codebook().embed()), 4);
  for (int64_t t = 0; t < 10; ++t) CHECK(idx[t] == argmax_row(dist, t, 7));
  // Without a projection there is nothing to normalise: no project_in at all.
  o = small(4, 7);
  o.layernorm_after_project_in = true;
  VectorQuantize no_proj(o, gen);
  CHECK_FALSE(no_proj.has_projections());
  for (const auto& [name, t] : no_proj.state_dict()) CHECK(name.rfind("project_", 0) != 0);
}

TEST_CASE("channel_last = false: [B, D, N] equals the transposed channel-last input") {
  Generator g1(7), g2(7), data(8);
  VectorQuantizeOptions o = small(6, 5);
  o.heads = 2;
  o.codebook_dim = 3;
  o.separate_codebook_per_head = true;
  VectorQuantize last(o, g1);
  o.channel_last = false;
  VectorQuantize first(o, g2);
  const Tensor x_bnd = randn({2, 7, 6}, data), w = randn({2, 7, 6}, data);
  Tensor xa = x_bnd.clone(), xb = contiguous(transpose(x_bnd, 1, 2));  // [B, D, N]
  xa.requires_grad_(true);
  xb.requires_grad_(true);
  const QuantizeOutput a = last.forward(xa), b = first.forward(xb);
  CHECK(b.quantized.shape() == Shape{2, 6, 7});
  CHECK(b.indices.shape() == Shape{2, 7, 2});
  CHECK(max_abs_diff(b.quantized, transpose(a.quantized, 1, 2)) == 0.0);
  CHECK(max_abs_diff(b.indices, a.indices) == 0.0);
  CHECK(b.loss.item() == a.loss.item());
  CHECK(max_abs_diff(first.codebook().embed(), last.codebook().embed()) == 0.0);
  CHECK(max_abs_diff(first.codebook().cluster_size(), last.codebook().cluster_size()) == 0.0);
  sum(a.quantized * w).backward();
  sum(b.quantized * transpose(w, 1, 2)).backward();
  CHECK(max_abs_diff(xb.grad(), transpose(xa.grad(), 1, 2)) < 1e-6);
  // A [B, N, D] tensor is read as [B, D, N]: a D that does not fit is an error.
  CHECK_THROWS_AS(first.forward(randn({2, 7, 5}, data)), std::invalid_argument);
}

TEST_CASE("rotation_trick set explicitly overrides the dim > 1 default") {
  Generator data(9);
  const Tensor codes = randn({1, 6, 4}, data);
  const Tensor x0 = randn({1, 5, 4}, data), w = randn({1, 5, 4}, data);
  std::map<int, Tensor> grads;  // -1 default, 0 false, 1 true
  for (int setting : {-1, 0, 1}) {
    Generator gen(10);
    VectorQuantizeOptions o = small(4, 6);
    o.commitment_weight = 0;
    if (setting >= 0) o.rotation_trick = setting == 1;
    VectorQuantize vq(o, gen);
    CHECK(vq.uses_rotation_trick() == (setting != 0));
    set_codes(vq, codes);
    Tensor x = x0.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = vq.forward(x);
    sum(out.quantized * w).backward();
    grads[setting] = x.grad();
    if (setting == 1) {
      // lambda R^T w per token, R rotating x onto its code.
      const auto idx = out.indices.to_vector<int64_t>();
      const Vec xv = vals(x0), cv = vals(codes), wv = vals(w);
      Vec expect;
      for (int64_t t = 0; t < 5; ++t) {
        const Vec g = rotation_grad(row(xv, t, 4), row(cv, idx[t], 4), row(wv, t, 4));
        expect.insert(expect.end(), g.begin(), g.end());
      }
      CHECK(max_abs_diff(x.grad(), from_vector<double>(expect, {1, 5, 4})) < 1e-5);
    }
  }
  CHECK(max_abs_diff(grads[0], w) == 0.0);  // the straight-through identity
  CHECK(max_abs_diff(grads[-1], grads[1]) == 0.0);
  CHECK(max_abs_diff(grads[1], grads[0]) > 1e-3);

  // dim 1: off by default; forced on, x and its code share a direction and
  // the gradient is |q| / |x| times the upstream one.
  const Tensor codes1 = from_vector<float>({0.5f, 1.0f, 2.0f, 4.0f}, {1, 4, 1});
  const Tensor x1 = from_vector<float>({0.6f, 1.7f, 3.5f, 0.9f, 5.0f}, {1, 5, 1});
  const Tensor w1 = from_vector<float>({1.0f, -2.0f, 0.5f, 3.0f, -1.0f}, {1, 5, 1});
  for (int setting : {-1, 1}) {
    Generator gen(11);
    VectorQuantizeOptions o = small(1, 4);
    o.commitment_weight = 0;
    if (setting == 1) o.rotation_trick = true;
    VectorQuantize vq(o, gen);
    CHECK(vq.uses_rotation_trick() == (setting == 1));
    set_codes(vq, codes1);
    Tensor x = x1.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = vq.forward(x);
    CHECK(max_abs_diff(out.quantized, from_vector<double>({0.5, 2.0, 4.0, 1.0, 4.0}, {1, 5, 1})) <
          1e-6);
    sum(out.quantized * w1).backward();
    const Vec g = vals(x.grad()), xv = vals(x1), wv = vals(w1), qv = vals(out.quantized);
    for (int t = 0; t < 5; ++t)
      CHECK(g[t] == doctest::Approx(setting == 1 ? qv[t] / xv[t] * wv[t] : wv[t]).epsilon(1e-6));
  }
}

TEST_CASE("commitment_use_cross_entropy_loss: cross entropy of the distances, naive") {
  Generator gen(12), data(13);
  VectorQuantizeOptions o = small(4, 6);
  o.commitment_use_cross_entropy_loss = true;
  o.commitment_weight = 0.7;
  VectorQuantize vq(o, gen);
  set_codes(vq, randn({1, 6, 4}, data));
  const Vec cv = vals(vq.codebook().embed());
  const Tensor x0 = randn({2, 5, 4}, data);
  const std::vector<uint8_t> keep{1, 1, 0, 1, 1, 0, 1, 1, 1, 0};
  for (bool masked : {false, true}) {
    CAPTURE(masked);
    set_codes(vq, from_vector<double>(cv, {1, 6, 4}).to(DType::f32));
    Tensor x = x0.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = masked ? vq.forward(x, bool_mask(keep, {2, 5})) : vq.forward(x);
    const Vec xv = vals(x0), dist = naive_dist(xv, cv, 4);
    std::vector<int64_t> target(10);
    for (int64_t t = 0; t < 10; ++t) target[t] = masked && !keep[t] ? -1 : argmax_row(dist, t, 6);
    const auto idx = out.indices.to_vector<int64_t>();
    for (int64_t t = 0; t < 10; ++t) CHECK(idx[t] == target[t]);
    const double ce = naive_cross_entropy(dist, target, 6);
    CHECK(out.term("commitment").item() == doctest::Approx(ce).epsilon(1e-5));
    CHECK(out.loss.item() == doctest::Approx(0.7 * ce).epsilon(1e-5));
    // Its gradient: 0.7 / n * sum_k (p_k - [k = idx]) d dist_k / dx, with
    // d dist_k / dx = -(x - c_k) / |x - c_k|.
    out.loss.backward();
    const double n =
        double(std::count_if(target.begin(), target.end(), [](int64_t i) { return i >= 0; }));
    Vec expect(40, 0.0);
    for (int64_t t = 0; t < 10; ++t) {
      if (target[t] < 0) continue;
      const Vec p = softmax_row(dist, t, 6);
      for (int64_t k = 0; k < 6; ++k) {
        const double coef = 0.7 / n * (p[k] - (k == target[t] ? 1.0 : 0.0));
        for (int e = 0; e < 4; ++e)
          expect[t * 4 + e] += coef * (xv[t * 4 + e] - cv[k * 4 + e]) / dist[t * 6 + k];
      }
    }
    CHECK(max_abs_diff(x.grad(), from_vector<double>(expect, {2, 5, 4})) < 1e-6);
  }
}

TEST_CASE("stochastic_sample_codes: T -> 0 is the argmin, draws follow softmax(dist / T)") {
  Generator data(14);
  const Tensor codes = randn({1, 8, 3}, data);
  const Tensor x = randn({2, 40, 3}, data);
  {
    Generator gen(15);
    VectorQuantizeOptions o = small(3, 8);
    o.stochastic_sample_codes = true;
    o.sample_codebook_temp = 1e-7;
    VectorQuantize vq(o, gen);
    set_codes(vq, codes);
    const auto idx = vq.forward(x).indices.to_vector<int64_t>();
    const Vec dist = naive_dist(vals(x), vals(codes), 3);
    for (int64_t t = 0; t < 80; ++t) CHECK(idx[t] == argmax_row(dist, t, 8));
  }
  // One point repeated: the frequency of each code is its softmax probability.
  const Tensor c4 = from_vector<float>({0, 0, 1, 0, 0, 1, 2, 2}, {1, 4, 2});
  const int64_t n = 20000;
  const Tensor point = expand(from_vector<float>({0.3f, 0.2f}, {1, 1, 2}), {1, n, 2});
  const double temp = 0.5;
  auto sampler = [&](uint64_t seed) {
    Generator gen(seed);
    VectorQuantizeOptions o = small(2, 4);
    o.stochastic_sample_codes = true;
    o.sample_codebook_temp = temp;
    o.freeze_codebook = true;
    auto vq = std::make_unique<VectorQuantize>(o, gen);
    set_codes(*vq, c4);
    return vq;
  };
  auto a = sampler(16), b = sampler(16), other = sampler(17);
  const std::vector<int64_t> draws = a->forward(point).indices.to_vector<int64_t>();
  const Vec p = softmax_row(naive_dist({0.3, 0.2}, vals(c4), 2), 0, 4, 1.0 / temp);
  std::vector<double> freq(4, 0.0);
  for (int64_t i : draws) freq[size_t(i)] += 1.0 / double(n);
  for (int k = 0; k < 4; ++k) CHECK(std::abs(freq[k] - p[k]) < 0.015);  // ~4 sigma at n = 20000
  // Reproducible from the generator: the same seed draws the same codes,
  // forward after forward; another seed draws others.
  CHECK(b->forward(point).indices.to_vector<int64_t>() == draws);
  CHECK(a->forward(point).indices.to_vector<int64_t>() ==
        b->forward(point).indices.to_vector<int64_t>());
  CHECK(other->forward(point).indices.to_vector<int64_t>() != draws);
  // Evaluation never samples.
  a->eval();
  for (int64_t i : a->forward(point).indices.to_vector<int64_t>()) CHECK(i == 0);
}

TEST_CASE("straight_through (Gumbel): the value is the one-hot code, the gradient the softmax's") {
  Generator gen(18), data(19);
  VectorQuantizeOptions o = small(3, 5);
  o.straight_through = true;
  o.sample_codebook_temp = 0.7;
  o.commitment_weight = 0;
  VectorQuantize vq(o, gen);
  set_codes(vq, randn({1, 5, 3}, data));
  const Vec cv = vals(vq.codebook().embed());
  const Tensor x0 = randn({1, 6, 3}, data), w = randn({1, 6, 3}, data);
  Tensor x = x0.clone();
  x.requires_grad_(true);
  const QuantizeOutput out = vq.forward(x);
  const Vec xv = vals(x0), wv = vals(w), dist = naive_dist(xv, cv, 3);
  const auto idx = out.indices.to_vector<int64_t>();
  Vec picked;
  for (int64_t t = 0; t < 6; ++t) {
    CHECK(idx[t] == argmax_row(dist, t, 5));  // nearest code, no sampling
    const Vec c = row(cv, idx[t], 3);
    picked.insert(picked.end(), c.begin(), c.end());
  }
  CHECK(max_abs_diff(out.quantized, from_vector<double>(picked, {1, 6, 3})) < 1e-6);
  // L = sum_t w_t . (s_t C), s_t = softmax(dist_t / T):
  // dL/d dist_tk = s_tk (a_tk - sum_j s_tj a_tj) / T with a_tk = c_k . w_t,
  // d dist_tk / dx_t = (x_t - c_k) / dist_tk.
  sum(out.quantized * w).backward();
  Vec expect(18, 0.0);
  for (int64_t t = 0; t < 6; ++t) {
    const Vec s = softmax_row(dist, t, 5, 1.0 / 0.7);
    Vec a(5, 0.0);
    double mean_a = 0;
    for (int64_t k = 0; k < 5; ++k) {
      for (int e = 0; e < 3; ++e) a[k] += cv[k * 3 + e] * wv[t * 3 + e];
      mean_a += s[k] * a[k];
    }
    for (int64_t k = 0; k < 5; ++k) {
      const double coef = s[k] * (a[k] - mean_a) / 0.7;
      for (int e = 0; e < 3; ++e)
        expect[t * 3 + e] += coef * (xv[t * 3 + e] - cv[k * 3 + e]) / dist[t * 5 + k];
    }
  }
  CHECK(max_abs_diff(x.grad(), from_vector<double>(expect, {1, 6, 3})) < 1e-5);
  CHECK(max_abs_diff(x.grad(), w) > 1e-2);  // not the straight-through identity
}

TEST_CASE("codebook diversity loss is -mean_n H(batch mean of softmax(dist T)), naive") {
  Generator data(20);
  for (bool heads : {false, true}) {
    CAPTURE(heads);
    Generator gen(21);
    const int64_t b = 3, n = 4, k = 6, h = heads ? 2 : 1, d = 3;
    VectorQuantizeOptions o = small(d * h, k);
    o.codebook_diversity_loss_weight = 0.3;
    o.codebook_diversity_temperature = 5;
    o.commitment_weight = 0;
    if (heads) {
      o.heads = 2;
      o.codebook_dim = 3;
      o.separate_codebook_per_head = true;
    }
    VectorQuantize vq(o, gen);
    set_codes(vq, randn({h, k, d}, data));
    const Vec cv = vals(vq.codebook().embed());
    const Tensor x = randn({b, n, d * h}, data);
    const QuantizeOutput out = vq.forward(x);
    const Vec xv = vals(x);
    // Per position n: mean over batch and heads of p = softmax(5 dist).
    double total = 0;
    for (int64_t pos = 0; pos < n; ++pos) {
      Vec mean_p(size_t(k), 0.0);
      for (int64_t bi = 0; bi < b; ++bi)
        for (int64_t hi = 0; hi < h; ++hi) {
          const Vec xt(xv.begin() + ((bi * n + pos) * h + hi) * d,
                       xv.begin() + ((bi * n + pos) * h + hi + 1) * d);
          const Vec ch(cv.begin() + hi * k * d, cv.begin() + (hi + 1) * k * d);
          const Vec p = softmax_row(naive_dist(xt, ch, d), 0, k, 5.0);
          for (int64_t j = 0; j < k; ++j) mean_p[j] += p[j] / double(b * h);
        }
      double entropy = 0;
      for (double q : mean_p) entropy -= q * std::log(std::max(q, 1e-5));
      total += entropy;
    }
    const double expect = -total / double(n);
    CHECK(out.term("codebook_diversity").item() == doctest::Approx(expect).epsilon(1e-5));
    CHECK(out.loss.item() == doctest::Approx(0.3 * expect).epsilon(1e-5));
  }
}

TEST_CASE("forward_with_indices: the loss is the naive cross entropy against the given codes") {
  Generator data(22);
  for (bool heads : {false, true}) {
    CAPTURE(heads);
    Generator gen(23);
    const int64_t b = 2, n = 5, k = 7, h = heads ? 2 : 1, d = 4;
    VectorQuantizeOptions o = small(d * h, k);
    if (heads) {
      o.heads = 2;
      o.codebook_dim = d;
      o.separate_codebook_per_head = true;
    }
    VectorQuantize vq(o, gen);
    set_codes(vq, randn({h, k, d}, data));
    const Tensor before = vq.codebook().embed().clone();
    const Vec cv = vals(before);
    const Tensor x = randn({b, n, d * h}, data);
    Shape is{b, n};
    if (heads) is.push_back(h);
    std::vector<int64_t> given = randint(0, k, is, data).to_vector<int64_t>();
    given[1] = -1;  // ignored
    given[6] = -1;
    const Tensor indices = from_vector<int64_t>(given, is);
    const QuantizeOutput out = vq.forward_with_indices(x, indices);
    // Naive: every (token, head) row against its head's codebook.
    const Vec xv = vals(x);
    double total = 0;
    int64_t count = 0;
    for (int64_t t = 0; t < b * n; ++t)
      for (int64_t hi = 0; hi < h; ++hi) {
        const int64_t target = given[t * h + hi];
        if (target < 0) continue;
        const Vec xt(xv.begin() + (t * h + hi) * d, xv.begin() + (t * h + hi + 1) * d);
        const Vec ch(cv.begin() + hi * k * d, cv.begin() + (hi + 1) * k * d);
        const Vec p = softmax_row(naive_dist(xt, ch, d), 0, k);
        total -= std::log(p[size_t(target)]);
        ++count;
      }
    CHECK(out.loss.item() == doctest::Approx(total / double(count)).epsilon(1e-5));
    CHECK(out.term("cross_entropy").item() == out.loss.item());
    CHECK(max_abs_diff(out.indices, indices) == 0.0);
    CHECK(max_abs_diff(vq.codebook().embed(), before) == 0.0);  // no state update
    // Every index ignored: zero, not NaN.
    const QuantizeOutput none = vq.forward_with_indices(x, full(is, -1.0, {.dtype = DType::i64}));
    CHECK(none.loss.item() == 0.0);
  }
}

TEST_CASE("distance gradients read the codes the forward used, not this step's EMA update") {
  // A training forward ends with the EMA step (update_in_forward); the input
  // gradient through the distances must not see the overwritten codebook: it
  // equals the gradient of a forward whose update is deferred (as under
  // QuantizerSync), for each option that differentiates the distances, and
  // for a shared ResidualVQ codebook updated after the last layer.
  Generator data(24);
  const Tensor x0 = randn({2, 6, 4}, data), w = randn({2, 6, 4}, data);
  for (int option = 0; option < 3; ++option) {
    CAPTURE(option);
    std::vector<Tensor> grads;
    for (bool eager : {true, false}) {
      Generator gen(25);
      VectorQuantizeOptions o = small(4, 5);
      o.update_in_forward = eager;
      if (option == 0) o.commitment_use_cross_entropy_loss = true;
      if (option == 1) o.codebook_diversity_loss_weight = 1.0;
      if (option == 2) o.straight_through = true;
      VectorQuantize vq(o, gen);
      Tensor x = x0.clone();
      x.requires_grad_(true);
      const QuantizeOutput out = vq.forward(x);
      (sum(out.quantized * w) + out.loss).backward();
      grads.push_back(x.grad());
      if (!eager) vq.update_state();
    }
    CHECK(max_abs_diff(grads[0], grads[1]) < 1e-6);
  }
  std::vector<Tensor> grads;
  for (bool eager : {true, false}) {
    Generator gen(26);
    ResidualVQOptions o;
    o.dim = 4;
    o.num_quantizers = 3;
    o.codebook_sizes = {5};
    o.shared_codebook = true;
    o.update_in_forward = eager;
    o.layer.commitment_use_cross_entropy_loss = true;
    ResidualVQ rvq(o, gen);
    Tensor x = x0.clone();
    x.requires_grad_(true);
    const QuantizeOutput out = rvq.forward(x);
    (sum(out.quantized * w) + sum(out.loss)).backward();
    grads.push_back(x.grad());
    if (!eager) rvq.update_state();
  }
  CHECK(max_abs_diff(grads[0], grads[1]) < 1e-6);
}
