#include "precision_flag.h"

namespace quanta::cli {

CLI::Option* add_precision_flag(CLI::App& sub, std::string& precision, const std::string& what) {
  return sub
      .add_option("--precision", precision,
                  "f32, or bf16: " + what +
                      " products multiply bf16-rounded operands with f32 sums where the device "
                      "has bf16 products (weights and results stay f32)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
}

}  // namespace quanta::cli
