#include "dist/optimizer_shards.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "engine/optim/optimizer.h"

namespace quanta::dist {
namespace {

// The group and in-group index of an optimizer state key
// "state.{g}.{i}.{name}", or {-1, -1} for the keys every rank holds alike
// (groups.*, hparams.*).
std::pair<int64_t, int64_t> state_slot(const std::string& key) {
  static const std::string prefix = "state.";
  if (key.compare(0, prefix.size(), prefix) != 0) return {-1, -1};
  const std::size_t g_end = key.find('.', prefix.size());
  const std::size_t i_end = g_end == std::string::npos ? g_end : key.find('.', g_end + 1);
  if (i_end == std::string::npos)
    throw std::invalid_argument("[OptimizerShards] optimizer state key '" + key +
                                "' is not state.{group}.{index}.{name}");
  return {std::stoll(key.substr(prefix.size(), g_end - prefix.size())),
          std::stoll(key.substr(g_end + 1, i_end - g_end - 1))};
}

bool is_step_key(const std::string& key) { return key.ends_with(".step"); }

}  // namespace

int64_t OptimizerShards::state_param(const std::string& key) const {
  const auto [g, i] = state_slot(key);
  if (g < 0) return -1;
  if (g >= static_cast<int64_t>(group_sizes_.size()) ||
      i >= static_cast<int64_t>(group_sizes_[static_cast<std::size_t>(g)]))
    throw std::invalid_argument("[OptimizerShards] optimizer state key '" + key +
                                "' names no parameter of these " +
                                std::to_string(group_sizes_.size()) + " group(s) of " +
                                std::to_string(params_.size()) + " parameters");
  return static_cast<int64_t>(group_first_[static_cast<std::size_t>(g)]) + i;
}

OptimizerShards::OptimizerShards(ProcessGroup& group, std::vector<Tensor> params,
                                 std::vector<std::size_t> group_sizes)
    : group_(group), params_(std::move(params)) {
  if (group_sizes.empty()) group_sizes = {params_.size()};
  std::size_t first = 0;
  for (std::size_t n : group_sizes) {
    group_first_.push_back(first);
    first += n;
  }
  if (first != params_.size())
    throw std::invalid_argument("[OptimizerShards] the groups hold " + std::to_string(first) +
                                " parameters, not " + std::to_string(params_.size()));
  group_sizes_ = std::move(group_sizes);
  for (const Tensor& p : params_) total_elements_ += p.numel();
  // Parameter i goes to the rank whose equal share of the elements holds
  // its middle element: contiguous, balanced, the same on every rank.
  const int n = group_.size();
  int64_t before = 0;
  for (const Tensor& p : params_) {
    const int64_t middle = before + p.numel() / 2;
    const int owner = total_elements_ == 0
                          ? 0
                          : static_cast<int>(middle * n / std::max<int64_t>(1, total_elements_));
    owners_.push_back(std::min(owner, n - 1));
    if (owners_.back() == group_.rank()) owned_elements_ += p.numel();
    before += p.numel();
  }
}

int OptimizerShards::owner_of(const Tensor& p) const {
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].is_same(p)) return owners_[i];
  return -1;
}

void OptimizerShards::reduce_gradients_to_owners(DataParallel& dp) const {
  dp.reduce_gradients_to_owners([this](const Tensor& p) { return owner_of(p); });
}

double OptimizerShards::clip_grad_norm_(double max_norm, double norm_type,
                                        bool error_if_nonfinite) {
  NoGradGuard no_grad;
  // [norm, 1] at parameter i's pair from its owner, zeros from the others.
  std::vector<Tensor> mine, measured;
  std::vector<std::size_t> measured_at;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Tensor g = params_[i].grad();
    if (owners_[i] != group_.rank() || !g.defined()) continue;
    mine.push_back(g);
    if (g.numel() > 0) {  // grad_norms skips empty gradients, as clip_grad_norm_
      measured.push_back(g);
      measured_at.push_back(i);
    }
  }
  std::vector<double> pairs(2 * params_.size(), 0.0);
  if (!measured.empty()) {
    const std::vector<double> norms =
        grad_norms(measured, norm_type).to(Device::cpu()).to_vector<double>();
    for (std::size_t k = 0; k < measured_at.size(); ++k) {
      pairs[2 * measured_at[k]] = norms[k];
      pairs[2 * measured_at[k] + 1] = 1.0;
    }
  }
  Tensor all = from_vector(pairs, {static_cast<int64_t>(pairs.size())});
  group_.all_reduce(all, ReduceOp::sum);
  const std::vector<double> summed = all.to_vector<double>();
  std::vector<double> present;
  Device where = Device::cpu();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (summed[2 * i + 1] == 0.0) continue;
    if (present.empty()) where = params_[i].device();
    present.push_back(summed[2 * i]);
  }
  const Tensor norms = from_vector(present, {static_cast<int64_t>(present.size())}).to(where);
  return clip_grads_by_norms(mine, norms, max_norm, norm_type, error_if_nonfinite);
}

void OptimizerShards::drop_unowned_grads() {
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (owners_[i] != group_.rank()) params_[i].set_grad(Tensor());
}

void OptimizerShards::broadcast_updates() {
  NoGradGuard no_grad;
  for (int r = 0; r < group_.size(); ++r) {
    // One flat buffer per dtype of rank r's parameters.
    std::map<DType, std::vector<std::size_t>> by_dtype;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (owners_[i] == r) by_dtype[params_[i].dtype()].push_back(i);
    for (const auto& [dtype, members] : by_dtype) {
      std::vector<Tensor> parts;
      for (std::size_t i : members) parts.push_back(reshape(params_[i].detach(), {-1}));
      Tensor flat = parts.size() == 1 ? parts[0].contiguous().clone() : cat(parts, 0);
      group_.broadcast(flat, r);
      if (r == group_.rank()) continue;
      int64_t at = 0;
      for (std::size_t i : members) {
        const Tensor& p = params_[i];
        copy_(p, reshape(slice(flat, 0, at, at + p.numel()), p.shape()));
        at += p.numel();
      }
    }
  }
}

StateDict OptimizerShards::gather_state(const StateDict& mine) {
  io::TensorMap own;
  for (const auto& [key, value] : mine)
    if (state_param(key) >= 0) own.emplace_back(key, value.detach());
  const std::vector<uint8_t> bytes = io::serialize_safetensors(own);
  const Tensor local = from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, DType::u8,
                                 {.dtype = DType::u8});
  std::vector<int64_t> sizes;
  const Tensor all = group_.all_gather_v(local, &sizes).contiguous();
  // Every rank's per-parameter state, by parameter.
  std::map<int64_t, StateDict> states;
  const auto* data = static_cast<const uint8_t*>(all.raw_data());
  int64_t at = 0;
  for (int r = 0; r < group_.size(); ++r) {
    const std::vector<uint8_t> part(data + at, data + at + sizes[r]);
    at += sizes[r];
    for (auto& [key, value] :
         io::parse_safetensors(part, "the optimizer state of rank " + std::to_string(r)).tensors)
      states[state_param(key)].emplace_back(key, std::move(value));
  }
  StateDict whole;
  for (const auto& [key, value] : mine)
    if (state_param(key) < 0) whole.emplace_back(key, value);
  for (auto& [i, entries] : states) {
    // The step first, as Optimizer::state_dict() gives it.
    for (auto& e : entries)
      if (is_step_key(e.first)) whole.push_back(e);
    for (auto& e : entries)
      if (!is_step_key(e.first)) whole.push_back(e);
  }
  return whole;
}

StateDict OptimizerShards::owned_state(const StateDict& whole) const {
  StateDict out;
  for (const auto& [key, value] : whole) {
    const int64_t i = state_param(key);
    if (i < 0 || owners_[static_cast<std::size_t>(i)] == group_.rank())
      out.emplace_back(key, value);
  }
  return out;
}

}  // namespace quanta::dist
