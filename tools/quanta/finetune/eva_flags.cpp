#include "eva_flags.h"

#include <algorithm>
#include <iomanip>
#include <limits>
#include <sstream>

#include "flag_checks.h"
#include "run.h"

namespace quanta::cli {

void add_eva_flags(CLI::App& sub, EvaFlags& flags) {
  sub.add_option("--eva-rho", flags.rho,
                 "--init-lora-weights eva: a layer may take up to round(r x rho) ranks of the "
                 "total (r x the adapted layers); 1 keeps every layer's r (PEFT's rho)")
      ->capture_default_str()
      ->check(number_in(1, 1e6));
  sub.add_option("--eva-tau", flags.tau,
                 "--init-lora-weights eva: a layer's components have converged when each has a "
                 "cosine similarity >= tau to the batch before's (PEFT's tau)")
      ->capture_default_str()
      ->check(number_in(0, 1));
  sub.add_option("--eva-use-label-mask", flags.use_label_mask,
                 "--init-lora-weights eva: true: only the positions whose label is scored "
                 "(not -100) feed the decomposition; false: every token (PEFT's use_label_mask)")
      ->capture_default_str();
  sub.add_flag("--eva-whiten", flags.whiten,
               "--init-lora-weights eva: divide each component by the square root of its "
               "singular value (PEFT's whiten)");
  sub.add_option("--eva-adjust-scaling-factors", flags.adjust_scaling_factors,
                 "--init-lora-weights eva: true: a layer's lora_alpha moves with its new rank, "
                 "keeping alpha / r (PEFT's adjust_scaling_factors)")
      ->capture_default_str();
  sub.add_option("--eva-batch-size", flags.batch_size,
                 "--init-lora-weights eva: rows of --data per batch of the decomposition, read "
                 "in file order and again from the start until it converges (0: --batch-size)")
      ->capture_default_str()
      ->transform(integer_in(0, 1 << 20));
  sub.add_option("--eva-max-forwards", flags.max_forwards,
                 "--init-lora-weights eva: forward passes after which layers that have not "
                 "converged are an error naming them (PEFT loops until they do)")
      ->capture_default_str()
      ->transform(integer_in(2, 1 << 30));
}

llm::EvaConfig eva_config(const EvaFlags& flags) {
  return {.rho = flags.rho,
          .tau = flags.tau,
          .use_label_mask = flags.use_label_mask,
          .whiten = flags.whiten,
          .adjust_scaling_factors = flags.adjust_scaling_factors};
}

nlohmann::json eva_flags_json(const EvaFlags& flags) {
  return {{"rho", flags.rho},
          {"tau", flags.tau},
          {"use_label_mask", flags.use_label_mask},
          {"whiten", flags.whiten},
          {"adjust_scaling_factors", flags.adjust_scaling_factors},
          {"batch_size", flags.batch_size},
          {"max_forwards", flags.max_forwards}};
}

llm::EvaData eva_data(const llm::LmExamples& examples, const EvaFlags& flags, int64_t batch_size,
                      uint64_t seed, const std::string& data_path, std::ostream& log) {
  const int64_t rows = flags.batch_size > 0 ? flags.batch_size : batch_size;
  llm::EvaData data = llm::eva_batches_in_order(examples, rows);
  data.seed = seed;
  data.max_forwards = flags.max_forwards;
  data.on_forward = [&log](int64_t forwards, int64_t converged, int64_t inputs) {
    if (forwards % 10 == 0)
      log << "EVA: " << forwards << " forward passes, " << converged << " of " << inputs
          << " layer inputs converged\n"
          << std::flush;
  };
  log << "EVA: principal components of the adapted layers' inputs over " << data.batches
      << " batches of up to " << rows << " rows of " << data_path
      << ", read until they converge (tau " << flags.tau << "), on the host's cores\n"
      << std::flush;
  return data;
}

std::string eva_summary(const llm::EvaStarts& starts, const llm::LoraSettings& lora,
                        double seconds) {
  int64_t inputs = 0, without = 0, total = 0;
  int64_t least = std::numeric_limits<int64_t>::max(), most = 0;
  for (const llm::EvaLayer& l : starts.layers) {
    inputs += l.input_of.empty();
    without += l.r == 0;
    total += l.r;
    least = std::min(least, l.r);
    most = std::max(most, l.r);
  }
  std::ostringstream os;
  os << "EVA: " << starts.forwards << " forward passes (" << with_commas(uint64_t(starts.positions))
     << " positions), " << inputs << " distinct inputs of " << starts.layers.size()
     << " layers; ranks " << least << "-" << most << " (" << with_commas(uint64_t(total))
     << " in all, as given; rho " << lora.eva_config.rho << "), " << without
     << " layers left without an adapter, " << std::fixed << std::setprecision(1) << seconds
     << " s";
  return os.str();
}

}  // namespace quanta::cli
