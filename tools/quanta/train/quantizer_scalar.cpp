// The scalar family's layers built from a "quantizer" config: FSQ ("fsq"),
// FSP ("fsp"), ResidualFSQ ("rfsq"), LFQ ("lfq") and ResidualLFQ ("rlfq") on [B, D, H, W]
// feature maps (their layers take rank-4 inputs as channel-first feature
// maps), driven by LayerQuantizer. Their codebooks are implicit, so there is
// no state to update after a step.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "quant/scalar/fsp.h"
#include "quant/scalar/fsq.h"
#include "quant/scalar/lfq.h"
#include "quant/scalar/residual_fsq.h"
#include "quant/scalar/residual_lfq.h"
#include "quant/scalar/scalar_option_fields.h"
#include "train/quantizer_adapter.h"

namespace quanta::train::detail {
namespace {

using nlohmann::json;

// Defaults for the options a config leaves out.
const std::vector<int64_t> kLevels = {8, 5, 5, 5};  // 1000 codes of 4 dimensions
constexpr int64_t kRlfqCodebookSize = 512;          // 9 bits per level
// LFQ: one bit per latent channel (no projections, the reference's default),
// at most 16 bits per codebook: 2^16 codes already cost 3x the step time of 2^9
// in the entropy terms (docs/train.md).
constexpr int64_t kLfqMaxBits = 16;
constexpr int64_t kNumQuantizers = 4;

}  // namespace

std::unique_ptr<TrainQuantizer> make_scalar_family(const std::string& type, QuantizerOptions& c,
                                                   int64_t dim, uint64_t seed) {
  Generator gen = layer_generator(seed);
  if (type == "fsq") {
    quant::FSQOptions o;
    o.levels = kLevels;
    o.dim = dim;
    read_options(c, type, o);
    return std::make_unique<LayerQuantizer>(std::make_shared<quant::FSQ>(o, gen), type, dim, seed);
  }
  if (type == "fsp") {
    quant::FSPOptions o;
    o.levels = kLevels;
    o.dim = dim;
    read_options(c, type, o);
    return std::make_unique<LayerQuantizer>(std::make_shared<quant::FSP>(o, gen), type, dim, seed);
  }
  if (type == "lfq") {
    quant::LFQOptions o;
    o.dim = dim;
    o.num_codebooks = option_int(c, "num_codebooks", 1);
    const int64_t bits = std::clamp<int64_t>(dim / o.num_codebooks, 1, kLfqMaxBits);
    o.codebook_size = int64_t{1} << bits;
    read_options(c, type, o);
    return std::make_unique<LayerQuantizer>(std::make_shared<quant::LFQ>(o, gen), type, dim, seed);
  }
  if (type == "rfsq") {
    quant::ResidualFSQOptions o;
    o.fsq.levels = kLevels;
    o.fsq.dim = dim;
    o.num_quantizers = kNumQuantizers;
    read_options(c, type, o);
    return std::make_unique<LayerQuantizer>(std::make_shared<quant::ResidualFSQ>(o, gen), type, dim,
                                            seed);
  }
  if (type == "rlfq") {
    quant::ResidualLFQOptions o;
    o.lfq.dim = dim;
    o.lfq.codebook_size = kRlfqCodebookSize;
    o.num_quantizers = kNumQuantizers;
    read_options(c, type, o);
    return std::make_unique<LayerQuantizer>(std::make_shared<quant::ResidualLFQ>(o, gen), type, dim,
                                            seed);
  }
  return nullptr;
}

}  // namespace quanta::train::detail
