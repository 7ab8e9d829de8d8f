#pragma once
// `quanta finetune --model DIR`'s task: QLoRA on a causal language model
// (llm/qlora) as a task of the training loop (loop.h). The loss of a step is
// the mean cross-entropy over the scored tokens of the whole global batch
// (transformers' normalisation with gradient accumulation), each rank and
// micro-batch contributing its tokens' sum; the evaluation is the same mean
// over --eval-data; a checkpoint keeps the adapters and their dropout
// streams, and every checkpoint rewrites the PEFT adapter folder.
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "llm/data/lm_examples.h"
#include "llm/model/causal_lm.h"
#include "llm/qlora/lora_config.h"
#include "train/loop.h"

namespace quanta::train {

/** Mean token cross-entropy and perplexity over examples. */
struct LmScore {
  double loss = 0;
  double perplexity = 0;
  int64_t tokens = 0;  // scored predictions
};

/** Scores every example of `data` with `model` (no gradient, eval mode
 * restored to what it was), `rows` examples per forward. */
LmScore score_examples(llm::CausalLM& model, const llm::LmExamples& data, int64_t rows);

class LmFinetuneTask : public LoopTask {
 public:
  using Describe = std::function<void(std::ostream& log, int64_t start_step, int64_t total_steps)>;
  /** `model` already converted (apply_qlora) and on its device; `eval`
   * optional. The adapter folder is written to `adapters_dir` (rank 0) with
   * `lora` and `quantization`. */
  LmFinetuneTask(std::shared_ptr<llm::CausalLM> model, llm::LmExamples train,
                 std::optional<llm::LmExamples> eval, int64_t eval_rows, std::string adapters_dir,
                 llm::LoraSettings lora, llm::BaseQuantization quantization, Describe describe);

  std::shared_ptr<Module> model() override { return model_; }
  void describe(std::ostream& log, int64_t start_step, int64_t total_steps) const override {
    describe_(log, start_step, total_steps);
  }
  /** The batch on the host: ids, labels, positions (packed data and
   * windows split into documents only) and
   * the loss's weight (f64 0-d), absent when nothing is scored. */
  std::vector<Tensor> step_inputs(const BatchShare& share) override;
  bool capturable_step() const override { return true; }
  StepLoss step(const BatchShare& share) override;
  Evaluation evaluate() override;
  void write_outputs(const std::vector<nlohmann::json>& history, bool evaluated) override;
  StateDict state() override;
  void load_state(const StateDict& state) override;
  nlohmann::json extra_state() const override;
  void load_extra_state(const nlohmann::json& rng) override;

  int64_t examples() const { return train_.size(); }
  const llm::LmExamples& train_data() const { return train_; }
  /** The last evaluation (nullopt before any, or without --eval-data). */
  const std::optional<LmScore>& last_score() const { return last_score_; }

 private:
  std::shared_ptr<llm::CausalLM> model_;
  llm::LmExamples train_;
  std::optional<llm::LmExamples> eval_;
  int64_t eval_rows_;
  std::string adapters_dir_;
  llm::LoraSettings lora_;
  llm::BaseQuantization quantization_;
  Describe describe_;
  std::optional<LmScore> last_score_;
};

}  // namespace quanta::train
