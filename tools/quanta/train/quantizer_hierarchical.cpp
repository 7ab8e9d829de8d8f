// HierarchicalVQ ("hvq", vector-quantize-pytorch 1.32's VAR-style multi-scale
// residual quantization) behind TrainQuantizer. Its levels quantize the latent
// at their own resolutions (1 x 1 up to the latent's 7 x 7), so the adapter
// shows each level's code map on the latent's grid: indices [B, H, W, levels]
// ([B, H, W] for one level), level l's code of cell (r, c) written at every
// position (i, j) that nearest resizing maps to it (r = floor(i h_l / H),
// c = floor(j w_l / W)). Decode and the usage metrics read each cell back at
// the first position it covers, so decode is exact and a level's codes count
// once per token of the level, not once per position they cover.
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/factory.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/view.h"
#include "quant/hierarchical/hierarchical_vq.h"
#include "quant/vq/vq_option_fields.h"
#include "train/quantizer_adapter.h"
#include "train/vqvae.h"

namespace quanta::train::detail {
namespace {

// Defaults for the options a config leaves out (the reference has none for
// scales): sides doubling up to the latent's 7. On this model they reconstruct
// better than 1,2,3,4,5,7 with fewer tokens (docs/train.md, "Recipes").
constexpr int64_t kCodebookSize = 512;
const std::vector<int64_t> kScales = {1, 2, 4, 7};

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("[quantizer hvq] " + what);
}

class HierarchicalQuantizer final : public SyncedQuantizer {
 public:
  HierarchicalQuantizer(std::shared_ptr<quant::HierarchicalVQ> layer, int64_t dim,
                        int64_t codebook_size)
      : layer_(std::move(layer)), dim_(dim), codebook_size_(codebook_size) {
    pin_streams();
  }

  quant::QuantizeOutput forward(const Tensor& z) override {
    check_features(z, "hvq", dim_);
    const int64_t h = z.size(2), w = z.size(3);
    check_grid(h, w);
    quant::QuantizeOutput out = layer_->forward(z);
    const std::vector<Tensor> levels = layer_->split_indices(out.indices.to(DType::i64));
    std::vector<Tensor> maps;  // per level [B, H, W]
    for (int64_t l = 0; l < num_codebooks(); ++l) {
      const Tensor cells = flatten(levels[static_cast<size_t>(l)], 1, -1);  // [B, h_l w_l]
      const Tensor grid = index_select(cells, 1, positions(l, h, w, false, z.device()));
      maps.push_back(reshape(grid, {z.size(0), h, w}));
    }
    // One level has no trailing dimension, as every single codebook.
    out.indices = maps.size() == 1 ? maps[0] : stack(maps, 3);
    return out;
  }

  Tensor decode(const Tensor& indices) override {
    const Tensor idx = indices.to(DType::i64);
    return layer_->get_output_from_indices(cat(level_tokens(idx), 1), {idx.size(1), idx.size(2)});
  }

  /** Each level's codes [B, h_l w_l], read at the first position of each cell. */
  std::vector<Tensor> codes_per_codebook(const Tensor& indices) const override {
    return level_tokens(indices);
  }

  int64_t codebook_size() const override { return codebook_size_; }
  int64_t num_codebooks() const override { return layer_->num_levels(); }
  std::string codebook_name(int64_t i) const override { return "level " + std::to_string(i); }
  std::shared_ptr<Module> module() override { return layer_; }

 private:
  // Every level must fit the grid: each cell covers at least one position.
  void check_grid(int64_t h, int64_t w) const {
    const std::vector<int64_t>& last = layer_->level_shapes().back();
    if (last[0] > h || last[1] > w)
      fail("scales must not exceed the latent's " + std::to_string(h) + " x " + std::to_string(w) +
           ", got a level of " + std::to_string(last[0]) + " x " + std::to_string(last[1]));
  }

  // Level l on the grid [h, w]: the cell of every position (i W + j -> r w_l
  // + c), or with `firsts` the first position of every cell (r w_l + c ->
  // i W + j, i = ceil(r h / h_l): the smallest i with floor(i h_l / h) = r).
  // Built and uploaded once per grid and device: every forward and decode
  // reads them.
  Tensor positions(int64_t l, int64_t h, int64_t w, bool firsts, Device device) const {
    const auto key = std::make_tuple(l, h, w, firsts, device.str());
    if (auto it = positions_.find(key); it != positions_.end()) return it->second;
    const std::vector<int64_t>& s = layer_->level_shapes()[static_cast<size_t>(l)];
    std::vector<int64_t> p;
    if (firsts) {
      for (int64_t r = 0; r < s[0]; ++r)
        for (int64_t c = 0; c < s[1]; ++c)
          p.push_back((r * h + s[0] - 1) / s[0] * w + (c * w + s[1] - 1) / s[1]);
    } else {
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < w; ++j) p.push_back(i * s[0] / h * s[1] + j * s[1] / w);
    }
    return positions_.emplace(key, from_vector<int64_t>(p).to(device)).first->second;
  }

  // Indices [B, H, W, levels] ([B, H, W] for one level) as forward gives
  // them -> per level [B, h_l w_l].
  std::vector<Tensor> level_tokens(const Tensor& indices) const {
    const bool one = num_codebooks() == 1;
    if (indices.dim() != (one ? 3 : 4) || (!one && indices.size(3) != num_codebooks()))
      fail("expected indices [B, H, W" + (one ? "" : ", " + std::to_string(num_codebooks())) +
           "], got " + shape_str(indices.shape()));
    const int64_t h = indices.size(1), w = indices.size(2);
    check_grid(h, w);
    std::vector<Tensor> tokens;
    for (int64_t l = 0; l < num_codebooks(); ++l) {
      const Tensor grid = flatten(one ? indices : select(indices, 3, l), 1, -1);  // [B, H W]
      tokens.push_back(index_select(grid, 1, positions(l, h, w, true, indices.device())));
    }
    return tokens;
  }

  std::shared_ptr<quant::HierarchicalVQ> layer_;
  mutable std::map<std::tuple<int64_t, int64_t, int64_t, bool, std::string>, Tensor> positions_;
  int64_t dim_ = 0;
  int64_t codebook_size_ = 0;
};

}  // namespace

std::unique_ptr<TrainQuantizer> make_hierarchical(const std::string& type, QuantizerOptions& c,
                                                  int64_t dim, uint64_t seed) {
  if (type != "hvq") return nullptr;
  quant::HierarchicalVQOptions o;
  o.dim = dim;
  o.accept_image_fmap = true;
  // The levels' VectorQuantize options by their table, from the reference
  // HierarchicalVQ's defaults; one codebook size for every level.
  o.layer.codebook_size = kCodebookSize;
  read_options(c, type, o.layer);
  o.layer.update_in_forward = false;  // after_step() reconciles, then applies the statistics
  o.codebook_size = {o.layer.codebook_size};
  for (int64_t side : option_list(c, "scales", kScales)) {
    if (side > kLatentSide)
      fail("scales must be at most the latent's side " + std::to_string(kLatentSide) + ", got " +
           std::to_string(side));
    o.scales.push_back({side});
  }
  o.shared_codebook = option_bool(c, "shared_codebook", o.shared_codebook);
  o.quant_resi = option_number(c, "quant_resi", o.quant_resi);
  o.share_quant_resi = option_int(c, "share_quant_resi", o.share_quant_resi);
  o.nested_dropout = option_number(c, "nested_dropout", o.nested_dropout);
  o.nested_dropout_min_levels =
      option_int(c, "nested_dropout_min_levels", o.nested_dropout_min_levels);
  Generator gen = layer_generator(seed);
  const int64_t size = o.layer.codebook_size;
  return std::make_unique<HierarchicalQuantizer>(
      std::make_shared<quant::HierarchicalVQ>(std::move(o), gen), dim, size);
}

}  // namespace quanta::train::detail
