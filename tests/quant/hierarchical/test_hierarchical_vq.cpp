// HierarchicalVQ: shapes and index layout, the reference's option errors, the
// input gradient against finite differences, nested dropout keyed by (seed,
// step), and a training step on every test device.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "quant/hierarchical/hierarchical_vq.h"
#include "quant/hierarchical/resample.h"
#include "quanta.h"
#include "support/gpu.h"
#include "support/numeric_grad.h"

using namespace quanta;
using namespace quanta::quant;
using quanta::testing::numeric_grad;

namespace {

double max_abs_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_vector<double>(), y = b.to_vector<double>();
  double m = x.size() == y.size() ? 0.0 : 1e300;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

HierarchicalVQOptions base_1d() {
  HierarchicalVQOptions o;
  o.dim = 4;
  o.codebook_size = {8};
  o.scales = {{1}, {3}, {5}, {10}};
  o.layer.kmeans_init = false;
  o.layer.threshold_ema_dead_code = 0;
  return o;
}

}  // namespace

TEST_CASE("HierarchicalVQ: shapes, index layout and get_output_from_indices") {
  SUBCASE("1-d channel-first, shared codebook") {
    Generator g(1);
    HierarchicalVQ hvq(base_1d(), g);
    CHECK(hvq.level_offsets() == std::vector<int64_t>{0, 1, 4, 9, 19});
    CHECK(hvq.find("vq._codebook.embed").defined());
    CHECK(hvq.find("phi_shared.conv.weight").shape() == Shape{4, 4, 3});
    hvq.eval();
    Generator data(2);
    const Tensor x = randn({2, 4, 10}, data);
    const QuantizeOutput out = hvq.forward(x);
    CHECK(out.quantized.shape() == Shape{2, 4, 10});
    CHECK(out.indices.shape() == Shape{2, 19});
    CHECK(out.loss.dim() == 0);
    const std::vector<Tensor> levels = hvq.split_indices(out.indices);
    REQUIRE(levels.size() == 4);
    CHECK(levels[2].shape() == Shape{2, 5});
    // Eval quantizes with the codes only: the indices rebuild the output.
    CHECK(max_abs_diff(hvq.get_output_from_indices(out.indices), out.quantized) < 1e-5);
    // An empty batch is valid input.
    const QuantizeOutput empty = hvq.forward(zeros({0, 4, 10}));
    CHECK(empty.quantized.shape() == Shape{0, 4, 10});
    CHECK(empty.indices.shape() == Shape{0, 19});
    CHECK(empty.loss.item() == 0.0);
    hvq.train();
    CHECK(hvq.forward(zeros({0, 4, 10})).loss.item() == 0.0);
  }
  SUBCASE("2-d channel-last, per-level codebooks and Phis, a mask") {
    HierarchicalVQOptions o = base_1d();
    o.accept_image_fmap = true;
    o.channel_first = false;
    o.shared_codebook = false;
    o.codebook_size = {4, 8, 8};
    o.scales = {{1}, {2, 3}, {4}};
    o.share_quant_resi = 0;
    Generator g(3);
    HierarchicalVQ hvq(o, g);
    CHECK(hvq.find("vqs.2._codebook.embed").shape() == Shape{1, 8, 4});
    CHECK(hvq.find("phi_levels.2.conv.weight").shape() == Shape{4, 4, 3, 3});
    Generator data(4);
    const Tensor x = randn({2, 4, 4, 4}, data);
    std::vector<uint8_t> m(32, 1);
    for (int i = 16; i < 32; i += 2) m[static_cast<size_t>(i)] = 0;
    const Tensor mask = to_dtype(from_vector(m, {2, 4, 4}), DType::boolean);
    const QuantizeOutput out = hvq.forward(x, mask);
    CHECK(out.quantized.shape() == Shape{2, 4, 4, 4});
    CHECK(out.indices.shape() == Shape{2, 1 + 6 + 16});
    // Masked positions output zeros and index -1 at the finest level.
    const std::vector<float> q = out.quantized.to_vector<float>();
    for (int64_t i = 0; i < 4; ++i) CHECK(q[static_cast<size_t>(16 * 4 + 0 * 4 + i)] == 0.0f);
    CHECK(hvq.split_indices(out.indices)[2].to_vector<int64_t>()[16] == -1);
  }
  SUBCASE("3-d") {
    HierarchicalVQOptions o = base_1d();
    o.accept_3d_fmap = true;
    o.scales = {{1}, {2}, {1, 3, 3}};
    Generator bad(0);
    CHECK_THROWS_AS(HierarchicalVQ(o, bad), std::invalid_argument);
    o.scales = {{1}, {1, 2, 2}, {2, 3, 3}};
    Generator g(5);
    HierarchicalVQ hvq(o, g);
    CHECK(hvq.find("phi_shared.conv.weight").shape() == Shape{4, 4, 3, 3, 3});
    Generator data(6);
    const QuantizeOutput out = hvq.forward(randn({1, 4, 2, 3, 3}, data));
    CHECK(out.quantized.shape() == Shape{1, 4, 2, 3, 3});
    CHECK(out.indices.shape() == Shape{1, 1 + 4 + 18});
  }
}

TEST_CASE("HierarchicalVQ: lens are the mask of the first lens[b] tokens (1-d)") {
  Generator g(31), data(32);
  HierarchicalVQ hvq(base_1d(), g);
  hvq.eval();
  const Tensor x = randn({3, 4, 10}, data);
  const Tensor lens = from_vector<int64_t>({10, 4, 7}, {3});
  std::vector<float> keep;
  for (int64_t len : {10, 4, 7})
    for (int64_t i = 0; i < 10; ++i) keep.push_back(i < len ? 1.0f : 0.0f);
  const Tensor mask = to_dtype(from_vector(keep, {3, 10}), DType::boolean);
  const QuantizeOutput a = hvq.forward_lens(x, lens), b = hvq.forward(x, mask);
  CHECK(max_abs_diff(a.quantized, b.quantized) == 0.0);
  CHECK(a.indices.to_vector<int64_t>() == b.indices.to_vector<int64_t>());
  CHECK_THROWS_WITH_AS(hvq.forward_lens(x, from_vector<int64_t>({1, 2}, {2})),
                       doctest::Contains("one length per sequence"), std::invalid_argument);
  HierarchicalVQOptions image = base_1d();
  image.accept_image_fmap = true;
  image.scales = {{1}, {2}};
  Generator g2(33);
  HierarchicalVQ hvq2(image, g2);
  CHECK_THROWS_WITH_AS(hvq2.forward_lens(zeros({1, 4, 2, 2}), lens),
                       doctest::Contains("only taken for 1-d"), std::invalid_argument);
}

TEST_CASE("HierarchicalVQ: the reference's asserts name the option") {
  auto refuses = [](HierarchicalVQOptions o, const char* what) {
    CAPTURE(what);
    Generator g(0);
    try {
      HierarchicalVQ h(o, g);
      FAIL("accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find(what) != std::string::npos);
    }
  };
  HierarchicalVQOptions o = base_1d();
  o.accept_image_fmap = o.accept_3d_fmap = true;
  refuses(o, "accept_3d_fmap");
  o = base_1d();
  o.nested_dropout = 1.5;
  refuses(o, "nested_dropout");
  o = base_1d();
  o.nested_dropout_min_levels = 0;
  refuses(o, "nested_dropout_min_levels");
  o = base_1d();
  o.scales = {{3}, {2}};
  refuses(o, "non-decreasing");
  o = base_1d();
  o.scales = {};
  refuses(o, "scales");
  o = base_1d();
  o.codebook_size = {8, 8};
  refuses(o, "codebook_size");
  o = base_1d();
  o.codebook_size = {8, 8, 16, 16};
  refuses(o, "shared_codebook");
  Generator g(0);
  HierarchicalVQ h(base_1d(), g);
  CHECK_THROWS_AS(h.forward(zeros({2, 3, 10})), std::invalid_argument);
  CHECK_THROWS_AS(h.forward(zeros({2, 4, 10}), ones({2, 9}, {.dtype = DType::boolean})),
                  std::invalid_argument);
}

// A level's VectorQuantize output is straight-through (x + sg(q - x)), as
// the reference's, so the derivative both backpropagate is that of the layer
// with every quantizer replaced by the identity: pool -> interpolate -> Phi
// per level, a linear map. Finite differences of the layer itself would see
// only its piecewise-constant codes, so they are taken of that map, composed
// here from the public pieces and the layer's own Phi parameters.
TEST_CASE("HierarchicalVQ: the input gradient matches finite differences (f64)") {
  for (const bool image : {false, true}) {
    CAPTURE(image);
    HierarchicalVQOptions o = base_1d();
    o.share_quant_resi = 2;
    if (image) {
      o.accept_image_fmap = true;
      o.scales = {{1}, {2, 3}, {4}};
    }
    Generator g(7);
    HierarchicalVQ hvq(o, g);
    hvq.to(DType::f64);
    Generator data(8);
    const Shape shape = image ? Shape{2, 4, 4, 4} : Shape{2, 4, 10};
    const std::vector<int64_t> full(shape.begin() + 2, shape.end());
    const Tensor x = randn(shape, data, {.dtype = DType::f64});
    const Tensor w = randn(shape, data, {.dtype = DType::f64});
    Tensor leaf = x.clone().requires_grad_(true);
    QuantizeOutput out = hvq.forward(leaf);
    (sum(out.quantized * w) + out.loss).backward();

    // Levels 0, 1 use Phi 0 and levels 2, 3 Phi 1 (1-d: round(l / 3));
    // 2-d: levels 0, 1 (round(0.5) is 0, Python's rounding) and 2.
    const std::vector<int> phi_of_level =
        image ? std::vector<int>{0, 0, 1} : std::vector<int>{0, 0, 1, 1};
    auto phi = [&](int i, const Tensor& t) {
      const Tensor cw = hvq.find("phi_levels." + std::to_string(i) + ".conv.weight");
      const Tensor cb = hvq.find("phi_levels." + std::to_string(i) + ".conv.bias");
      const Tensor conv =
          image ? conv2d(t, cw, cb, {1, 1}, {1, 1})
                : squeeze(conv2d(unsqueeze(t, 2), unsqueeze(cw, 2), cb, {1, 1}, {0, 1}), 2);
      return t + (conv - t) * 0.5;
    };
    auto linearised = [&](const Tensor& t) {
      Tensor residual = t, rec = zeros_like(t);
      for (size_t l = 0; l < phi_of_level.size(); ++l) {
        const Tensor q =
            phi(phi_of_level[l],
                interpolate_linear_nd(adaptive_avg_pool_nd(residual, hvq.level_shapes()[l]), full));
        rec = rec + q;
        residual = residual - q;
      }
      return sum(rec * w).item();
    };
    // The commitment loss's own gradient (pooled residual against its held
    // codes) is left out of the map above, so take it out of the layer's too.
    Tensor no_loss = x.clone().requires_grad_(true);
    HierarchicalVQOptions o0 = o;
    o0.layer.commitment_weight = 0;
    Generator g0(7);
    HierarchicalVQ plain(o0, g0);
    plain.to(DType::f64);
    sum(plain.forward(no_loss).quantized * w).backward();
    const Tensor numeric = numeric_grad(linearised, x);
    CHECK(max_abs_diff(no_loss.grad(), numeric) < 1e-7);
    // The commitment loss adds a gradient of its own.
    CHECK(max_abs_diff(leaf.grad(), no_loss.grad()) > 1e-6);
  }
}

TEST_CASE("HierarchicalVQ: nested dropout is reproducible from (seed, step)") {
  HierarchicalVQOptions o = base_1d();
  o.nested_dropout = 0.75;
  auto cutoffs = [&](uint64_t seed, bool pinned) {
    Generator g(seed);
    HierarchicalVQ hvq(o, g);
    Generator data(9);
    const Tensor x = randn({2, 4, 10}, data);
    std::vector<int64_t> out;
    for (uint64_t step = 0; step < 12; ++step) {
      if (pinned) hvq.pin_random_step(step);
      hvq.forward(x);
      out.push_back(hvq.last_cutoff());
    }
    return out;
  };
  const std::vector<int64_t> a = cutoffs(11, true), b = cutoffs(11, true);
  CHECK(a == b);
  bool dropped = false, kept = false;
  for (int64_t c : a) {
    CHECK(c >= -1);
    CHECK(c <= 2);  // never the last level: that is "keep all" (-1)
    dropped |= c >= 0, kept |= c == -1;
  }
  CHECK(dropped);
  CHECK(kept);
  // Pinned, a step's draw does not depend on how many forwards came before.
  Generator g(11);
  HierarchicalVQ hvq(o, g);
  Generator data(9);
  const Tensor x = randn({2, 4, 10}, data);
  hvq.forward(x);
  hvq.forward(x);
  hvq.pin_random_step(5);
  hvq.forward(x);
  CHECK(hvq.last_cutoff() == a[5]);
  // Eval never drops.
  hvq.eval();
  hvq.forward(x);
  CHECK(hvq.last_cutoff() == -1);
}

TEST_CASE("HierarchicalVQ: a training step on a device") {
  HierarchicalVQOptions o = base_1d();
  o.accept_image_fmap = true;
  o.scales = {{1}, {2, 3}, {4}};
  o.nested_dropout = 0.5;
  Generator data(12);
  const Tensor x = randn({2, 4, 4, 4}, data);
  Generator g0(13);
  HierarchicalVQ cpu(o, g0);
  cpu.pin_random_step(3);
  Tensor xc = x.clone();
  xc.requires_grad_(true);
  const QuantizeOutput ref = cpu.forward(xc);
  sum(ref.quantized * ref.quantized).backward();
  for (const Device device : testing::test_devices()) {
    CAPTURE(device.str());
    Generator g(13);
    HierarchicalVQ hvq(o, g);
    hvq.to(device);
    hvq.pin_random_step(3);
    Tensor xd = x.to(device);
    xd.requires_grad_(true);
    QuantizeOutput out;
    {
      // No mask: a masked step reads the valid count back (Codebook::accumulate).
      HostSyncGuard guard("a HierarchicalVQ training step");
      out = hvq.forward(xd);
      sum(out.quantized * out.quantized).backward();
    }
    CHECK(hvq.last_cutoff() == cpu.last_cutoff());
    if (device.is_sim()) {  // a GPU sums in other orders
      CHECK(max_abs_diff(out.quantized.to(Device::cpu()), ref.quantized) == 0.0);
      CHECK(out.indices.to(Device::cpu()).to_vector<int64_t>() == ref.indices.to_vector<int64_t>());
      CHECK(max_abs_diff(xd.grad().to(Device::cpu()), xc.grad()) == 0.0);
      CHECK(max_abs_diff(hvq.vq(0).codebook().embed().to(Device::cpu()),
                         cpu.vq(0).codebook().embed()) == 0.0);
    }
    // The pooling and interpolation matrices were uploaded by the first
    // forward; the next ones upload nothing.
    reset_device_stats(device);
    const QuantizeOutput again = hvq.forward(xd.detach());
    CHECK(again.quantized.device() == device);
    CHECK(device_stats(device).copies_from_host == 0);
  }
}
