#include "quant/vq/random_projection_quantizer.h"

#include <stdexcept>
#include <string>

#include "engine/factory.h"
#include "engine/nn/init.h"
#include "engine/ops/linalg.h"
#include "engine/ops/norm.h"
#include "engine/ops/view.h"
#include "engine/precision.h"

namespace quanta::quant {

RandomProjectionQuantizer::RandomProjectionQuantizer(const RandomProjectionQuantizerOptions& opts,
                                                     Generator& gen)
    : Module("RandomProjectionQuantizer"), opts_(opts) {
  if (opts_.dim <= 0 || opts_.codebook_dim <= 0 || opts_.num_codebooks <= 0)
    throw std::invalid_argument(
        "[RandomProjectionQuantizer] dim, codebook_dim and num_codebooks must be positive");
  Tensor p = empty({opts_.num_codebooks, opts_.dim, opts_.codebook_dim});
  init::xavier_normal_(p, gen);
  projs_ = register_buffer("rand_projs", p);
  VectorQuantizeOptions vo = opts_.vq;
  vo.dim = opts_.codebook_dim * opts_.num_codebooks;
  vo.heads = opts_.num_codebooks;
  vo.codebook_size = opts_.codebook_size;
  // Each head's vector is codebook_dim wide: no projection inside the VQ.
  vo.codebook_dim = opts_.codebook_dim;
  vo.use_cosine_sim = true;
  vo.separate_codebook_per_head = true;
  vq_ = register_module("vq", std::make_shared<VectorQuantize>(vo, gen));
}

QuantizeOutput RandomProjectionQuantizer::forward(const Tensor& x, const Tensor& indices) {
  const MixedPrecision f32_math(false);  // quantizer math stays f32 (engine/precision.h)
  if (x.dim() != 3 || x.size(-1) != opts_.dim)
    throw std::invalid_argument("[RandomProjectionQuantizer] expects x [B, N, " +
                                std::to_string(opts_.dim) + "], got " + shape_str(x.shape()));
  const int64_t b = x.size(0), n = x.size(1), h = opts_.num_codebooks, e = opts_.codebook_dim;
  Tensor t = opts_.norm ? layer_norm(x, {opts_.dim}) : x;
  // 'b n d, h d e -> b n (h e)': one GEMM against the heads side by side.
  const Tensor side = reshape(permute(projs_, {1, 0, 2}), {opts_.dim, h * e});
  const Tensor proj = reshape(matmul(reshape(t, {b * n, opts_.dim}), side), {b, n, h * e});
  vq_->eval();
  if (indices.defined()) return vq_->forward_with_indices(proj, indices);
  QuantizeOutput out = vq_->forward(proj);
  if (h == 1) out.indices = unsqueeze(out.indices, -1);
  return out;
}

}  // namespace quanta::quant
