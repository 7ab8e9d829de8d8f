#include "engine/ops/qr.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/eigen.h"
#include "engine/factory.h"
// Under the same silenced warnings as engine/eigen.h's Eigen/Core.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <Eigen/QR>
#pragma GCC diagnostic pop

namespace quanta {

namespace {

// One factorization in plain vectors, in the matrix's own precision (as
// LAPACK's sgeqrf and dgeqrf), so that several run on threads of their own.
template <typename T>
struct Factorization {
  int64_t m = 0, n = 0;
  std::vector<T> values;  // [m, n], row-major; then q [m, p]
  std::vector<T> r{};     // [p, n]

  void run() {
    using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const int64_t p = std::min(m, n);
    const Eigen::HouseholderQR<Matrix> qr(Eigen::Map<const Matrix>(values.data(), m, n));
    const Matrix q = qr.householderQ() * Matrix::Identity(m, p);
    const Matrix upper = qr.matrixQR().topRows(p).template triangularView<Eigen::Upper>();
    values.assign(q.data(), q.data() + m * p);
    r.assign(upper.data(), upper.data() + p * n);
  }
};

struct Job {
  Factorization<double> f64{};
  Factorization<float> f32{};
  bool is_f64 = false;
  Device device = Device::cpu();
};

template <typename T>
void check_finite(const std::vector<T>& values, int64_t m, int64_t n) {
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      throw std::invalid_argument("[thin_qr] entry (" + std::to_string(int64_t(i) / n) + ", " +
                                  std::to_string(int64_t(i) % n) + ") of the [" +
                                  std::to_string(m) + ", " + std::to_string(n) +
                                  "] matrix is not finite");
}

Job prepare(const Tensor& a) {
  if (a.dim() != 2)
    throw std::invalid_argument("[thin_qr] needs a matrix, got " + std::to_string(a.dim()) +
                                " dims");
  const int64_t m = a.shape()[0], n = a.shape()[1];
  if (m == 0 || n == 0)
    throw std::invalid_argument("[thin_qr] the matrix " + shape_str(a.shape()) + " is empty");
  if (a.dtype() != DType::f64 && a.dtype() != DType::f32)
    throw std::invalid_argument(std::string("[thin_qr] needs f32 or f64, got ") +
                                dtype_name(a.dtype()));
  Job job;
  job.is_f64 = a.dtype() == DType::f64;
  job.device = a.device();
  if (job.is_f64) {
    job.f64 = {m, n, a.to_vector<double>()};
    check_finite(job.f64.values, m, n);
  } else {
    job.f32 = {m, n, a.to_vector<float>()};
    check_finite(job.f32.values, m, n);
  }
  return job;
}

template <typename T>
ThinQR factors_of(const Factorization<T>& f, Device device) {
  const TensorOptions opts{.dtype = dtype_v<T>, .device = device};
  const int64_t p = std::min(f.m, f.n);
  return {from_vector<T>(f.values, {f.m, p}, opts), from_vector<T>(f.r, {p, f.n}, opts)};
}

}  // namespace

std::vector<ThinQR> thin_qr(const std::vector<Tensor>& matrices) {
  NoGradGuard no_grad;
  std::vector<Job> jobs;
  for (const Tensor& a : matrices) jobs.push_back(prepare(a));
  cpu::parallel_for(0, int64_t(jobs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (jobs[std::size_t(i)].is_f64)
        jobs[std::size_t(i)].f64.run();
      else
        jobs[std::size_t(i)].f32.run();
    }
  });
  std::vector<ThinQR> out;
  for (const Job& j : jobs)
    out.push_back(j.is_f64 ? factors_of(j.f64, j.device) : factors_of(j.f32, j.device));
  return out;
}

ThinQR thin_qr(const Tensor& a) { return std::move(thin_qr(std::vector<Tensor>{a})[0]); }

}  // namespace quanta
