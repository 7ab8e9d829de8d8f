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
#include "quant/nf4/nf4_interop.h"

namespace quanta::quant {

/** y = x W^T + b with a frozen NF4 weight [out, in] and a frozen bias
 * parameter "bias". The weight is the nf4 buffer "weight" (saved in state
 * dicts as its bytes) or, for block 32, bitsandbytes' state as the buffers
 * "weight" (packed codes), "weight_absmax" and with double quant
 * "weight_nested_absmax", "weight_nested_quant_map", "weight_nested_offset".
 * Its values are rounded to the dequant dtype (f32, bf16 or f16) before the
 * product. */
class NF4Linear : public Module {
 public:
  /** Quantizes `linear`'s weight with `options` (its dequant_dtype is the
   * layer's; block 32 keeps bitsandbytes' layout); the bias is copied,
   * frozen. */
  NF4Linear(const Linear& linear, const NF4Options& options = {});
  /** Wraps an nf4 weight [out, in] and an optional f32 bias [out]. */
  NF4Linear(const Tensor& weight_nf4, const Tensor& bias, DType dequant_dtype = DType::f32);
  /** Wraps a weight [out, in] in bitsandbytes' layout (any block size). */
  NF4Linear(const BnbNF4State& weight, const Tensor& bias, DType dequant_dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  /** x W^T without the bias, for x of f32 or f64 (in its dtype). */
  Tensor product(const Tensor& x) const;
  /** The nf4 weight; for a weight in bitsandbytes' layout its packed codes. */
  const Tensor& weight() const { return weight_; }
  /** True when the weight is held in bitsandbytes' layout. */
  bool is_bnb() const { return bnb_block_ > 0; }
  /** The weight in bitsandbytes' layout (its tensors are this layer's
   * buffers); throws for an nf4 dtype weight (see to_bnb). */
  BnbNF4State bnb_weight() const;
  /** Undefined when there is no bias. */
  const Tensor& bias() const { return bias_; }
  /** The dtype the weight is dequantized to: f32, bf16 or f16. */
  DType dequant_dtype() const { return dequant_dtype_; }
  /** The weight as forward multiplies by it, in f32 [out, in]. */
  Tensor dequantized_weight() const;
  /** The weight dequantized to `dtype` (f32, bf16 or f16), in f32. */
  Tensor dequantized_weight(DType dtype) const;
  /** Bytes of the weight's codes and scales as this layer holds them. */
  std::size_t weight_bytes() const;
  int64_t in_features() const { return shape_[1]; }
  int64_t out_features() const { return shape_[0]; }

 protected:
  /** Rebuilds the bitsandbytes layout's scales from the loaded state. */
  void read_host_state() override;

 private:
  void init_nf4(const Tensor& weight, const Tensor& bias);
  void init_bnb(const BnbNF4State& weight, const Tensor& bias);
  void register_bias(const Tensor& bias);
  Tensor apply(const Tensor& x, const Tensor& bias) const;

  Tensor weight_, bias_;
  // bitsandbytes' layout only: scales (or their 8-bit codes) and the
  // double-quantization state; block 0 for an nf4 dtype weight.
  Tensor absmax_, nested_absmax_, nested_quant_map_, nested_offset_;
  // What forward multiplies by: every block's f32 scale, rebuilt from the
  // state on the host when the state is set or loaded, never per forward; a
  // non-persistent buffer, so it moves with the layer and stays out of the
  // state dict. The offset's value is kept on the host for the same reason.
  Tensor scales_;
  float nested_offset_value_ = 0;
  int64_t bnb_block_ = 0, nested_block_ = 256;
  Shape shape_;
  DType dequant_dtype_;
};

/** How a LoRA layer's adapters start (PEFT's init_lora_weights). With the
 * first two B is zero, so training starts from the base model. */
enum class LoRAInit {
  /** A Kaiming-uniform (a = sqrt(5), nn.Linear's), B zero: PEFT's true. */
  kaiming_uniform,
  /** A normal with std 1 / rank, B zero: PEFT's "gaussian". */
  gaussian,
  /** A and B both Kaiming-uniform, so the adapters change the model from the
   * first step: PEFT's false (nn.Linear's own initialisation of both), for
   * tests. */
  both_random,
  /** PEFT's "orthogonal": with Q the QR rotation of a random r x r normal
   * matrix, A = (N_in Q_odd)^T / 10 and B = N_out Q_even / 10 (N normal
   * draws [in, r / 2] and [out, r / 2], Q_odd and Q_even Q's rows 0, 2, ...
   * and 1, 3, ...), so B A = 0 up to rounding while neither factor is zero:
   * both train from the first step. The rank must be even. */
  orthogonal,
};

/** LoRA options (PEFT's LoraConfig: r, lora_alpha, lora_dropout, use_rslora). */
struct LoRAOptions {
  int64_t rank = 8;
  double alpha = 16;
  double dropout = 0;
  /** Scale the adapters' product by alpha / sqrt(rank) (rank-stabilised
   * LoRA) instead of alpha / rank. */
  bool use_rslora = false;
  /** The adapters' dtype, in which their product is computed (PEFT keeps
   * them in f32 over a bf16 model): f32 or f64. */
  DType dtype = DType::f32;
  /** Seed of the adapters' initialisation and dropout streams. */
  uint64_t seed = 0;
  LoRAInit init = LoRAInit::kaiming_uniform;
  /** Names the streams: seed and stream give each layer its own draws
   * ("lora.init" / "lora.dropout" suffixed with it when not empty). */
  std::string stream{};
  /** DoRA (weight-decomposed LoRA, PEFT's use_dora): a trainable magnitude
   * per output row rescales the adapted weight W + s B A to unit rows. */
  bool use_dora = false;
  /** The dtype the frozen weight had before it was quantized (the model's:
   * f32, bf16 or f16). DoRA's row norms, and the frozen product it forms of
   * the dropped input in training, use the weight dequantized to it, as
   * PEFT's dequantization of a bitsandbytes weight gives it (which may
   * differ from the compute dtype the base multiplies in). */
  DType base_dtype = DType::f32;
  /** A trainable bias on the adapters' second factor (PEFT's lora_bias):
   * "lora_B_bias" [out], zero at first, scaled with the product. Not with
   * DoRA (PEFT refuses the two together). */
  bool lora_bias = false;
};

/** base(x) + (dropout(x) A^T B^T + b_B) * scaling, scaling = alpha / rank (or
 * alpha / sqrt(rank)): a frozen NF4Linear "base" and trainable adapters
 * "lora_A" [rank, in] (Kaiming-uniform, PEFT's default) and "lora_B"
 * [out, rank] (zeros, so training starts from the base model), and with
 * lora_bias "lora_B_bias" b_B [out] (zeros; without it b_B = 0). The adapters'
 * product runs in their dtype and is added in the base output's dtype (as
 * PEFT does over a 4-bit base).
 *
 * With DoRA, a third parameter "lora_magnitude_vector" m [out] (initially
 * the rows' norms of W, so training starts from the base model) and, per
 * output row, k = m / ||W + s B A|| (the norm a constant of the backward,
 * as the DoRA paper and PEFT treat it):
 *   y + (k - 1) (y - bias) + k (x A^T B^T) s,   y = base(x),
 * where in training with dropout the middle term's y - bias is the frozen
 * product of the dropped input instead (PEFT's extra product), made as the
 * base makes its own (PEFT makes it in f32 from the dequantized weight: the
 * same arithmetic with f32 compute). The layer equals PEFT's DoRA over a
 * bitsandbytes Linear4bit. */
class LoRALinear : public Module {
 public:
  LoRALinear(std::shared_ptr<NF4Linear> base, const LoRAOptions& options = {});
  Tensor forward(const Tensor& x) override;
  /** The f32 weight base->dequantized_weight() + scaling * B A, [out, in];
   * with DoRA, W + s B A (W dequantized to base_dtype) with its rows scaled
   * by magnitude / weight_norm(). */
  Tensor merged_weight() const;
  /** merged_weight over `base_weight` [out, in] (any float dtype and
   * device) instead of the dequantized base: PEFT's merge over the float
   * model, `base_weight` the weight the base was quantized from. Throws
   * std::invalid_argument naming the shapes when it is not [out, in]. */
  Tensor merged_weight(const Tensor& base_weight) const;
  /** The bias a merged layer holds: the base's, plus scaling * b_B with
   * lora_bias; undefined when the base has none and there is no lora_bias.
   * Throws std::invalid_argument naming the layer's shape for lora_bias over
   * a base without a bias (nowhere to merge it; PEFT refuses it too). */
  Tensor merged_bias() const;
  /** Replaces the adapters' values by a [rank, in] and b [out, rank] (any
   * floating dtype, any device; converted to the adapters'), outside the
   * graph: an initialisation computed elsewhere (loftq_init). With DoRA the
   * magnitude becomes weight_norm() of the new adapters, so the layer still
   * computes base + scaling B A. Throws std::invalid_argument naming the
   * shapes when they differ from the adapters'. */
  void set_adapters(const Tensor& a, const Tensor& b);
  /** Records the factors a start took out of the base (PiSSA and OLoRA:
   * the base holds W - scaling B0 A0), converted to the adapters' dtype and
   * kept on the host, outside the state dict: a save expresses the trained
   * change against the original weight with them (PEFT's conversion to
   * LoRA). Throws std::invalid_argument naming the shapes when they differ
   * from the adapters'. */
  void set_initial_adapters(const Tensor& a, const Tensor& b);
  /** set_initial_adapters' A0 [rank, in] and B0 [out, rank]; undefined when
   * the base is the original weight. */
  const Tensor& initial_lora_A() const { return initial_a_; }
  const Tensor& initial_lora_B() const { return initial_b_; }
  /** A plain Linear holding merged_weight() and merged_bias(), for export. */
  std::shared_ptr<Linear> merge() const;
  const std::shared_ptr<NF4Linear>& base() const { return base_; }
  const Tensor& lora_A() const { return lora_a_; }
  const Tensor& lora_B() const { return lora_b_; }
  /** lora_bias's b_B [out]; undefined without it. */
  const Tensor& lora_B_bias() const { return lora_b_bias_; }
  /** DoRA's magnitude [out]; undefined without DoRA. */
  const Tensor& magnitude() const { return magnitude_; }
  bool use_dora() const { return magnitude_.defined(); }
  /** ||W + s B A|| per output row [out], in the adapters' dtype, outside
   * the graph: what DoRA divides the magnitude by. */
  Tensor weight_norm() const;
  /** With DoRA: keep weight_norm() from the next forward on instead of
   * decoding the weight and taking it each forward (PEFT's DoRA caching):
   * for inference, where A, B and the base stay as they are. A forward after
   * they change divides by the kept, stale norm, so it is off by default;
   * turning it off drops the kept norm. */
  void keep_weight_norm(bool on);
  /** The trained tensors under PEFT's names after the layer's:
   * "lora_A.weight", "lora_B.weight", with lora_bias "lora_B.bias" and with
   * DoRA "lora_magnitude_vector". */
  std::vector<std::pair<std::string, Tensor>> adapter_tensors() const;
  /** adapter_tensors()' names and shapes for a layer over a base [out, in]
   * with `options` (rank, use_dora, lora_bias), before one is made. */
  static std::vector<std::pair<std::string, Shape>> adapter_tensor_shapes(
      int64_t in, int64_t out, const LoRAOptions& options);
  double scaling() const { return scaling_; }
  /** The dtype the base is dequantized to for DoRA and merging (LoRAOptions::base_dtype). */
  DType base_dtype() const { return base_dtype_; }
  /** The stream the adapters' input dropout draws from: a training
   * checkpoint keeps its state so that a resumed run drops the same inputs. */
  Generator& dropout_generator() { return dropout_gen_; }
  std::vector<Generator*> own_random_streams() override { return {&dropout_gen_}; }

 private:
  Tensor forward_dora(const Tensor& x);
  /** W + s B A, W dequantized to base_dtype_, in the adapters' dtype,
   * outside the graph: what DoRA normalises and merges. */
  Tensor adapted_weight() const;
  /** The same over a given W (in base_dtype_ first, as the dequantized one). */
  Tensor adapted_weight(const Tensor& w) const;
  /** w + scaling * B A, [out, in], outside the graph. */
  Tensor plus_delta(const Tensor& w) const;
  /** DoRA's merged weight from the adapted one: its rows scaled by
   * magnitude / their norm, in f32. */
  Tensor dora_merged(const Tensor& adapted) const;

  std::shared_ptr<NF4Linear> base_;
  Tensor lora_a_, lora_b_, lora_b_bias_, magnitude_;
  Tensor initial_a_, initial_b_;  // set_initial_adapters'
  bool keep_norm_ = false;
  Tensor kept_norm_;  // keep_weight_norm's, on the magnitude's device
  DType base_dtype_;
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

/** RMSE and max |difference| between a float weight and its nf4 form
 * dequantized to `dequant_dtype`. */
NF4LayerReport quantization_error(const Tensor& weight, const Tensor& nf4,
                                  DType dequant_dtype = DType::f32);

}  // namespace quanta::quant
