#include "fast_conv.h"

#include <cstdio>

#include "engine/cuda/runtime.h"
#include "engine/device.h"

namespace quanta::cli {

CLI::Option* add_fast_conv_flag(CLI::App& sub, bool& fast_conv) {
  return sub.add_flag("--fast-conv", fast_conv,
                      "on a GPU, let cuDNN time its convolution algorithms and take the "
                      "fastest, nondeterministic ones included, so results vary in their last "
                      "bits from run to run (off: every run repeats bit for bit); no effect on "
                      "the CPU");
}

void apply_fast_conv(bool fast_conv) {
  if (!fast_conv || cuda_device_count() == 0) return;
  cuda::set_nondeterministic_conv(true);
  std::fprintf(stderr,
               "--fast-conv: cuDNN may choose nondeterministic convolution algorithms; this "
               "run's results will not repeat bit for bit\n");
}

}  // namespace quanta::cli
