#include "quant/nf4/corda_start.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/cpu/parallel.h"
#include "engine/eigen_decompositions.h"
#include "engine/factory.h"

namespace quanta::quant {

namespace {

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// One layer's decomposition in plain vectors, so that several run on
// threads of their own without touching tensors.
struct CordaJob {
  int64_t out = 0, in = 0, rank = 0;
  double scaling = 1;
  bool kpm = false;
  std::vector<double> weight;      // [out, in], row-major
  std::vector<double> covariance;  // [in, in]
  std::vector<double> a{}, b{};    // [rank, in], [out, rank]
  std::string error{};             // set when the damping found no inverse

  void run() {
    const Eigen::Map<const Matrix> w(weight.data(), out, in);
    const Eigen::Map<const Matrix> c(covariance.data(), in, in);
    const Matrix eye = Matrix::Identity(in, in);
    const double mean_diagonal = c.diagonal().mean();
    // PEFT's damping: doubled until the inverse is good to 0.05 (in
    // Frobenius norm). Past 2^40 the covariance is no longer what decides.
    double damp = 0.01;
    Matrix fixed, inverse;
    for (int tries = 0;; ++tries) {
      fixed = c + eye * (mean_diagonal * damp);
      inverse = fixed.partialPivLu().inverse();
      if ((fixed * inverse - eye).norm() < 0.05) break;
      if (tries == 40) {
        error = "no damping up to 2^40 x 0.01 x mean(diag C) made the covariance invertible";
        return;
      }
      damp *= 2;
    }
    const Eigen::BDCSVD<Matrix> svd(w * fixed, Eigen::ComputeThinU | Eigen::ComputeThinV);
    const Matrix& u = svd.matrixU();  // [out, m]
    // (Vh inv(C'))^T = inv(C')^T V: [in, m].
    const Matrix v = inverse.transpose() * svd.matrixV();
    const auto& s = svd.singularValues();
    const int64_t m = s.size();
    a.assign(std::size_t(rank * in), 0);
    b.assign(std::size_t(out * rank), 0);
    for (int64_t j = 0; j < rank; ++j) {
      const int64_t t = kpm ? m - rank + j : j;
      // The sign that makes the column's entry of largest magnitude positive.
      int64_t arg = 0;
      for (int64_t i = 1; i < out; ++i)
        if (std::abs(u(i, t)) > std::abs(u(arg, t))) arg = i;
      const double root = std::sqrt(s(t) / scaling) * (u(arg, t) < 0 ? -1.0 : 1.0);
      for (int64_t i = 0; i < in; ++i) a[std::size_t(j * in + i)] = root * v(i, t);
      for (int64_t i = 0; i < out; ++i) b[std::size_t(i * rank + j)] = u(i, t) * root;
    }
    weight = {};
    covariance = {};
  }
};

}  // namespace

const char* corda_method_name(CordaMethod method) {
  return method == CordaMethod::ipm ? "ipm" : "kpm";
}

CordaMethod parse_corda_method(const std::string& text) {
  if (text == "ipm") return CordaMethod::ipm;
  if (text == "kpm") return CordaMethod::kpm;
  throw std::invalid_argument(
      "corda_method must be ipm (the largest singular triplets of W C) "
      "or kpm (the smallest), got \"" +
      text + "\"");
}

std::vector<ResidualStart> corda_starts(const std::vector<ResidualStartLayer>& layers,
                                        const std::vector<Tensor>& covariances,
                                        CordaMethod method) {
  NoGradGuard no_grad;
  if (covariances.size() != layers.size())
    throw std::invalid_argument("[corda_starts] " + std::to_string(layers.size()) + " layers and " +
                                std::to_string(covariances.size()) + " covariances");
  std::vector<CordaJob> jobs(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const ResidualStartLayer& l = layers[i];
    const std::string where = "[corda_starts] layer " + std::to_string(i) + ": ";
    if (l.weight.dim() != 2)
      throw std::invalid_argument(where + "the weight must be a matrix, got " +
                                  shape_str(l.weight.shape()));
    const int64_t out = l.weight.shape()[0], in = l.weight.shape()[1];
    if (l.rank < 1 || l.rank > std::min(out, in))
      throw std::invalid_argument(where + "rank " + std::to_string(l.rank) + " is outside [1, " +
                                  std::to_string(std::min(out, in)) + "] for a " +
                                  shape_str(l.weight.shape()) + " weight");
    const Tensor& c = covariances[i];
    if (!c.defined() || c.shape() != Shape{in, in})
      throw std::invalid_argument(where + "the input covariance must be " +
                                  shape_str(Shape{in, in}) + " for a " +
                                  shape_str(l.weight.shape()) + " weight, got " +
                                  (c.defined() ? shape_str(c.shape()) : std::string("none")));
    CordaJob& j = jobs[i];
    j.out = out;
    j.in = in;
    j.rank = l.rank;
    j.scaling = l.scaling;
    j.kpm = method == CordaMethod::kpm;
    j.weight = l.weight.detach().to(Device::cpu()).to(DType::f64).contiguous().to_vector<double>();
    j.covariance = c.detach().to(Device::cpu()).to(DType::f64).contiguous().to_vector<double>();
    for (std::size_t k = 0; k < j.covariance.size(); ++k)
      if (!std::isfinite(j.covariance[k]))
        throw std::invalid_argument(where + "entry (" + std::to_string(int64_t(k) / in) + ", " +
                                    std::to_string(int64_t(k) % in) +
                                    ") of the input covariance is not finite");
    double trace = 0;
    for (int64_t k = 0; k < in; ++k) trace += j.covariance[std::size_t(k * in + k)];
    if (!(trace > 0))
      throw std::invalid_argument(where +
                                  "the input covariance's diagonal has no positive mean (the "
                                  "layer's inputs were all zero): nothing to decompose with");
    for (std::size_t k = 0; k < j.weight.size(); ++k)
      if (!std::isfinite(j.weight[k]))
        throw std::invalid_argument(where + "entry (" + std::to_string(int64_t(k) / in) + ", " +
                                    std::to_string(int64_t(k) % in) +
                                    ") of the weight is not finite");
  }
  cpu::parallel_for(0, int64_t(jobs.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) jobs[std::size_t(i)].run();
  });
  std::vector<ResidualStart> out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const CordaJob& j = jobs[i];
    if (!j.error.empty())
      throw std::invalid_argument("[corda_starts] layer " + std::to_string(i) + ": " + j.error);
    out.push_back(given_start(layers[i], from_vector<double>(j.a, {j.rank, j.in}),
                              from_vector<double>(j.b, {j.out, j.rank})));
  }
  return out;
}

}  // namespace quanta::quant
