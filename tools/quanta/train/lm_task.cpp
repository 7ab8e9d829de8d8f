#include "train/lm_task.h"

#include <cmath>
#include <filesystem>
#include <optional>

#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/atomic_file.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"

namespace quanta::train {

using nlohmann::json;

LmScore score_examples(llm::CausalLM& model, const llm::LmExamples& data, int64_t rows) {
  NoGradGuard no_grad;
  EvalModeGuard eval_mode(model);
  double sum = 0;
  int64_t tokens = 0;
  for (int64_t lo = 0; lo < data.size(); lo += rows) {
    const int64_t hi = std::min(data.size(), lo + rows);
    std::vector<int64_t> r;
    for (int64_t i = lo; i < hi; ++i) r.push_back(i);
    const llm::LmBatch b = data.batch(from_vector(r, {hi - lo}), model.device());
    if (b.scored_tokens == 0) continue;
    const Tensor loss =
        model.lm_loss(model.hidden_states(b.ids, nullptr, Tensor(), b.position_ids), b.labels);
    sum += loss.to(Device::cpu()).to(DType::f64).item() * double(b.scored_tokens);
    tokens += b.scored_tokens;
  }
  LmScore s;
  s.tokens = tokens;
  s.loss = tokens ? sum / double(tokens) : NAN;
  s.perplexity = std::exp(s.loss);
  return s;
}

LmFinetuneTask::LmFinetuneTask(std::shared_ptr<llm::CausalLM> model, llm::LmExamples train,
                               std::optional<llm::LmExamples> eval, int64_t eval_rows,
                               std::string adapters_dir, llm::LoraSettings lora,
                               llm::BaseQuantization quantization, Describe describe)
    : model_(std::move(model)),
      train_(std::move(train)),
      eval_(std::move(eval)),
      eval_rows_(eval_rows),
      adapters_dir_(std::move(adapters_dir)),
      lora_(std::move(lora)),
      quantization_(quantization),
      describe_(std::move(describe)) {}

std::vector<Tensor> LmFinetuneTask::step_inputs(const BatchShare& share) {
  const llm::LmBatch b = train_.batch(share.rows, Device::cpu());
  std::vector<Tensor> in = {b.ids, b.labels};
  if (train_.has_position_ids()) in.push_back(b.position_ids);
  // Each token of the global batch weighs the same, whichever rank and
  // micro-batch holds it: this part's mean token loss times its share of
  // the global count, times the world size that DataParallel's average
  // divides by. An input, not a constant of the step, so that a captured
  // step replays with each batch's own weight.
  const int64_t global = train_.scored_tokens(share.batch);
  if (b.scored_tokens > 0 && global > 0)
    in.push_back(scalar(double(b.scored_tokens) / double(global) * double(share.world),
                        {.dtype = DType::f64}));
  // Else no weight: nothing is scored here, and the step (another one) says
  // so by its inputs, which a graph of a scored step never replays.
  return in;
}

StepLoss LmFinetuneTask::step(const BatchShare& share) {
  const std::vector<Tensor>& in = share.inputs;
  const std::size_t weight_at = train_.has_position_ids() ? 3 : 2;
  const Tensor hidden = model_->hidden_states(in.at(0), nullptr, Tensor(),
                                              train_.has_position_ids() ? in.at(2) : Tensor());
  Tensor loss;
  if (in.size() <= weight_at) {
    loss = sum(hidden) * 0.0;  // nothing scored here; the graph still reaches every adapter
  } else {
    loss = model_->lm_loss(hidden, in.at(1));
    loss = loss * in.at(weight_at).to(loss.dtype());
  }
  return {loss.to(DType::f32), {}};
}

Evaluation LmFinetuneTask::evaluate() {
  Evaluation ev;
  if (!eval_) {
    ev.line = "checkpoint and adapters written (no --eval-data to score)";
    return ev;
  }
  const LmScore s = score_examples(*model_, *eval_, eval_rows_);
  last_score_ = s;
  ev.fields = {{"eval_loss", s.loss}, {"eval_perplexity", s.perplexity}, {"eval_tokens", s.tokens}};
  char line[160];
  std::snprintf(line, sizeof line, "eval loss %.5f  perplexity %.3f  (%lld tokens of %s)", s.loss,
                s.perplexity, static_cast<long long>(s.tokens), eval_->path().c_str());
  ev.line = line;
  return ev;
}

void LmFinetuneTask::write_outputs(const std::vector<json>& /*history*/, bool /*evaluated*/) {
  // Written beside the folder and swapped in, so that a kill at any moment
  // leaves the old adapters or the new ones, never one file of each (a
  // leftover staging folder of a killed run is cleared here).
  const std::string staged = adapters_dir_ + ".staged";
  std::filesystem::remove_all(staged);
  llm::save_peft_adapters(*model_, lora_, quantization_, staged);
  io::replace_folder(staged, adapters_dir_, "finetune");
}

StateDict LmFinetuneTask::state() { return trainable_state(*model_); }

void LmFinetuneTask::load_state(const StateDict& state) {
  load_trainable_state(*model_, state, "another --lora-r or --target-modules?");
}

json LmFinetuneTask::extra_state() const {
  return {{"lora_dropout", random_stream_states(*model_)}};
}

void LmFinetuneTask::load_extra_state(const json& rng) {
  load_random_stream_states(*model_, rng.value("lora_dropout", json::object()));
}

}  // namespace quanta::train
