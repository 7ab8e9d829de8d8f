// The language models' device seam (llm/kernels/table.h): every table has
// every entry, the CUDA one is the module's where it can be had, and the
// stand-in's entries fail naming their op and why.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "engine/cuda/module.h"
#include "llm/kernels/table.h"

using namespace quanta;
using namespace quanta::llm;

namespace {

std::vector<std::string> null_entries(const LlmKernelTable& t) {
  std::vector<std::string> out;
#define QUANTA_NULL_ENTRY(entry) \
  if (t.entry == nullptr) out.push_back(#entry);
  QUANTA_LLM_KERNEL_ENTRIES(QUANTA_NULL_ENTRY)
#undef QUANTA_NULL_ENTRY
  return out;
}

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("llm kernels: the CPU, sim and CUDA tables have every entry") {
  CHECK(null_entries(llm_kernels(Device::cpu())).empty());
  CHECK(std::string(llm_kernels(Device::cpu()).device_name) == "cpu");
  CHECK(null_entries(llm_kernels(Device::sim(0))).empty());
  CHECK(std::string(llm_kernels(Device::sim(0)).device_name) == "sim");
  const LlmKernelTable& cuda = llm_cuda::table();
  CHECK(null_entries(cuda).empty());
  CHECK(std::string(cuda.device_name) == "cuda");
  if (cuda::module())
    CHECK(&cuda != &llm_cuda::unavailable_table());  // the module's own, found by name
  else
    CHECK(&cuda == &llm_cuda::unavailable_table());
}

TEST_CASE("llm kernels: the stand-in CUDA table names the op and why in every entry") {
  const LlmKernelTable& t = llm_cuda::unavailable_table();
  float f[4] = {};
  const AttentionArgs args{};
  const std::vector<std::pair<std::string, std::string>> calls = {
      {"rms_norm", message_of([&] {
         t.rms_norm(DType::f32, f, f, 1, 1, 1e-6, llm::RmsWeight::rounded_first, f, f);
       })},
      {"rms_norm backward", message_of([&] {
         t.rms_norm_grad(DType::f32, f, f, llm::RmsWeight::rounded_first, f, f, 1, 1, f, f, false);
       })},
      {"gated_act", message_of([&] { t.gated_act(DType::f32, GatedAct::gelu_tanh, f, f, 1, f); })},
      {"gated_act backward",
       message_of([&] { t.gated_act_grad(DType::f32, GatedAct::silu, f, f, f, 1, f, f); })},
      {"rope", message_of([&] { t.rope(DType::f32, false, f, f, f, 1, 1, 1, 2, f); })},
      {"scaled_dot_product_attention", message_of([&] { t.attention(args); })},
      {"scaled_dot_product_attention backward",
       message_of([&] { t.attention_grad(args, f, f, f, f, f); })},
      {"chunked_causal_lm_loss",
       message_of([&] { t.lm_loss_rows(DType::f32, f, nullptr, 1, 1, -100, true, f); })},
  };
  for (const auto& [op, msg] : calls) {
    INFO(msg);
    CHECK(msg.find("[" + op + "] has no CUDA kernel here: ") == 0);
    CHECK(msg.find("move the tensors to cpu") != std::string::npos);
    if (!cuda::module()) CHECK(msg.find(cuda::unavailable_reason()) != std::string::npos);
  }
}
