#include "engine/ops/svd.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/autograd/grad_mode.h"
#include "engine/eigen_decompositions.h"
#include "engine/factory.h"
#include "engine/ops/host_decomposition.h"
#include "engine/random/sampling.h"

namespace quanta {

namespace {

// One decomposition in plain vectors, so that several run on threads of
// their own without touching tensors.
template <typename T>
struct Decomposition {
  int64_t m = 0, n = 0, k = 0;
  std::vector<T> values;  // [m, n], row-major
  std::vector<T> u{}, s{}, vh{};
  double total_square = 0, rest_square = 0;

  // torch.svd_lowrank's scheme when niter >= 0 (Halko, Martinsson and Tropp
  // 2011): an orthonormal basis Q of a's range from a Gaussian sketch
  // (omega [n, k]) sharpened by niter power iterations, then the exact SVD of
  // the small Q^T a. Else Eigen's full decomposition.
  int64_t niter = -1;
  std::vector<T> omega{};

  void run() {
    using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using ColMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
    const Eigen::Map<const Matrix> mat(values.data(), m, n);
    ColMatrix left, right;  // [m, >= k] and [n, >= k]
    Eigen::Matrix<T, Eigen::Dynamic, 1> sv;
    if (niter >= 0) {
      const auto basis = [](const ColMatrix& y) -> ColMatrix {
        const Eigen::HouseholderQR<ColMatrix> qr(y);
        return qr.householderQ() * ColMatrix::Identity(y.rows(), y.cols());
      };
      const Eigen::Map<const Matrix> sketch(omega.data(), n, k);
      ColMatrix q = basis(mat * sketch);
      for (int64_t i = 0; i < niter; ++i) q = basis(mat * basis(mat.transpose() * q));
      const ColMatrix small = q.transpose() * mat;  // [k, n]
      const Eigen::BDCSVD<ColMatrix> svd(small, Eigen::ComputeThinU | Eigen::ComputeThinV);
      left = q * svd.matrixU();
      right = svd.matrixV();
      sv = svd.singularValues();
      // ||a - Q Q^T a||^2 = ||a||^2 - ||Q^T a||^2: the rest is exact.
      for (int64_t i = 0; i < m * n; ++i)
        total_square += double(values[std::size_t(i)]) * double(values[std::size_t(i)]);
      double kept = 0;
      for (Eigen::Index i = 0; i < sv.size(); ++i) kept += double(sv(i)) * double(sv(i));
      rest_square = std::max(0.0, total_square - kept);
    } else {
      const Eigen::BDCSVD<Matrix> svd(mat, Eigen::ComputeThinU | Eigen::ComputeThinV);
      left = svd.matrixU();
      right = svd.matrixV();
      sv = svd.singularValues();
      for (Eigen::Index i = 0; i < sv.size(); ++i) {
        const double sq = double(sv(i)) * double(sv(i));
        total_square += sq;
        if (i >= k) rest_square += sq;
      }
    }
    u.resize(static_cast<std::size_t>(m * k));
    s.resize(static_cast<std::size_t>(k));
    vh.resize(static_cast<std::size_t>(k * n));
    for (int64_t j = 0; j < k; ++j) {
      // The sign that makes the column's entry of largest magnitude positive.
      int64_t arg = 0;
      for (int64_t i = 1; i < m; ++i)
        if (std::abs(left(i, j)) > std::abs(left(arg, j))) arg = i;
      const T sign = left(arg, j) < 0 ? T(-1) : T(1);
      for (int64_t i = 0; i < m; ++i) u[std::size_t(i * k + j)] = sign * left(i, j);
      for (int64_t i = 0; i < n; ++i) vh[std::size_t(j * n + i)] = sign * right(i, j);
      s[std::size_t(j)] = sv(j);
    }
    omega = {};
    values = {};
  }
};

// A checked matrix's decomposition, ready to run: f64 or f32.
struct SvdJob {
  Decomposition<double> f64{};
  Decomposition<float> f32{};
  bool is_f64 = false;
  Device device = Device::cpu();
};

SvdJob prepare_svd(const Tensor& a, int64_t k, int64_t niter = -1, Generator* gen = nullptr) {
  if (a.dim() != 2)
    throw std::invalid_argument("[top_singular_triplets] needs a matrix, got " +
                                std::to_string(a.dim()) + " dims");
  const int64_t m = a.shape()[0], n = a.shape()[1];
  if (k < 1 || k > std::min(m, n))
    throw std::invalid_argument("[top_singular_triplets] k must be in [1, " +
                                std::to_string(std::min(m, n)) + "] for a [" + std::to_string(m) +
                                ", " + std::to_string(n) + "] matrix, got " + std::to_string(k));
  if (a.dtype() != DType::f64 && a.dtype() != DType::f32)
    throw std::invalid_argument(std::string("[top_singular_triplets] needs f32 or f64, got ") +
                                dtype_name(a.dtype()));
  SvdJob job;
  job.is_f64 = a.dtype() == DType::f64;
  job.device = a.device();
  if (job.is_f64) {
    job.f64 = {m, n, k, a.to_vector<double>()};
    host_decomposition::check_finite(job.f64.values, m, n, "top_singular_triplets");
  } else {
    job.f32 = {m, n, k, a.to_vector<float>()};
    host_decomposition::check_finite(job.f32.values, m, n, "top_singular_triplets");
  }
  if (niter >= 0) {
    // The sketch in the matrix's dtype, drawn here, in order: the threads
    // draw nothing.
    const Tensor omega = randn({n, k}, *gen, {.dtype = a.dtype()});
    if (job.is_f64)
      job.f64.omega = omega.to_vector<double>();
    else
      job.f32.omega = omega.to_vector<float>();
    job.f64.niter = job.f32.niter = niter;
  }
  return job;
}

template <typename T>
SingularTriplets triplets_of(const Decomposition<T>& d, Device device) {
  const TensorOptions opts{.dtype = dtype_v<T>, .device = device};
  SingularTriplets out;
  out.u = from_vector<T>(d.u, {d.m, d.k}, opts);
  out.s = from_vector<T>(d.s, {d.k}, opts);
  out.vh = from_vector<T>(d.vh, {d.k, d.n}, opts);
  out.total_square = d.total_square;
  out.rest_square = d.rest_square;
  return out;
}

// Runs prepared jobs on the CPU's threads, one matrix each.
std::vector<SingularTriplets> run_jobs(std::vector<SvdJob>& jobs) {
  host_decomposition::run_on_threads(jobs, [](SvdJob& j) { j.is_f64 ? j.f64.run() : j.f32.run(); });
  std::vector<SingularTriplets> out;
  for (const SvdJob& j : jobs)
    out.push_back(j.is_f64 ? triplets_of(j.f64, j.device) : triplets_of(j.f32, j.device));
  return out;
}

}  // namespace

std::vector<SingularTriplets> top_singular_triplets(const std::vector<Tensor>& matrices,
                                                    const std::vector<int64_t>& k) {
  if (matrices.size() != k.size())
    throw std::invalid_argument("[top_singular_triplets] " + std::to_string(matrices.size()) +
                                " matrices and " + std::to_string(k.size()) + " ranks k");
  NoGradGuard no_grad;
  std::vector<SvdJob> jobs;
  for (std::size_t i = 0; i < matrices.size(); ++i) jobs.push_back(prepare_svd(matrices[i], k[i]));
  return run_jobs(jobs);
}

std::vector<SingularTriplets> approximate_singular_triplets(const std::vector<Tensor>& matrices,
                                                            const std::vector<int64_t>& k,
                                                            int64_t niter,
                                                            std::vector<Generator>& gens) {
  if (matrices.size() != k.size() || matrices.size() != gens.size())
    throw std::invalid_argument(
        "[approximate_singular_triplets] " + std::to_string(matrices.size()) + " matrices, " +
        std::to_string(k.size()) + " ranks k and " + std::to_string(gens.size()) + " generators");
  if (niter < 0)
    throw std::invalid_argument("[approximate_singular_triplets] niter must be >= 0, got " +
                                std::to_string(niter));
  NoGradGuard no_grad;
  std::vector<SvdJob> jobs;
  for (std::size_t i = 0; i < matrices.size(); ++i)
    jobs.push_back(prepare_svd(matrices[i], k[i], niter, &gens[i]));
  return run_jobs(jobs);
}

SingularTriplets top_singular_triplets(const Tensor& a, int64_t k) {
  return std::move(top_singular_triplets(std::vector<Tensor>{a}, std::vector<int64_t>{k})[0]);
}

}  // namespace quanta
