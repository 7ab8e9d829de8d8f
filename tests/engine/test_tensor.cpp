// Tensor handles, factories, conversions and printing.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "engine/cpu/block_cache.h"
#include "engine/cuda/module.h"
#include "quanta.h"
#include "support/errors.h"

using namespace quanta;

TEST_CASE("layout of a fresh tensor and of its transpose") {
  Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  CHECK(a.shape() == Shape{2, 3});
  CHECK(a.strides() == Shape{3, 1});
  CHECK(a.dim() == 2);
  CHECK(a.size(-1) == 3);
  CHECK(a.numel() == 6);
  CHECK(a.nbytes() == 24);
  CHECK(a.is_contiguous());
  Tensor b = a.t();
  CHECK_FALSE(b.is_contiguous());
  CHECK(b.contiguous().to_vector<float>() == std::vector<float>{1, 4, 2, 5, 3, 6});
  CHECK(sum(a * 2.0).item() == doctest::Approx(42));
  CHECK_THROWS_WITH_AS(a.size(2), doctest::Contains("dim 2 out of range"), std::invalid_argument);
}

TEST_CASE("factories") {
  CHECK(zeros({2, 2}).to_vector<float>() == std::vector<float>(4, 0.0f));
  CHECK(ones({3}, {.dtype = DType::i64}).to_vector<int64_t>() == std::vector<int64_t>{1, 1, 1});
  CHECK(full({2}, 2.5, {.dtype = DType::f64}).to_vector<double>() == std::vector<double>{2.5, 2.5});
  CHECK(arange(5).to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4});
  CHECK(arange(1, 2, 0.25, {.dtype = DType::f64}).to_vector<double>() ==
        std::vector<double>{1, 1.25, 1.5, 1.75});
  CHECK(arange(3, 0, -1, {.dtype = DType::i32}).to_vector<int32_t>() ==
        std::vector<int32_t>{3, 2, 1});
  auto l = linspace(0, 1, 5, {.dtype = DType::f64}).to_vector<double>();
  CHECK(l == std::vector<double>{0, 0.25, 0.5, 0.75, 1});
  CHECK(linspace(0, 1, 0).numel() == 0);
  CHECK(linspace(3, 9, 1).to_vector<float>() == std::vector<float>{3});
  CHECK(eye(2, 3).to_vector<float>() == std::vector<float>{1, 0, 0, 0, 1, 0});
  CHECK(scalar(4.0).dim() == 0);
  CHECK(scalar(4.0).item() == 4.0);
  const float raw[] = {1, 2, 3, 4};
  Tensor fb = from_blob(raw, {2, 2}, DType::f32);
  CHECK(fb.to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  CHECK(fb.raw_data() != static_cast<const void*>(raw));  // a copy, never an alias
  CHECK(zeros_like(fb).shape() == fb.shape());
  CHECK(full_like(fb, 3).to_vector<float>()[3] == 3.0f);
  CHECK_THROWS_WITH_AS(from_vector<float>({1, 2, 3}, {2, 2}), doctest::Contains("do not fill"),
                       std::invalid_argument);
  CHECK_THROWS_AS(arange(0, 1, 0), std::invalid_argument);
  CHECK_THROWS_WITH_AS(empty({2, -1}), doctest::Contains("negative size"), std::invalid_argument);
}

TEST_CASE("zero-size tensors are ordinary") {
  Tensor z = zeros({0, 3});
  CHECK(z.numel() == 0);
  CHECK(z.nbytes() == 0);
  CHECK(sum(z).item() == 0.0);
  CHECK(sum(z, {0}).to_vector<float>() == std::vector<float>{0, 0, 0});
  CHECK(sum(z, {1}).shape() == Shape{0});
  CHECK((z + 1.0).shape() == Shape{0, 3});
  CHECK(z.t().contiguous().shape() == Shape{3, 0});
  CHECK(z.reshape({3, 0, 5}).numel() == 0);
  Tensor g = zeros({0, 2}, {.dtype = DType::f64, .requires_grad = true});
  sum(exp(g)).backward();
  CHECK(g.grad().shape() == Shape{0, 2});
  CHECK(z.str().find("shape=[0, 3]") != std::string::npos);
}

TEST_CASE("dtype conversion round trips and 16-bit floats") {
  Tensor x = from_vector<double>({1.5, -2.25, 1e-3});
  CHECK(x.to(DType::f32).dtype() == DType::f32);
  CHECK(x.to(DType::bf16).to_vector<double>()[0] == 1.5);
  CHECK(x.to(DType::f16).to_vector<double>()[1] == -2.25);
  CHECK(x.to(DType::i64).to_vector<int64_t>() == std::vector<int64_t>{1, -2, 0});
  CHECK(x.to(DType::boolean).to_vector<bool>() == std::vector<bool>{true, true, true});
  CHECK(from_vector<float>({0.1f}).to(DType::bf16).item() == doctest::Approx(0.1).epsilon(0.01));
  CHECK(x.to(DType::f64).is_same(x));  // no copy when nothing changes
  CHECK(parse_dtype("bfloat16") == DType::bf16);
  CHECK_THROWS_WITH_AS(parse_dtype("f8"), doctest::Contains("unknown dtype"),
                       std::invalid_argument);
  CHECK(promote_types(DType::i32, DType::f16) == DType::f16);
  CHECK(promote_types(DType::bf16, DType::f16) == DType::f32);
  // Gradients flow back through a cast.
  Tensor w = from_vector<double>({2.0}).requires_grad_();
  sum(square(w.to(DType::f32))).backward();
  CHECK(w.grad().dtype() == DType::f64);
  CHECK(w.grad().item() == 4.0);
}

TEST_CASE("byte-only nf4: 36-byte blocks of 64 elements, no arithmetic") {
  CHECK(std::string(dtype_name(DType::nf4)) == "nf4");
  CHECK_FALSE(dtype_info(DType::nf4).arithmetic);
  CHECK(empty({64}, {.dtype = DType::nf4}).nbytes() == 36);
  CHECK(empty({2, 37}, {.dtype = DType::nf4}).nbytes() == 72);  // a partial last block
  CHECK_THROWS_WITH_AS(element_size(DType::nf4), doctest::Contains("nf4"), std::invalid_argument);
}

TEST_CASE("item and data access are checked") {
  CHECK_THROWS_WITH_AS(zeros({2}).item(), doctest::Contains("one-element"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(zeros({2}).data<double>(), doctest::Contains("dtype f32, accessed as f64"),
                       std::invalid_argument);
  CHECK(from_vector<int64_t>({7}).item<int64_t>() == 7);
}

TEST_CASE("devices: parsing and CUDA without a GPU") {
  CHECK(Device::parse("cuda:3").index == 3);
  CHECK(Device::parse("cpu").is_cpu());
  CHECK(Device::parse("cuda").str() == "cuda:0");
  CHECK_THROWS_WITH_AS(Device::parse("gpu"), doctest::Contains("cannot parse device"),
                       std::invalid_argument);
  // The texts are those of engine/cuda/module.cpp (no CUDA backend) and
  // engine/cuda/runtime.cu (a loaded backend, checked against the GPUs seen).
  const int gpus = cuda_device_count();
  auto unavailable = [gpus](int i) {
    return "[cuda] device cuda:" + std::to_string(i) + " is not available (" +
           std::to_string(gpus) + " CUDA devices visible)";
  };
  if (gpus == 0) {
    const bool loaded = cuda::module() != nullptr;
    MESSAGE(std::string(loaded ? "CUDA backend loaded, no GPU: checking the device is named"
                               : "no CUDA backend: checking the error says why"));
    for (int i : {0, 1}) {
      const std::string why = loaded ? unavailable(i) : cuda::unavailable_reason();
      CHECK_THROWS_WITH_AS(from_vector<float>({1, 2}).to(Device::cuda(i)),
                           doctest::Contains(why.c_str()), std::runtime_error);
    }
  } else {
    CHECK(cuda_built());
    CHECK_THROWS_WITH_AS(zeros({2}).to(Device::cuda(gpus)), unavailable(gpus).c_str(),
                         std::runtime_error);
    Tensor x = from_vector<float>({1, 2, 3}).to(Device::cuda(0));
    CHECK(x.device() == Device::cuda(0));
    CHECK(x.to(Device::cpu()).to_vector<float>() == std::vector<float>{1, 2, 3});
    CHECK(exp(x).to(Device::cpu()).to_vector<float>() ==
          exp(from_vector<float>({1, 2, 3})).to_vector<float>());
    // Operands on two devices are refused, naming both.
    CHECK_THROWS_WITH_AS(add(x, from_vector<float>({1, 2, 3})),
                         doctest::Contains("operands are on different devices: cuda:0 and cpu"),
                         std::invalid_argument);
  }
}

TEST_CASE("printing") {
  Tensor a = from_vector<float>({1, 2, 3, 4}, {2, 2});
  CHECK(a.str() == "tensor([[1, 2],\n [3, 4]], dtype=f32, shape=[2, 2])");
  CHECK(scalar(2.5).str() == "tensor(2.5, dtype=f32, shape=[])");
  Tensor big = arange(0, 2000, 1);
  CHECK(big.str().find("..., ") != std::string::npos);
  CHECK(Tensor().str() == "Tensor(undefined)");
  Tensor g = ones({1}, {.requires_grad = true});
  CHECK(g.str().find("requires_grad") != std::string::npos);
}

TEST_CASE("thread count is settable") {
  const int before = num_threads();
  set_num_threads(1);
  CHECK(num_threads() == 1);
  set_num_threads(before);
  CHECK_THROWS_AS(set_num_threads(0), std::invalid_argument);
}

TEST_CASE("large CPU buffers are reused: a freed 4 MiB block backs the next 4 MiB tensor") {
  const std::size_t before = cpu::cached_block_bytes();
  const void* first = nullptr;
  {
    Tensor a = empty({1 << 20});  // 4 MiB of f32
    first = a.raw_data();
    fill_(a, 2.0);
  }
  if (cpu::cached_block_bytes() == before) {
    MESSAGE("the CPU block cache is off (AddressSanitizer build or QUANTA_CPU_CACHE_MB=0)");
    return;
  }
  CHECK(cpu::cached_block_bytes() == before + (std::size_t(4) << 20));
  Tensor b = empty({1 << 20});
  CHECK(b.raw_data() == first);  // the same pages, already touched
  CHECK(cpu::cached_block_bytes() == before);
  Tensor c = zeros({1 << 20});  // reuse never leaks old values
  CHECK(sum(c).item() == 0.0);
  Tensor small = empty({16});  // small blocks are malloc's business
  CHECK(cpu::cached_block_bytes() == before);
}

TEST_CASE("mid-size CPU buffers are reused too: 64 KiB classes below 2 MiB, huge pages above") {
  CHECK(cpu::cached_block_size(0) == 0);
  CHECK(cpu::cached_block_size((std::size_t(64) << 10) - 1) == 0);  // malloc's
  CHECK(cpu::cached_block_size(std::size_t(64) << 10) == std::size_t(64) << 10);
  CHECK(cpu::cached_block_size(300 * 1024) == std::size_t(320) << 10);
  CHECK(cpu::cached_block_size((std::size_t(2) << 20) - 1) == std::size_t(2) << 20);
  CHECK(cpu::cached_block_size((std::size_t(2) << 20) + 1) == std::size_t(4) << 20);
  const std::size_t before = cpu::cached_block_bytes();
  const void* first = nullptr;
  {
    Tensor a = empty({75 * 1024});  // 300 KiB of f32: a main-job activation's size
    first = a.raw_data();
    fill_(a, 3.0);
  }
  if (cpu::cached_block_bytes() == before) {
    MESSAGE("the CPU block cache is off (AddressSanitizer build or QUANTA_CPU_CACHE_MB=0)");
    return;
  }
  CHECK(cpu::cached_block_bytes() == before + (std::size_t(320) << 10));
  Tensor b = empty({75 * 1024});
  CHECK(b.raw_data() == first);  // the same pages, no fault on first touch
  CHECK(reinterpret_cast<std::uintptr_t>(b.raw_data()) % 4096 == 0);
  CHECK(cpu::cached_block_bytes() == before);
  Tensor c = zeros({70 * 1024});  // another size of the same class: its own zeros
  CHECK(sum(c).item() == 0.0);
}

TEST_CASE("the CPU block cache keeps a step's blocks, within 1.5x the peak in use") {
  cpu::BlockCacheStats s = cpu::block_cache_stats();
  if (s.bound == 0 || std::getenv("QUANTA_CPU_CACHE_MB")) {
    MESSAGE("the CPU block cache is off or has a fixed bound: nothing to check");
    return;
  }
  // Enough 62 MiB blocks (a size nothing else here uses) to pass the bound:
  // the peak, hence the bound, rises with them (untouched, they cost no memory).
  const int64_t block = int64_t(62) << 20;
  const std::size_t k = (s.bound - s.in_use) / std::size_t(block) + 2;
  {
    std::vector<Tensor> step;
    for (std::size_t i = 0; i < k; ++i) step.push_back(empty({block}, {.dtype = DType::u8}));
    s = cpu::block_cache_stats();
    CHECK(s.peak == s.in_use);
    CHECK(s.bound == s.peak + std::max(std::size_t(512) << 20, s.peak / 2));
    CHECK(s.in_use + s.held <= s.bound);
  }
  // Freed, they are all kept: the next step takes them back.
  s = cpu::block_cache_stats();
  CHECK(s.held >= k * std::size_t(block));
  CHECK(s.in_use + s.held <= s.bound);
  {
    // Sizes that were never freed, past the slack: the blocks kept longest
    // make room for them.
    std::vector<Tensor> others;
    for (std::size_t i = 0; i < k; ++i)
      others.push_back(empty({int64_t(66) << 20}, {.dtype = DType::u8}));
    const cpu::BlockCacheStats after = cpu::block_cache_stats();
    CHECK(after.held < s.held);
    CHECK(after.in_use + after.held <= after.bound);
  }
  // The 62 MiB blocks still kept are handed back before any fresh one.
  const std::size_t held = cpu::cached_block_bytes();
  Tensor again = empty({block}, {.dtype = DType::u8});
  CHECK(cpu::cached_block_bytes() == held - std::size_t(block));
  // Everything kept can be handed back to the system; blocks in use return
  // to the cache when freed.
  CHECK(cpu::release_cached_blocks() == held - std::size_t(block));
  CHECK(cpu::cached_block_bytes() == 0);
  again = Tensor();
  CHECK(cpu::cached_block_bytes() == std::size_t(block));
}

TEST_CASE("same_bytes_as: a view of the same elements as another dtype of their size") {
  const Tensor b = from_vector<bool>({true, false, true});
  const Tensor u = detail::same_bytes_as(b, DType::u8);
  CHECK(u.dtype() == DType::u8);
  CHECK(u.storage() == b.storage());
  CHECK(u.to_vector<uint8_t>() == std::vector<uint8_t>{1, 0, 1});
  const Tensor f = from_vector<float>({1.0f});
  CHECK(detail::same_bytes_as(f, DType::i32).to_vector<int32_t>()[0] == 0x3f800000);
  CHECK(quanta::testing::message_of([&] { detail::same_bytes_as(f, DType::f64); }) ==
        "[same_bytes_as] f32 and f64 elements differ in size");
}
