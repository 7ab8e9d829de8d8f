#include "train/run_folder.h"

#include <filesystem>
#include <stdexcept>

namespace quanta::train {

void refuse_to_replace_run(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& ways_on) {
  std::string found;
  std::error_code ec;
  for (const std::string& f : files)
    if (std::filesystem::exists(std::filesystem::path(dir) / f, ec))
      found += (found.empty() ? "" : ", ") + f;
  if (!found.empty())
    throw std::invalid_argument("--out " + dir + " already holds a run (" + found +
                                "): " + ways_on);
}

}  // namespace quanta::train
