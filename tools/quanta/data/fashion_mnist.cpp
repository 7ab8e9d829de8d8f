#include "data/fashion_mnist.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "data/idx.h"
#include "engine/factory.h"

namespace quanta::data {

ImageDataset load_fashion_mnist(const std::string& dir, Split split, int64_t limit) {
  namespace fs = std::filesystem;
  const std::string prefix = split == Split::train ? "train" : "t10k";
  const fs::path images_path = fs::path(dir) / (prefix + "-images-idx3-ubyte.gz");
  const fs::path labels_path = fs::path(dir) / (prefix + "-labels-idx1-ubyte.gz");
  std::error_code ec;
  for (const fs::path& p : {images_path, labels_path})
    if (!fs::exists(p, ec))
      throw std::runtime_error(
          "Fashion-MNIST not found: " + p.string() +
          " is missing (install it with 'apt-get install dataset-fashion-mnist' "
          "or point --data DIR at a folder holding the four .gz files)");

  // With a limit, only the images used are inflated (a 1.4 M-image file
  // needs 1.1 GB for all of them).
  IdxArray images = read_idx(images_path.string(), limit);
  IdxArray labels = read_idx(labels_path.string(), limit);
  if (images.dims.size() != 3 || images.dims[1] != 28 || images.dims[2] != 28)
    throw std::runtime_error(images_path.string() + ": expected images of shape [N, 28, 28]");
  // An empty split would train on nothing or report "test mse n/a" as if
  // the run had been measured.
  if (images.dims[0] == 0)
    throw std::runtime_error(images_path.string() + ": holds no images (the IDX header says 0)");
  if (labels.dims.size() != 1)
    throw std::runtime_error(labels_path.string() + ": expected labels of shape [N]");
  if (labels.dims[0] != images.dims[0])
    throw std::runtime_error(labels_path.string() + ": " + std::to_string(labels.dims[0]) +
                             " labels for " + std::to_string(images.dims[0]) + " images in " +
                             images_path.string());

  const int64_t n = limit < 0 ? images.dims[0] : std::min(limit, images.dims[0]);
  ImageDataset ds;
  ds.source = dir;
  ds.images = empty({n, 1, 28, 28});
  float* px = ds.images.data<float>();
  for (int64_t i = 0; i < n * 28 * 28; ++i) px[i] = images.data[i] / 255.0f;
  ds.labels = empty({n}, {.dtype = DType::i64});
  int64_t* lb = ds.labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    // Found here, the error names the file; found by the loss, it would not.
    if (labels.data[i] >= kClasses)
      throw std::runtime_error(labels_path.string() + ": label " + std::to_string(labels.data[i]) +
                               " of image " + std::to_string(i) + " is not a class 0.." +
                               std::to_string(kClasses - 1));
    lb[i] = labels.data[i];
  }
  return ds;
}

}  // namespace quanta::data
