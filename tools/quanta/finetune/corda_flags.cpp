#include "corda_flags.h"

#include <filesystem>

#include "engine/io/safetensors.h"
#include "flag_checks.h"

namespace quanta::cli {

void add_corda_flags(CLI::App& sub, CordaFlags& flags) {
  sub.add_option("--corda-method", flags.method,
                 "--init-lora-weights corda: ipm (the adapters take the largest singular "
                 "triplets of W C, C the covariance of the layer's inputs: fastest fit of the "
                 "task) or kpm (the smallest: the base keeps what it knows of such data); "
                 "PEFT's corda_method")
      ->capture_default_str()
      ->check(CLI::IsMember({"ipm", "kpm"}));
  sub.add_option("--corda-samples", flags.samples,
                 "--init-lora-weights corda: examples of --data, in file order, whose inputs "
                 "make the covariances, one forward pass each (0: all; PEFT's example "
                 "calibrates on 256)")
      ->capture_default_str()
      ->transform(integer_in(0, 1 << 30));
  sub.add_option("--corda-covariance-file", flags.covariance_file,
                 "--init-lora-weights corda: a safetensors file of the covariances (PEFT's "
                 "covariance_file): read instead of --data's samples where it exists, else "
                 "written after them, so that runs with other ranks or methods over the same "
                 "data and model skip the pass");
}

llm::CordaConfig corda_config(const CordaFlags& flags) {
  return {.method = quant::parse_corda_method(flags.method)};
}

nlohmann::json corda_flags_json(const CordaFlags& flags) {
  return {{"method", flags.method},
          {"samples", flags.samples},
          {"covariance_file", flags.covariance_file}};
}

llm::CordaData corda_data(const llm::LmExamples& examples, const CordaFlags& flags,
                          const std::string& data_path, bool lead, std::ostream& log) {
  llm::CordaData data = llm::corda_samples_in_order(examples, flags.samples);
  data.covariance_file = flags.covariance_file;
  data.write_covariance_file = lead;
  if (!flags.covariance_file.empty() && std::filesystem::exists(flags.covariance_file)) {
    const auto metadata = io::read_safetensors_header(flags.covariance_file).metadata;
    const auto samples = metadata.find("samples");
    log << "CorDA: the adapted layers' input covariances from " << flags.covariance_file << " ("
        << (samples == metadata.end() ? std::string("?") : samples->second)
        << " samples; --data is not read for them), then an inverse and an SVD of W C per layer on "
           "the "
           "host's cores ("
        << flags.method << ")\n"
        << std::flush;
    return data;
  }
  data.on_sample = [&log](int64_t done, int64_t samples) {
    if (done % 64 == 0 && done < samples)
      log << "CorDA: " << done << " of " << samples << " samples read\n" << std::flush;
  };
  log << "CorDA: the adapted layers' input covariances over the first " << data.samples
      << " examples of " << data_path
      << " (one forward pass each), then an inverse and an SVD of W C per layer on the host's "
         "cores ("
      << flags.method << ")"
      << (flags.covariance_file.empty() ? ""
                                        : "; the covariances written to " + flags.covariance_file)
      << "\n"
      << std::flush;
  return data;
}

}  // namespace quanta::cli
