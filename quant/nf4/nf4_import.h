#pragma once
// NF4 weights already in a safetensors file, whichever of the three layouts
// holds them: quanta's nf4 dtype, bitsandbytes' QuantState entries or
// torchao's NF4Tensor entries. `quanta quantize` converts them between
// layouts without re-quantizing their codes; finding them is one job, reading
// one (which may fail for that weight alone) is another.
#include <map>
#include <string>
#include <vector>

#include "engine/io/safetensors.h"
#include "quant/nf4/nf4_interop.h"

namespace quanta::quant {

/** Where an NF4 weight lives in a file. */
enum class NF4Layout { quanta, bitsandbytes, torchao };

/** "quanta", "bitsandbytes" or "torchao". */
const char* layout_name(NF4Layout layout);

/** One NF4 weight found in a file: its name, layout, and the file's tensors
 * and metadata keys that hold it (what to copy when it is not converted). */
struct NF4FileWeight {
  std::string name;
  NF4Layout layout = NF4Layout::quanta;
  std::vector<std::string> tensors;
  std::vector<std::string> metadata;
};

/** Every NF4 weight of `file`, by name. Nothing is parsed beyond names and
 * dtypes, so a damaged weight is still found (and then refused by
 * read_nf4_weight). */
std::vector<NF4FileWeight> find_nf4_weights(const io::SafetensorsFile& file);

/** An NF4 weight read from a file. */
struct NF4Weight {
  /** Its codes and scales as bitsandbytes' state at its block size: the
   * stored state for bitsandbytes, f32 scales for quanta (the scales its
   * units hold) and torchao (its reconstructed scalers). */
  BnbNF4State state;
  /** The source's double quantization: bitsandbytes' own flag; torchao
   * always; quanta as `quanta quantize` recorded it in the file's
   * "quanta.nf4" metadata (off when not recorded: its scales are f32). */
  bool double_quant = false;
  /** The f32 values the source dequantizes to (torchao: its own arithmetic). */
  Tensor values;
};

/** Reads `w` from `file`. The block size of a quanta-layout weight is the one
 * recorded in "quanta.nf4" when its units agree with it, else 64. Throws
 * std::invalid_argument naming the weight and what is wrong with it. */
NF4Weight read_nf4_weight(const io::SafetensorsFile& file, const NF4FileWeight& w);

}  // namespace quanta::quant
