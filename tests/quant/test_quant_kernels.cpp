// The quantizers' device seam (quant/kernels/table.h): the CPU and CUDA
// tables are complete, where the CUDA module's table cannot be had every
// entry fails naming the op and why, and CUDA tensors reach the CUDA kernels
// (their results against the CPU's: cuda/test_cuda_table.cpp).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "quant/kernels/table.h"
#include "quant/nf4/nf4_format.h"
#include "quant/quantizer.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/vq/nearest_code.h"
#include "quant/vq/residual_vq.h"
#include "quant/vq/vector_quantize.h"
#include "quanta.h"
#include "support/errors.h"
#include "support/gpu.h"

using namespace quanta;
using quanta::testing::message_of;
using namespace quanta::quant;

namespace {

// The names of `t`'s null entries.
std::vector<std::string> null_entries(const QuantKernelTable& t) {
  std::vector<std::string> out;
#define QUANT_NULL(name) \
  if (t.name == nullptr) out.push_back(#name);
  QUANTA_QUANT_KERNEL_ENTRIES(QUANT_NULL)
#undef QUANT_NULL
  return out;
}

void check_names(const std::string& msg, const std::string& op) {
  INFO("message: ", msg);
  CHECK(msg.find("[" + op) == 0);
  CHECK(msg.find("no CUDA kernel") != std::string::npos);
}

}  // namespace

TEST_CASE("quant kernels: the CPU table is complete") {
  const QuantKernelTable& cpu = quant_kernels(Device::cpu());
  CHECK(std::string(cpu.device_name) == "cpu");
  CHECK(null_entries(cpu).empty());
  CHECK(&quant_kernels(Device::cpu()) == &quant_cpu::table());
}

TEST_CASE("quant kernels: dead-code picks and replacements equal the composed ops' values") {
  // The chains they replace: expired = size < threshold; rank = cumsum less
  // itself; picks = where(expired, draws[rank], -1); then put_rows of the
  // picked rows into embed (times 1), embed_avg (times the threshold) and
  // cluster_size (the threshold).
  Generator gen(31);
  for (const Device dev : quanta::testing::cpu_and_test_devices())
    for (const DType dt : {DType::f32, DType::f64})
      for (const int64_t k : {int64_t{1}, int64_t{37}, int64_t{2500}}) {
        INFO(dev.str() << " " << std::string(dtype_name(dt)) << " k " << k);
        const TensorOptions opts{.dtype = dt, .device = dev};
        const TensorOptions i64{.dtype = DType::i64, .device = dev};
        const int64_t d = 3, pool = k + 5;
        const double threshold = 2.0;
        const Tensor sizes = (rand({k}, gen) * 4.0).to(dt).to(dev);
        const Tensor draws = randperm_prefix(pool, k, gen, i64);
        const QuantKernelTable& q = quant_kernels(dev);
        Tensor picks = empty({k}, i64);
        q.dead_code_picks(dt, sizes.raw_data(), k, threshold,
                          static_cast<const int64_t*>(draws.raw_data()),
                          static_cast<int64_t*>(picks.raw_data()));
        const Tensor expired = to_dtype(lt(sizes, full({}, threshold, opts)), DType::i64);
        const Tensor rank = cumsum(expired, 0) - expired;
        const Tensor want =
            where(to_dtype(expired, DType::boolean), gather(draws, 0, rank), full({k}, -1.0, i64));
        CHECK(picks.to(Device::cpu()).to_vector<int64_t>() ==
              want.to(Device::cpu()).to_vector<int64_t>());
        // The writes, from the pool at the picks (gather) and from rows by code.
        const Tensor rows = randn({pool, d}, gen, opts);
        for (const bool from_pool : {true, false}) {
          const Tensor src = from_pool ? rows : slice(rows, 0, 0, k).contiguous();
          Tensor embed = randn({k, d}, gen, opts), avg = randn({k, d}, gen, opts);
          Tensor size = sizes.clone();
          const Tensor embed0 = embed.clone(), avg0 = avg.clone();
          q.replace_codes(dt, k, d, static_cast<const int64_t*>(picks.raw_data()), from_pool,
                          src.raw_data(), threshold, embed.raw_data(), avg.raw_data(),
                          size.raw_data());
          const Tensor hit = unsqueeze(ge(picks, full({}, 0.0, i64)), -1);
          const Tensor picked = index_select(
              src, 0,
              from_pool ? clamp(picks, 0.0, double(pool - 1)) : arange(0.0, double(k), 1.0, i64));
          const Tensor want_embed = where(hit, picked * 1.0, embed0);
          const Tensor want_avg = where(hit, picked * threshold, avg0);
          const Tensor want_size = where(squeeze(hit, -1), full({}, threshold, opts), sizes);
          CHECK(std::memcmp(embed.to(Device::cpu()).raw_data(),
                            want_embed.to(Device::cpu()).raw_data(), embed.nbytes()) == 0);
          CHECK(std::memcmp(avg.to(Device::cpu()).raw_data(), want_avg.to(Device::cpu()).raw_data(),
                            avg.nbytes()) == 0);
          CHECK(std::memcmp(size.to(Device::cpu()).raw_data(),
                            want_size.to(Device::cpu()).raw_data(), size.nbytes()) == 0);
        }
      }
}

TEST_CASE("quant kernels: the codebook EMA's lerp and smoothing equal the composed ops' bits") {
  // The chain they replace: mul_(x, keep), add_(x, a, alpha); then
  // (size + eps) / (total + k eps) * total and embed_avg over it.
  Generator gen(29);
  for (const Device dev : quanta::testing::cpu_and_test_devices()) {
    for (const DType dt : {DType::f32, DType::f64}) {
      INFO(dev.str() << " " << std::string(dtype_name(dt)));
      const TensorOptions opts{.dtype = dt, .device = dev};
      const int64_t tables = 3, k = 37, d = 5;
      const Tensor sizes = (rand({tables, k}, gen) * 4.0).to(dt).to(dev);
      const Tensor counts = round(rand({tables, k}, gen) * 9.0).to(dt).to(dev);
      const Tensor avg = randn({tables, k, d}, gen, opts);
      const Tensor sums = randn({tables, k, d}, gen, opts);
      const double keep = std::pow(0.8, 2.0), alpha = 1.0 - 0.8, eps = 1e-5;
      const QuantKernelTable& q = quant_kernels(dev);
      // The lerp, on cluster sizes and on embed_avg.
      for (const auto& [x, a] : {std::pair{sizes, counts}, std::pair{avg, sums}}) {
        const Tensor fused = x.clone(), chain = x.clone();
        q.ema_lerp(dt, fused.numel(), keep, alpha, fused.raw_data(), a.raw_data());
        mul_(chain, keep);
        add_(chain, a, alpha);
        CHECK(std::memcmp(fused.to(Device::cpu()).raw_data(), chain.to(Device::cpu()).raw_data(),
                          fused.nbytes()) == 0);
      }
      // The smoothing, with totals of the sizes' rows.
      const Tensor totals = sum(sizes, {-1}).contiguous();
      const Tensor fused = empty({tables, k, d}, opts);
      q.ema_embed(dt, tables, k, d, eps, sizes.raw_data(), totals.raw_data(), avg.raw_data(),
                  fused.raw_data());
      const Tensor n = unsqueeze(totals, -1);
      const Tensor smoothed = (sizes + eps) / (n + double(k) * eps) * n;
      const Tensor chain = avg / unsqueeze(smoothed, -1);
      CHECK(std::memcmp(fused.to(Device::cpu()).raw_data(), chain.to(Device::cpu()).raw_data(),
                        fused.nbytes()) == 0);
      // Nothing to do: nothing touched.
      q.ema_lerp(dt, 0, keep, alpha, nullptr, nullptr);
      q.ema_embed(dt, 0, k, d, eps, nullptr, nullptr, nullptr, nullptr);
    }
  }
}

TEST_CASE("quant kernels: the squared error's mean and coefficient equal the composed ops' bits") {
  // The chains they replace: sums[0] / clamp(sums[1], 1, NaN) cast to the
  // loss's dtype; f64(g) * scale / clamp(sums[1], 1, NaN).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Device dev : quanta::testing::cpu_and_test_devices())
    for (const double count : {0.0, 1.0, 3.0, 4608.0})
      for (const DType dt : {DType::f32, DType::f64}) {
        INFO(dev.str() << " " << std::string(dtype_name(dt)) << " count " << count);
        const QuantKernelTable& q = quant_kernels(dev);
        const Tensor sums =
            from_vector(std::vector<double>{count == 0 ? 0.0 : 1234.567891, count}).to(dev);
        const Tensor mean = empty({}, {.dtype = dt, .device = dev});
        q.squared_error_mean(dt, static_cast<const double*>(sums.raw_data()), mean.raw_data());
        const Tensor want_mean =
            to_dtype(slice(sums, 0, 0, 1) / clamp(slice(sums, 0, 1, 2), 1.0, nan), dt);
        CHECK(std::memcmp(mean.to(Device::cpu()).raw_data(), want_mean.to(Device::cpu()).raw_data(),
                          mean.nbytes()) == 0);
        const Tensor g = scalar(0.3183098861837907, {.dtype = dt, .device = dev});
        const Tensor coef = empty({1}, {.dtype = DType::f64, .device = dev});
        q.squared_error_coefficient(dt, g.raw_data(), 2.0,
                                    static_cast<const double*>(sums.raw_data()),
                                    static_cast<double*>(coef.raw_data()));
        const Tensor want_coef =
            to_dtype(g, DType::f64) * 2.0 / clamp(slice(sums, 0, 1, 2), 1.0, nan);
        CHECK(coef.to(Device::cpu()).item<double>() == want_coef.to(Device::cpu()).item<double>());
      }
  // Another dtype is named, not read.
  const double sums[2] = {1, 2};
  int32_t out = 0;
  CHECK_THROWS_WITH_AS(quant_cpu::table().squared_error_mean(DType::i32, sums, &out),
                       doctest::Contains("commitment_loss"), std::invalid_argument);
}

TEST_CASE("quant kernels: the CUDA table is complete") {
  const QuantKernelTable& t = quant_cuda::table();
  CHECK(std::string(t.device_name) == "cuda");
  CHECK(null_entries(t).empty());
  if (cuda::module()) {
    // Built with CUDA (a GPU or not): the module's own table, found by name.
    CHECK(cuda::module_symbol("test", "quanta_quant_cuda_table_v1") != nullptr);
    CHECK(&t != &quant_cuda::unavailable_table());
  } else {
    // Without the module (a build without CUDA), the table is the unavailable one.
    CHECK(&t == &quant_cuda::unavailable_table());
    CHECK(&quant_kernels(Device::cuda(0)) == &quant_cuda::unavailable_table());
  }
}

TEST_CASE("quant kernels: the unavailable CUDA table names the op in every entry") {
  const QuantKernelTable& t = quant_cuda::unavailable_table();
  CHECK(std::string(t.device_name) == "cuda");
  CHECK(null_entries(t).empty());
  // Dummy pointers: every entry throws before touching memory.
  float f[4] = {};
  double d[4] = {};
  int64_t i[4] = {};
  uint8_t b[4] = {};
  const NF4Runs runs = nf4_packed_runs(b, f, 2, 64);
  const NF4RunsOut out{.run = 64, .codes = b};
  check_names(message_of([&] { t.nearest_codes(DType::f32, f, f, 1, 1, 1, false, i); }),
              "nearest_codes");
  check_names(message_of([&] { t.squared_error(DType::f32, f, f, nullptr, 1, 1, d); }),
              "commitment_loss");
  check_names(message_of([&] { t.squared_error_mean(DType::f32, d, f); }), "commitment_loss");
  check_names(message_of([&] { t.squared_error_coefficient(DType::f32, f, 2.0, d, d); }),
              "commitment_loss");
  check_names(message_of([&] { t.squared_error_grad(DType::f32, f, f, b, 1, 1, d, f); }),
              "commitment_loss");
  check_names(message_of([&] { t.route_grad(true, DType::f32, f, f, f, b, d, 1, 1, f); }),
              "rotate_to");
  check_names(message_of([&] { t.route_grad(false, DType::f32, f, f, f, b, d, 1, 1, f); }),
              "straight_through_with_commitment");
  check_names(message_of([&] { t.dead_code_picks(DType::f32, f, 1, 1.0, i, i); }), "Codebook");
  check_names(message_of([&] { t.replace_codes(DType::f32, 1, 1, i, true, f, 1.0, f, f, f); }),
              "Codebook");
  check_names(message_of([&] { t.code_statistics(DType::f32, i, f, 1, 1, 1, f, f); }),
              "code_statistics");
  check_names(message_of([&] { t.ema_lerp(DType::f32, 1, 1.0, 1.0, f, f); }), "Codebook EMA");
  check_names(message_of([&] { t.ema_embed(DType::f32, 1, 1, 1, 1e-5, f, f, f, f); }),
              "Codebook EMA");
  check_names(message_of([&] { t.bit_probabilities(DType::f64, d, 1, 1, 0, 1, d); }),
              "lfq_bit_probabilities");
  check_names(message_of([&] { t.bit_probabilities_grad(DType::f64, d, d, 1, 1, 0, 1, d); }),
              "lfq_bit_probabilities");
  check_names(message_of([&] { t.bit_product(DType::f64, d, 1, 1, d); }), "lfq_bit_product");
  check_names(message_of([&] { t.bit_product_grad(DType::f64, d, d, 1, 1, d); }),
              "lfq_bit_product");
  check_names(message_of([&] { t.clamped_entropy(d, 1, 1, d, d); }), "lfq_clamped_entropy");
  check_names(message_of([&] { t.nf4_absmax(f, 2, 64, f); }), "quantize_nf4");
  check_names(message_of([&] { t.nf4_encode(f, 2, 64, f, f, out); }), "quantize_nf4");
  check_names(message_of([&] { t.nf4_decode(runs, DType::f32, f); }), "dequantize");
  check_names(
      message_of([&] { t.nf4_linear(DType::f32, f, 1, 2, runs, DType::f32, 1, nullptr, f, {}); }),
      "nf4_linear");
  check_names(
      message_of([&] { t.nf4_linear_grad(DType::f32, f, 1, 1, runs, DType::f32, 2, f, false); }),
      "nf4_linear");
  if (!cuda::module())  // the reason is the module's
    CHECK(message_of([&] {
            t.nearest_codes(DType::f32, f, f, 1, 1, 1, false, i);
          }).find(cuda::unavailable_reason()) != std::string::npos);
}

TEST_CASE("quant kernels: CUDA tensors reach the CUDA kernels") {
  if (cuda_device_count() == 0) {
    MESSAGE("skipped the tensor route: " << testing::no_gpu_reason()
                                         << " (the table entries are checked above)");
    return;
  }
  Generator gen(1);
  const Tensor xh = randn({4, 3}, gen), ch = randn({5, 3}, gen);
  const Tensor x = xh.to(Device::cuda(0)), c = ch.to(Device::cuda(0));
  const Tensor got = nearest_codes(x, c, false);
  CHECK(got.device() == Device::cuda(0));
  CHECK(got.to(Device::cpu()).to_vector<int64_t>() ==
        nearest_codes(xh, ch, false).to_vector<int64_t>());
  const Tensor w = randn({2, 64}, gen);
  const Tensor qg = quantize_nf4(w.to(Device::cuda(0))).to(Device::cpu()), qc = quantize_nf4(w);
  REQUIRE(qg.nbytes() == qc.nbytes());
  CHECK(std::memcmp(qg.raw_data(), qc.raw_data(), qc.nbytes()) == 0);
  // Mixed devices fail naming the op and both devices.
  const std::string mixed = message_of([&] { (void)nearest_codes(x, c.to(Device::cpu()), false); });
  CHECK(mixed.find("[nearest_codes] operands are on different devices") == 0);
}

// One training step of every quantizer family on each device (sim:0, and
// cuda:0 where there is one) against the same layer (same seed) on the CPU:
// everything a layer composes of engine ops and table entries must exist on
// the device, keep its tensors there, and agree. f32 throughout; sim runs the
// CPU's kernels (the same bits), a GPU's GEMMs and reductions add in other
// orders, hence its tolerance.
TEST_CASE("quant layers: a training step on a device equals the CPU's") {
  if (!testing::have_gpu()) MESSAGE("cuda:0 skipped: " << testing::no_gpu_reason());
  for (const Device gpu : testing::test_devices()) {
    INFO("device ", gpu.str());
    const double tol = gpu.is_sim() ? 0.0 : 1e-4;
    using Make = std::function<std::shared_ptr<Quantizer>(Generator&)>;
    struct Family {
      const char* name;
      Make make;
    };
    VectorQuantizeOptions vq;
    vq.dim = 8;
    vq.codebook_size = 32;
    vq.kmeans_init = true;
    vq.threshold_ema_dead_code = 1.5;
    VectorQuantizeOptions cosine = vq;
    cosine.use_cosine_sim = true;
    cosine.kmeans_init = false;
    FSQOptions fsq;
    fsq.levels = {8, 5, 5};
    fsq.dim = 8;
    LFQOptions lfq;
    lfq.dim = 8;
    lfq.codebook_size = 1024;
    lfq.commitment_loss_weight = 0.25;
    ResidualVQOptions rvq;
    rvq.dim = 8;
    rvq.num_quantizers = 3;
    rvq.codebook_sizes = {16};
    const std::vector<Family> families = {
        {"vq (kmeans, dead codes)",
         [&](Generator& g) { return std::make_shared<VectorQuantize>(vq, g); }},
        {"vq cosine", [&](Generator& g) { return std::make_shared<VectorQuantize>(cosine, g); }},
        {"fsq", [&](Generator& g) { return std::make_shared<FSQ>(fsq, g); }},
        {"lfq (entropy)", [&](Generator& g) { return std::make_shared<LFQ>(lfq, g); }},
        {"residual vq", [&](Generator& g) { return std::make_shared<ResidualVQ>(rvq, g); }},
    };
    const auto close = [](const Tensor& got, const Tensor& want, double tol) {
      const Tensor diff = abs(got.to(Device::cpu()).to(DType::f64) - want.to(DType::f64));
      const double scale = 1.0 + amax(abs(want.to(DType::f64))).item();
      return diff.numel() == 0 || amax(diff).item() <= tol * scale;
    };
    for (const Family& f : families) {
      INFO(f.name);
      Generator gc(77), gg(77), data(5);
      std::shared_ptr<Quantizer> on_cpu = f.make(gc), on_gpu = f.make(gg);
      on_gpu->to(gpu);
      on_cpu->train();
      on_gpu->train();
      const Tensor x = randn({2, 24, 8}, data);
      const Tensor w = randn({2, 24, 8}, data);
      for (int step = 0; step < 2; ++step) {  // the second sees the first's codebook update
        INFO("step ", step);
        Tensor xc = x.clone().requires_grad_(true), xg = x.to(gpu).requires_grad_(true);
        const QuantizeOutput oc = on_cpu->forward(xc, Tensor(), QuantizeOptions{});
        const QuantizeOutput og = on_gpu->forward(xg, Tensor(), QuantizeOptions{});
        CHECK(og.quantized.device() == gpu);
        CHECK(og.indices.to(Device::cpu()).to_vector<int64_t>() == oc.indices.to_vector<int64_t>());
        CHECK(close(og.quantized, oc.quantized, tol));
        CHECK(close(og.loss, oc.loss, tol));
        (sum(oc.quantized * w) + sum(oc.loss)).backward();
        (sum(og.quantized * w.to(gpu)) + sum(og.loss)).backward();
        CHECK(close(xg.grad(), xc.grad(), tol));
        // Parameters and buffers (codebooks, EMA statistics) after the step.
        for (bool buffers : {false, true}) {
          const auto want = buffers ? on_cpu->named_buffers() : on_cpu->named_parameters();
          const auto got = buffers ? on_gpu->named_buffers() : on_gpu->named_parameters();
          REQUIRE(got.size() == want.size());
          for (size_t i = 0; i < want.size(); ++i) {
            INFO(want[i].first);
            CHECK(got[i].first == want[i].first);
            CHECK(close(got[i].second, want[i].second, tol));
          }
        }
      }
      // Past the first steps (k-means done), a training step never waits for
      // the device: forward, codebook update, dead codes, losses, backward.
      const Tensor xg = x.to(gpu), wg = w.to(gpu);
      HostSyncGuard guard(std::string(f.name) + ": a steady-state training step");
      for (int step = 0; step < 2; ++step) {
        const QuantizeOutput og =
            on_gpu->forward(xg.clone().requires_grad_(true), Tensor(), QuantizeOptions{});
        (sum(og.quantized * wg) + sum(og.loss)).backward();
      }
    }
  }
}
