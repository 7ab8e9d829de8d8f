#pragma once
// Modules around a frozen NF4 weight: NF4Linear (a Linear whose weight is an
// nf4 buffer), LoRALinear (NF4 base plus trainable low-rank adapters, QLoRA)
// and quantize_nf4(module), which converts a model's Linear layers in place.
#include <memory>
#include <string>
#include <vector>

#include "engine/nn/layers.h"
#include "engine/random/generator.h"
#include "quant/nf4/nf4_format.h"

namespace quanta::quant {

/** y = x W^T + b with W an nf4 buffer "weight" [out, in] (saved in state
 * dicts as its bytes) and a frozen bias parameter "bias". */
class NF4Linear : public Module {
 public:
  /** Quantizes `linear`'s weight with `options`; the bias is copied, frozen. */
  NF4Linear(const Linear& linear, const NF4Options& options = {});
  /** Wraps an nf4 weight [out, in] and an optional f32 bias [out]. */
  NF4Linear(const Tensor& weight_nf4, const Tensor& bias);
  Tensor forward(const Tensor& x) override;
  /** The nf4 weight. */
  const Tensor& weight() const { return weight_; }
  /** Undefined when there is no bias. */
  const Tensor& bias() const { return bias_; }
  int64_t in_features() const { return weight_.size(1); }
  int64_t out_features() const { return weight_.size(0); }

 private:
  Tensor weight_, bias_;
};

/** LoRA options (PEFT's names). */
struct LoRAOptions {
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;
  /** Seed of the adapters' initialisation and dropout streams. */
  uint64_t seed = 0;
};

/** base(x) + (dropout(x) A^T B^T) * alpha / rank: a frozen NF4Linear "base"
 * and trainable adapters "lora_A" [rank, in] (Kaiming-uniform) and "lora_B"
 * [out, rank] (zeros, so training starts from the base model). */
class LoRALinear : public Module {
 public:
  LoRALinear(std::shared_ptr<NF4Linear> base, const LoRAOptions& options = {});
  Tensor forward(const Tensor& x) override;
  /** The f32 weight dequantize(base) + scaling * B A, [out, in]. */
  Tensor merged_weight() const;
  /** A plain Linear holding merged_weight() and the base bias, for export. */
  std::shared_ptr<Linear> merge() const;
  const std::shared_ptr<NF4Linear>& base() const { return base_; }
  const Tensor& lora_A() const { return lora_a_; }
  const Tensor& lora_B() const { return lora_b_; }
  double scaling() const { return scaling_; }

 private:
  std::shared_ptr<NF4Linear> base_;
  Tensor lora_a_, lora_b_;
  double scaling_;
  double dropout_;
  Generator dropout_gen_;
};

/** Which Linear layers quantize_nf4(module) converts: those whose dotted name
 * contains one of `include` (all when empty) and none of `exclude`. */
struct NF4ConvertOptions {
  NF4Options format;
  std::vector<std::string> include;
  std::vector<std::string> exclude;
  /** Wrap each converted layer in a LoRALinear with these options. */
  bool lora = false;
  LoRAOptions lora_options;
};

/** Quantization error of one converted layer. */
struct NF4LayerReport {
  std::string name;
  Shape shape;
  double rmse = 0;
  double max_abs = 0;
  std::size_t bytes_before = 0;
  std::size_t bytes_after = 0;
};

/** True when `name` passes the include / exclude lists (substring match). */
bool name_selected(const std::string& name, const std::vector<std::string>& include,
                   const std::vector<std::string>& exclude);

/** Replaces every selected Linear below `root` by an NF4Linear (or a
 * LoRALinear over one) in place, through Module::replace_module; returns one
 * report per converted layer in traversal order. */
std::vector<NF4LayerReport> quantize_nf4(Module& root, const NF4ConvertOptions& options = {});

/** RMSE and max |difference| between a float weight and its nf4 form. */
NF4LayerReport quantization_error(const Tensor& weight, const Tensor& nf4);

}  // namespace quanta::quant
