// The nearest-code search's row argmin: the AVX-512 form (where the build
// has it) against the portable one and a plain loop, on rows with ties,
// signed zeros, infinities, NaN and every tail length.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "quant/cpu/row_argmin.h"

using namespace quanta::quant::quant_cpu;

namespace {

// The definition: the first index of the smallest non-NaN score, 0 if none.
template <class T>
int64_t plain_argmin(const std::vector<T>& row) {
  int64_t idx = 0;
  T m = std::numeric_limits<T>::infinity();
  for (std::size_t j = 0; j < row.size(); ++j)
    if (row[j] < m) m = row[j], idx = static_cast<int64_t>(j);
  return idx;
}

// Scores from a few distinct values (so ties are common), with NaN, +-inf
// and signed zeros sprinkled in at `odd_rate`.
template <class T>
std::vector<T> scores(std::mt19937& gen, int64_t k, double odd_rate) {
  std::uniform_int_distribution<int> value(-4, 4);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<T> row(static_cast<std::size_t>(k));
  for (T& v : row) {
    v = static_cast<T>(value(gen)) * T(0.5);
    if (u(gen) < odd_rate) {
      const double pick = u(gen);
      v = pick < 0.4    ? std::numeric_limits<T>::quiet_NaN()
          : pick < 0.6  ? std::numeric_limits<T>::infinity()
          : pick < 0.7  ? -std::numeric_limits<T>::infinity()
          : pick < 0.85 ? T(-0.0)
                        : T(0.0);
    }
  }
  return row;
}

template <class T>
void check_forms(int64_t k, const std::vector<T>& row) {
  CAPTURE(k);
  const int64_t want = plain_argmin(row);
  CHECK(row_argmin_lanes(row.data(), k) == want);
  CHECK(row_argmin(row.data(), k) == want);
#if defined(__AVX512F__)
  if constexpr (sizeof(T) == 4) CHECK(row_argmin_avx512(row.data(), k) == want);
#endif
}

}  // namespace

TEST_CASE("row_argmin: every form gives the first smallest, never NaN, for every length") {
#if defined(__AVX512F__)
  MESSAGE("the AVX-512 form is in this build");
#else
  MESSAGE("this build has no AVX-512 form: the portable one alone is checked");
#endif
  std::mt19937 gen(7);
  for (int64_t k = 1; k <= 100; ++k)
    for (const double odd : {0.0, 0.1, 0.6}) {
      check_forms(k, scores<float>(gen, k, odd));
      check_forms(k, scores<double>(gen, k, odd));
    }
  for (const int64_t k : {512, 1000, 1024, 4097}) {
    check_forms(k, scores<float>(gen, k, 0.05));
    check_forms(k, scores<double>(gen, k, 0.05));
  }
  // Rows with nothing to pick, and the minimum last, first, or in a tail.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const int64_t k : {1, 15, 16, 17, 31, 32, 33, 48, 64, 100}) {
    check_forms(k, std::vector<float>(k, nan));
    check_forms(k, std::vector<float>(k, inf));
    std::vector<float> last(k, 1.0f);
    last.back() = 0.5f;
    check_forms(k, last);
    std::vector<float> ties(k, -2.0f);
    check_forms(k, ties);
    std::vector<float> zeros(k, 0.0f);
    zeros.back() = -0.0f;  // ties with +0: the first index wins
    check_forms(k, zeros);
  }
}
