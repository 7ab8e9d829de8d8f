#include "engine/ops/qr.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/eigen_decompositions.h"
#include "engine/factory.h"
#include "engine/ops/host_decomposition.h"

namespace quanta {

namespace {

// One factorization in plain vectors, in the matrix's own precision (as
// LAPACK's sgeqrf and dgeqrf), so that several run on threads of their own.
template <typename T>
struct QrFactorization {
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

struct QrJob {
  QrFactorization<double> f64{};
  QrFactorization<float> f32{};
  bool is_f64 = false;
  Device device = Device::cpu();
};

QrJob prepare_qr(const Tensor& a) {
  if (a.dim() != 2)
    throw std::invalid_argument("[thin_qr] needs a matrix, got " + std::to_string(a.dim()) +
                                " dims");
  const int64_t m = a.shape()[0], n = a.shape()[1];
  if (m == 0 || n == 0)
    throw std::invalid_argument("[thin_qr] the matrix " + shape_str(a.shape()) + " is empty");
  if (a.dtype() != DType::f64 && a.dtype() != DType::f32)
    throw std::invalid_argument(std::string("[thin_qr] needs f32 or f64, got ") +
                                dtype_name(a.dtype()));
  QrJob job;
  job.is_f64 = a.dtype() == DType::f64;
  job.device = a.device();
  if (job.is_f64) {
    job.f64 = {m, n, a.to_vector<double>()};
    host_decomposition::check_finite(job.f64.values, m, n, "thin_qr");
  } else {
    job.f32 = {m, n, a.to_vector<float>()};
    host_decomposition::check_finite(job.f32.values, m, n, "thin_qr");
  }
  return job;
}

template <typename T>
ThinQR factors_of(const QrFactorization<T>& f, Device device) {
  const TensorOptions opts{.dtype = dtype_v<T>, .device = device};
  const int64_t p = std::min(f.m, f.n);
  return {from_vector<T>(f.values, {f.m, p}, opts), from_vector<T>(f.r, {p, f.n}, opts)};
}

}  // namespace

std::vector<ThinQR> thin_qr(const std::vector<Tensor>& matrices) {
  NoGradGuard no_grad;
  std::vector<QrJob> jobs;
  for (const Tensor& a : matrices) jobs.push_back(prepare_qr(a));
  host_decomposition::run_on_threads(jobs, [](QrJob& j) { j.is_f64 ? j.f64.run() : j.f32.run(); });
  std::vector<ThinQR> out;
  for (const QrJob& j : jobs)
    out.push_back(j.is_f64 ? factors_of(j.f64, j.device) : factors_of(j.f32, j.device));
  return out;
}

ThinQR thin_qr(const Tensor& a) { return std::move(thin_qr(std::vector<Tensor>{a})[0]); }

}  // namespace quanta
