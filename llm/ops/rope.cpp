// Rotary embeddings: transformers' frequency rules (modeling_rope_utils:
// default, linear, dynamic, llama3, longrope, yarn) on the host in f32, the tables from
// engine ops, the rotation from llm_kernels().rope.
#include "llm/ops/rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "engine/autograd/function.h"
#include "engine/capture/device_graph.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "llm/kernels/table.h"
#include "llm/ops/checks.h"

namespace quanta::llm {
namespace {

constexpr const char* kRopeOp = "rope";

void check_positive(const char* what, double v) {
  if (!std::isfinite(v) || v <= 0)
    detail::bad_argument(kRopeOp,
                         std::string(what) + " must be finite and > 0, got " + std::to_string(v));
}

// 1 / base^(2i / dim) in f32, as torch computes `1.0 / (base ** (arange(0,
// dim, 2).float() / dim))`: the exponent and the power in f32.
std::vector<float> default_inv_freq(double base, int64_t dim) {
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    f[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  return f;
}

// Llama 3's rule: long wavelengths slowed by `factor`, short ones kept, a
// smooth blend between (f32 throughout, as torch's tensor arithmetic).
void llama3_scale(std::vector<float>& inv_freq, const RopeScaling& s) {
  const float factor = static_cast<float>(s.factor);
  const float low = static_cast<float>(s.low_freq_factor);
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  // Python computes these scalars in double; torch compares and divides
  // them with the f32 tensor in f32.
  const float low_wavelen = static_cast<float>(old_len / s.low_freq_factor);
  const float high_wavelen = static_cast<float>(old_len / s.high_freq_factor);
  const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  for (float& f : inv_freq) {
    const float wavelen = static_cast<float>(2 * M_PI) / f;
    float scaled = wavelen > low_wavelen ? f / factor : f;
    const float smooth = (static_cast<float>(old_len) / wavelen - low) / span;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    if (medium) scaled = (1 - smooth) * scaled / factor + smooth * scaled;
    f = scaled;
  }
}

// YaRN: each frequency a blend of itself (extrapolated) and itself / factor
// (interpolated), by a ramp over the dimensions between the ones that turn
// beta_fast and beta_slow times over the original length; cos and sin
// scaled by the attention factor. transformers' _compute_yarn_parameters:
// the bounds in Python's double arithmetic, the tensors in f32.
RopeFrequencies yarn_frequencies(const RopeConfig& c) {
  const RopeScaling& s = c.scaling;
  const int64_t orig = s.original_max_position_embeddings;
  if (orig <= 0) detail::bad_argument(kRopeOp, "yarn needs original_max_position_embeddings > 0");
  double factor = s.factor;
  if (!(factor > 0)) {  // derived, as DeepSeek's configs leave it
    if (c.max_position_embeddings <= 0)
      detail::bad_argument(kRopeOp, "yarn without a factor needs max_position_embeddings > 0");
    factor = double(c.max_position_embeddings) / double(orig);
  }
  check_positive("rope_scaling.factor", factor);
  const auto mscale_of = [factor](double m) {
    return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
  };
  RopeFrequencies out;
  out.attention_scaling = s.attention_factor > 0 ? s.attention_factor
                          : s.mscale != 0 && s.mscale_all_dim != 0
                              ? mscale_of(s.mscale) / mscale_of(s.mscale_all_dim)
                              : mscale_of(1.0);
  const double beta_fast = s.beta_fast != 0 ? s.beta_fast : 32;
  const double beta_slow = s.beta_slow != 0 ? s.beta_slow : 1;
  check_positive("rope_scaling.beta_fast", beta_fast);
  check_positive("rope_scaling.beta_slow", beta_slow);
  const double dim = double(c.head_dim);
  // The dimension whose frequency turns `rotations` times over orig.
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(double(orig) / (rotations * 2 * M_PI)) / (2 * std::log(c.theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;  // as transformers avoids a zero span
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  const float f32_factor = static_cast<float>(factor);
  const size_t half = static_cast<size_t>(c.head_dim / 2);
  out.inv_freq.resize(half);
  for (size_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    const float pos_freq = std::pow(static_cast<float>(c.theta), exponent);
    const float extrapolated = 1.0f / pos_freq;
    const float interpolated = 1.0f / (f32_factor * pos_freq);
    const float ramp = std::clamp((static_cast<float>(i) - lo) / span, 0.0f, 1.0f);
    const float keep = 1.0f - ramp;  // the extrapolation's share
    const float a = interpolated * (1.0f - keep), b = extrapolated * keep;
    out.inv_freq[i] = a + b;
  }
  return out;
}

}  // namespace

RopeFrequencies rope_frequencies(const RopeConfig& c, int64_t seq_len) {
  if (c.head_dim < 2 || c.head_dim % 2 != 0)
    detail::bad_argument(kRopeOp,
                         "head_dim must be even and >= 2, got " + std::to_string(c.head_dim));
  check_positive("rope_theta", c.theta);
  const RopeScaling& s = c.scaling;
  RopeFrequencies out;
  if (s.type == "default") {
    out.inv_freq = default_inv_freq(c.theta, c.head_dim);
  } else if (s.type == "linear") {
    check_positive("rope_scaling.factor", s.factor);
    out.inv_freq = default_inv_freq(c.theta, c.head_dim);
    for (float& f : out.inv_freq) f /= static_cast<float>(s.factor);
  } else if (s.type == "dynamic") {
    check_positive("rope_scaling.factor", s.factor);
    if (c.max_position_embeddings <= 0)
      detail::bad_argument(kRopeOp, "dynamic scaling needs max_position_embeddings > 0");
    const double max_pos = static_cast<double>(c.max_position_embeddings);
    const double len = seq_len > c.max_position_embeddings ? static_cast<double>(seq_len) : max_pos;
    const double dim = static_cast<double>(c.head_dim);
    const double base =
        c.theta * std::pow(s.factor * len / max_pos - (s.factor - 1), dim / (dim - 2));
    out.inv_freq = default_inv_freq(base, c.head_dim);
  } else if (s.type == "llama3") {
    check_positive("rope_scaling.factor", s.factor);
    check_positive("rope_scaling.low_freq_factor", s.low_freq_factor);
    check_positive("rope_scaling.high_freq_factor", s.high_freq_factor);
    if (!(s.high_freq_factor > s.low_freq_factor))
      detail::bad_argument(kRopeOp, "rope_scaling.high_freq_factor must be over low_freq_factor");
    if (s.original_max_position_embeddings <= 0)
      detail::bad_argument(kRopeOp,
                           "llama3 scaling needs rope_scaling.original_max_position_embeddings"
                           " > 0");
    out.inv_freq = default_inv_freq(c.theta, c.head_dim);
    llama3_scale(out.inv_freq, s);
  } else if (s.type == "longrope") {
    const int64_t orig = s.original_max_position_embeddings;
    if (orig <= 0)
      detail::bad_argument(kRopeOp, "longrope needs original_max_position_embeddings > 0");
    const size_t half = static_cast<size_t>(c.head_dim / 2);
    for (const auto* factors : {&s.short_factor, &s.long_factor})
      if (factors->size() != half)
        detail::bad_argument(
            kRopeOp, std::string("longrope's ") + (factors == &s.short_factor ? "short" : "long") +
                         "_factor has " + std::to_string(factors->size()) +
                         " values, the rotated head_dim " + std::to_string(c.head_dim) + " needs " +
                         std::to_string(half));
    const std::vector<double>& ext = seq_len > orig ? s.long_factor : s.short_factor;
    for (double e : ext) check_positive("longrope factor", e);
    // 1 / (ext * base^(2i / dim)), each step in f32 as torch's tensors.
    out.inv_freq.resize(half);
    for (size_t i = 0; i < half; ++i) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
      out.inv_freq[i] =
          1.0f / (static_cast<float>(ext[i]) * std::pow(static_cast<float>(c.theta), exponent));
    }
    // Python's double arithmetic, as transformers computes the factor.
    double factor = s.factor;
    if (!(factor > 0)) factor = double(c.max_position_embeddings) / double(orig);
    out.attention_scaling = s.attention_factor > 0 ? s.attention_factor
                            : factor <= 1.0
                                ? 1.0
                                : std::sqrt(1 + std::log(factor) / std::log(double(orig)));
  } else if (s.type == "yarn") {
    out = yarn_frequencies(c);
  } else {
    detail::bad_argument(kRopeOp, "rope_scaling type '" + s.type +
                                      "' is not supported (supported: default, linear, dynamic, "
                                      "llama3, longrope, yarn)");
  }
  return out;
}

RopeTables rope_tables(const RopeFrequencies& f, const Tensor& positions, DType dtype) {
  if (!positions.defined() || positions.dtype() != DType::i64 || positions.dim() != 2)
    detail::bad_argument(
        kRopeOp, "positions must be i64 [batch, tokens]" +
                     (positions.defined() ? ", got " + std::string(dtype_name(positions.dtype())) +
                                                " " + shape_str(positions.shape())
                                          : std::string()));
  if (f.inv_freq.empty()) detail::bad_argument(kRopeOp, "no inverse frequencies");
  const DType acc = accumulation_dtype(dtype);
  const int64_t half = static_cast<int64_t>(f.inv_freq.size());
  // Uploaded once per device and dtype, not at every forward.
  const Tensor inv =
      constant_tensor(f.inv_freq, {1, 1, half}, {.dtype = acc, .device = positions.device()});
  // position * inv_freq: the one product of transformers' k = 1 matmul.
  const Tensor angle = mul(unsqueeze(positions.to(acc), -1), inv);
  RopeTables t{cos(angle), sin(angle)};
  if (f.attention_scaling != 1.0) {
    t.cos = t.cos * f.attention_scaling;
    t.sin = t.sin * f.attention_scaling;
  }
  return t;
}

RopeTables sequence_rope_tables(const RopeFrequencies& f, int64_t start, int64_t tokens,
                                DType dtype, const Device& device) {
  if (start < 0 || tokens < 0)
    detail::bad_argument(kRopeOp,
                         "positions start .. start + tokens need start >= 0 and tokens "
                         ">= 0, got start " +
                             std::to_string(start) + ", tokens " + std::to_string(tokens));
  const int64_t end = start + tokens;
  const auto tables_to = [&](int64_t length) {
    const Tensor positions = arange(length, {.dtype = DType::i64, .device = device});
    return rope_tables(f, reshape(positions, {1, length}), dtype);
  };
  const auto rows = [&](const RopeTables& t) {
    return RopeTables{slice(t.cos, 1, start, end), slice(t.sin, 1, start, end)};
  };
  // Tables a key (frequencies, scaling, dtype, device), the last the
  // longest: a row's values do not depend on the table's length (each
  // element is its own position's product, cos and sin), so shorter runs
  // are its rows. A table grows to twice its length at least, so decoding
  // token by token makes a few, not one a token, and none is ever freed: a
  // captured step may read an older one at every replay. So that they stay
  // small, tables end at kMaxRows positions (a longer run is made for its
  // call, as without them: 16 MiB a key at most for 64 frequencies in f32)
  // and all of them together at kMaxKeptBytes (a model has one or two
  // frequency sets; dynamic scaling makes one a length past
  // max_position_embeddings, which are made for their calls once the
  // bound is reached).
  constexpr int64_t kMaxRows = int64_t{1} << 14;
  constexpr std::size_t kMaxKeptBytes = std::size_t{64} << 20;
  static std::mutex mutex;
  static auto* kept = new std::map<std::string, std::vector<RopeTables>>;  // outlives main's
  static std::size_t kept_bytes = 0;
  std::string key = std::string(dtype_name(dtype)) + "|" + device.str() + "|";
  key.append(reinterpret_cast<const char*>(&f.attention_scaling), sizeof f.attention_scaling);
  key.append(reinterpret_cast<const char*>(f.inv_freq.data()), f.inv_freq.size() * sizeof(float));
  int64_t longest = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = kept->find(key);
    if (it != kept->end()) {
      const RopeTables& last = it->second.back();
      if (last.cos.size(1) >= end) return rows(last);
      longest = last.cos.size(1);
    }
  }
  // Made while the device records a graph, the tables are the graph's
  // memory: used there, not kept.
  if (end > kMaxRows || capturing(device)) return rows(tables_to(end));
  const RopeTables made = tables_to(std::min(kMaxRows, std::max(end, 2 * longest)));
  for (const Tensor* t : {&made.cos, &made.sin})
    if (t->storage()) t->storage()->mark_shared_constant();
  const std::size_t bytes = made.cos.nbytes() + made.sin.nbytes();
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<RopeTables>& list = (*kept)[key];
  // (Another thread may have kept a longer one meanwhile.)
  if (kept_bytes + bytes <= kMaxKeptBytes &&
      (list.empty() || list.back().cos.size(1) < made.cos.size(1))) {
    list.push_back(made);
    kept_bytes += bytes;
  }
  if (list.empty()) kept->erase(key);
  return rows(made);
}

Tensor apply_rope(const Tensor& x, const RopeTables& t) {
  detail::check_floating(kRopeOp, "x", x);
  detail::check_dims(kRopeOp, "x", x, 4, "[batch, tokens, heads, head_dim]");
  const int64_t B = x.size(0), T = x.size(1), D = x.size(3);
  if (D % 2 != 0) detail::bad_argument(kRopeOp, "head_dim must be even, got " + std::to_string(D));
  // Partial rotary: the first 2 x frequencies values of each head rotate,
  // the rest pass through as they are (transformers' cat of the two).
  if (t.cos.defined() && t.cos.dim() == 3 && t.cos.size(2) < D / 2 && t.cos.size(2) > 0) {
    const int64_t rotated = 2 * t.cos.size(2);
    return cat({apply_rope(slice(x, 3, 0, rotated), t), slice(x, 3, rotated, D)}, 3);
  }
  const DType acc = accumulation_dtype(x.dtype());
  for (const Tensor* table : {&t.cos, &t.sin}) {
    const char* name = table == &t.cos ? "cos" : "sin";
    if (!table->defined() || table->dim() != 3 || table->size(1) != T || table->size(2) != D / 2 ||
        (table->size(0) != B && table->size(0) != 1))
      detail::bad_argument(kRopeOp,
                           std::string(name) + " must be [" + std::to_string(B) + " or 1, " +
                               std::to_string(T) + ", " + std::to_string(D / 2) + "], got " +
                               (table->defined() ? shape_str(table->shape()) : "undefined"));
    if (table->dtype() != acc)
      detail::bad_argument(kRopeOp, std::string(name) + " is " + dtype_name(table->dtype()) +
                                        "; x of dtype " + dtype_name(x.dtype()) + " needs " +
                                        dtype_name(acc) + " tables (rope_tables gives them)");
  }
  // A batch's shared tables ([1, T, D / 2]) stay one sequence's: the kernel
  // takes row r's angles from table row r % T.
  const Tensor c = t.cos.contiguous(), s = t.sin.contiguous();
  const int64_t table_rows = c.size(0) * T;
  autograd::Function fn;
  fn.name = kRopeOp;
  const auto rotate = [c, s, table_rows](const Tensor& in, bool inverse) {
    const Tensor xc = in.contiguous();
    const LlmKernelTable& k = llm_kernels_for(kRopeOp, {&xc, &c});
    Tensor out = empty(xc.shape(), {.dtype = xc.dtype(), .device = xc.device()});
    k.rope(xc.dtype(), inverse, xc.raw_data(), c.raw_data(), s.raw_data(), xc.size(0) * xc.size(1),
           table_rows, xc.size(2), xc.size(3), out.raw_data());
    return out;
  };
  fn.forward = [rotate](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{rotate(in[0], false)};
  };
  const DType dt = x.dtype();
  fn.backward = [rotate, dt](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{rotate(g[0].to(dt), true)};
  };
  return autograd::apply(fn, {x})[0];
}

}  // namespace quanta::llm
