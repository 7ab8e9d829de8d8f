#pragma once
// RandomProjectionQuantizer (BEST-RQ, Chiu et al. 2022): a frozen random
// projection and a frozen cosine codebook turn inputs into target indices for
// self-supervised training. As vector-quantize-pytorch 1.31.0.
#include <cstdint>
#include <memory>

#include "engine/nn/module.h"
#include "engine/random/generator.h"
#include "quant/quantize_output.h"
#include "quant/vq/vector_quantize.h"

namespace quanta::quant {

struct RandomProjectionQuantizerOptions {
  int64_t dim = 0;
  int64_t codebook_size = 0;
  int64_t codebook_dim = 0;
  int64_t num_codebooks = 1;
  /** LayerNorm (no affine) before the projection. */
  bool norm = true;
  /** Other options of the inner VectorQuantize (dim, heads, codebook_size,
   * codebook_dim, use_cosine_sim and separate_codebook_per_head are set). */
  VectorQuantizeOptions vq;
};

class RandomProjectionQuantizer : public Module {
 public:
  /** Buffer "rand_projs" [num_codebooks, dim, codebook_dim] (xavier normal)
   * and the inner "vq" (cosine, one codebook per head), drawn from `gen`. */
  RandomProjectionQuantizer(const RandomProjectionQuantizerOptions& opts, Generator& gen);
  /** Indices [B, N, num_codebooks] of x [B, N, dim]; the inner VQ always runs
   * in eval mode, so nothing trains. With `indices` given, loss is the cross
   * entropy of the cosine similarities against them. */
  QuantizeOutput forward(const Tensor& x, const Tensor& indices = Tensor());
  VectorQuantize& vq() { return *vq_; }

 private:
  RandomProjectionQuantizerOptions opts_;
  Tensor projs_;
  std::shared_ptr<VectorQuantize> vq_;
};

}  // namespace quanta::quant
