#pragma once
// Fashion-MNIST as the Debian package dataset-fashion-mnist installs it:
// {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz in one folder.
#include <cstdint>
#include <string>

#include "engine/tensor.h"

namespace quanta::data {

/** Where dataset-fashion-mnist puts the files. */
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/** Fashion-MNIST's classes: labels are 0..kClasses - 1. */
inline constexpr int64_t kClasses = 10;

/** Images and their labels. */
struct ImageDataset {
  /** [N, 1, 28, 28] f32 in [0, 1] (pixel / 255). */
  Tensor images;
  /** [N] i64 class labels 0..9. */
  Tensor labels;
  /** The folder the files came from. */
  std::string source;
  int64_t size() const { return images.size(0); }
};

/** Which half of the dataset. */
enum class Split { train, test };

/** Loads the first `limit` samples (all when limit < 0) of `split` from `dir`.
 * A folder without the files is one error that says how to install them
 * (apt-get install dataset-fashion-mnist) or to pass --data DIR; bad files
 * give read_idx's errors; images and labels must agree in count, the
 * images must be 28 x 28, a file of 0 images is an error, and so is a label
 * outside 0..9 (named with its file and image). With a limit, only the
 * samples used are read from the files (read_idx's max_rows). */
ImageDataset load_fashion_mnist(const std::string& dir, Split split, int64_t limit = -1);

}  // namespace quanta::data
