#include "dist/reduce_check.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace quanta::dist::detail {
namespace {

// The bytes of the value 1 in `dtype` (0 is all zero bytes in every dtype).
std::vector<char> one_of(DType dtype) {
  std::vector<char> b(element_size(dtype));
  auto put = [&](auto v) { std::memcpy(b.data(), &v, sizeof v); };
  switch (dtype) {
    case DType::f32:
      put(1.0f);
      break;
    case DType::f64:
      put(1.0);
      break;
    case DType::bf16:
      put(bf16(1.0f));
      break;
    case DType::f16:
      put(f16(1.0f));
      break;
    case DType::i32:
      put(int32_t(1));
      break;
    case DType::i64:
      put(int64_t(1));
      break;
    case DType::u8:
      put(uint8_t(1));
      break;
    case DType::boolean:
      put(true);
      break;
    default:
      throw std::invalid_argument(std::string("[dist] no check region for dtype ") +
                                  dtype_name(dtype));
  }
  return b;
}

bool bit(uint32_t word, std::size_t i) { return (word >> i) & 1u; }

}  // namespace

std::vector<char> check_region(uint32_t word, DType dtype) {
  const std::size_t size = element_size(dtype);
  const std::vector<char> one = one_of(dtype);
  std::vector<char> region(kCheckElems * size, 0);
  // Element 2i holds bit i, element 2i + 1 its complement.
  for (std::size_t i = 0; i < kCheckElems / 2; ++i)
    std::memcpy(region.data() + (2 * i + (bit(word, i) ? 0 : 1)) * size, one.data(), size);
  return region;
}

bool check_region_holds(const char* reduced, uint32_t word, DType dtype, ReduceOp op) {
  const std::size_t size = element_size(dtype);
  // sum, avg and max keep a 0 that every rank put exactly 0 (avg divides it
  // by the world size: still 0); min and prod keep a 1 that every rank put.
  const bool look_at_ones = op == ReduceOp::min || op == ReduceOp::prod;
  const std::vector<char> want = look_at_ones ? one_of(dtype) : std::vector<char>(size, 0);
  for (std::size_t i = 0; i < kCheckElems / 2; ++i) {
    const bool one_at_even = bit(word, i);
    const std::size_t at = 2 * i + (one_at_even == look_at_ones ? 0 : 1);
    if (std::memcmp(reduced + at * size, want.data(), size) != 0) return false;
  }
  return true;
}

}  // namespace quanta::dist::detail
