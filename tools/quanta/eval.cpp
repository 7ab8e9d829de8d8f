// `quanta eval CHECKPOINT`: test-set metrics of a trained VQ-VAE and a PNG of
// test images above their reconstructions.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>

#include "adapter_flags.h"
#include "commands.h"
#include "data/fashion_mnist.h"
#include "document_flags.h"
#include "engine/precision.h"
#include "flag_checks.h"
#include "llm/data/lm_examples.h"
#include "llm/model/lm_eval.h"
#include "llm/model/model_folder.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/text/tokenizer.h"
#include "precision_flag.h"
#include "train/checkpoint.h"
#include "train/limits.h"
#include "train/lm_task.h"
#include "train/metrics.h"
#include "train/outputs.h"

namespace quanta::cli {
namespace {

struct EvalOptions {
  std::string checkpoint;
  std::string model;      // a language-model folder instead of a checkpoint
  AdapterFlags adapters;  // a PEFT adapter folder over --model
  int64_t seq_len = 0;
  std::string data;
  std::string png;
  int64_t limit = -1;
  int64_t batch_size = 256;
  std::string device = "cpu";
  std::string precision = "f32";
  bool json = false;
  bool completions_only = false;   // --model with JSONL: the completions alone scored
  bool assistant_only = false;     // --model with JSONL: the assistant's turns alone scored
  std::string chat_template_path;  // --model with JSONL: conversations through this template
  DocumentFlags documents;         // --model with a token stream: where documents meet
};

// What --json says of a language-model run before its figures.
nlohmann::ordered_json lm_eval_json(const EvalOptions& o) {
  nlohmann::ordered_json j;
  j["model"] = o.model;
  if (!o.adapters.dir.empty()) j["adapters"] = o.adapters.dir;
  j["data"] = o.data;
  j["seq_len"] = o.seq_len;
  j["precision"] = o.precision;
  if (!o.documents.start.empty()) j["document_start"] = o.documents.start;
  if (!o.documents.end.empty()) j["document_end"] = o.documents.end;
  return j;
}

// A language model's mean token cross-entropy over JSONL examples, each on
// its own (as finetune's --eval-data scores them).
train::LmScore score_jsonl(llm::CausalLM& model, const EvalOptions& o, int64_t* examples) {
  llm::LmExamples data = [&] {
    try {
      return llm::LmExamples::from_file(
          o.data, o.seq_len, model.config().vocab_size,
          {.prompts =
               llm::folder_text_reader(o.model, {.completions_only = o.completions_only,
                                                 .assistant_only = o.assistant_only,
                                                 .chat_template_path = o.chat_template_path})});
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }();
  *examples = data.size();
  return train::score_examples(model, data, o.batch_size);
}

// A language model's mean window cross-entropy and perplexity on a token file.
void run_lm_eval(const EvalOptions& o) {
  if (!o.checkpoint.empty()) throw UsageError("give a CHECKPOINT or --model DIR, not both");
  if (o.data.empty())
    throw UsageError("--model needs --data TOKENS (an llm.c token file, or a .txt)");
  if (o.seq_len == 0) throw UsageError("--model needs --seq-len N");
  if (!o.png.empty() || o.limit >= 0)
    throw UsageError("--png and --limit are for VQ-VAE checkpoints, not --model");
  const bool jsonl = std::filesystem::path(o.data).extension() == ".jsonl";
  if (jsonl && o.documents.any())
    throw UsageError(
        "--document-start / --document-end split token streams; a .jsonl's lines "
        "are examples already");
  if (o.completions_only && !jsonl)
    throw UsageError("--completions-only scores JSONL prompt-completion pairs (--data FILE.jsonl)");
  if (!o.chat_template_path.empty() && !jsonl)
    throw UsageError("--chat-template-path renders JSONL conversations (--data FILE.jsonl)");
  if (o.assistant_only && !jsonl)
    throw UsageError("--assistant-only scores JSONL conversations (--data FILE.jsonl)");
  auto model = llm::load_base_model(o.model, device_flag(o.device));
  // The base quantized as the adapters were trained over it, then the adapters.
  apply_adapter_flags(*model, o.adapters, o.model);
  if (jsonl) {
    int64_t examples = 0;
    const train::LmScore s = score_jsonl(*model, o, &examples);
    if (o.json) {
      nlohmann::ordered_json j = lm_eval_json(o);
      j["completions_only"] = o.completions_only;
      j["assistant_only"] = o.assistant_only;
      j["loss"] = s.loss;
      j["perplexity"] = s.perplexity;
      j["examples"] = examples;
      j["tokens"] = s.tokens;
      std::cout << j.dump() << "\n";
      return;
    }
    std::cout << "loss " << train::fmt_metric(s.loss, 6) << "  perplexity "
              << train::fmt_metric(s.perplexity, 4) << "  (" << examples << " examples, "
              << s.tokens << " scored predictions)\n";
    return;
  }
  const bool text = std::filesystem::path(o.data).extension() == ".txt";
  // Raw text: the whole file through the folder's tokenizer, a BOS first.
  const auto encoded = [&] {
    try {
      return llm::encode_text_file(o.data, o.model);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  };
  if (o.documents.any()) {
    // The windows split into documents: the mean over their predictions.
    const int64_t vocab = model->config().vocab_size;
    if (o.seq_len > model->config().max_position_embeddings)
      throw UsageError("--seq-len " + std::to_string(o.seq_len) +
                       " is over the model's max_position_embeddings " +
                       std::to_string(model->config().max_position_embeddings));
    const llm::DocumentBoundaries documents = document_boundaries(o.documents, o.model);
    llm::LmExamples data = [&] {
      try {
        return text ? llm::LmExamples::from_ids(encoded(), o.data, o.seq_len, vocab, documents)
                    : llm::LmExamples::from_token_file(o.data, o.seq_len, vocab, documents);
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
    }();
    const train::LmScore s = train::score_examples(*model, data, o.batch_size);
    if (o.json) {
      nlohmann::ordered_json j = lm_eval_json(o);
      j["loss"] = s.loss;
      j["perplexity"] = s.perplexity;
      j["windows"] = data.size();
      j["documents"] = data.documents();
      j["tokens"] = s.tokens;
      std::cout << j.dump() << "\n";
      return;
    }
    std::cout << "loss " << train::fmt_metric(s.loss, 6) << "  perplexity "
              << train::fmt_metric(s.perplexity, 4) << "  (" << data.size() << " windows of "
              << o.seq_len << " tokens, " << data.documents() << " documents kept apart, "
              << s.tokens << " predictions)\n";
    return;
  }
  llm::WindowEval r;
  if (text) {
    r = llm::evaluate_windows(*model, encoded(), o.data, o.seq_len, o.batch_size);
  } else {
    const llm::TokenFile tokens(o.data);
    r = llm::evaluate_windows(*model, tokens, o.seq_len, o.batch_size);
  }
  if (o.json) {
    nlohmann::ordered_json j = lm_eval_json(o);
    j["loss"] = r.loss;
    j["perplexity"] = r.perplexity;
    j["windows"] = r.windows;
    j["tokens"] = r.tokens;
    std::cout << j.dump() << "\n";
    return;
  }
  std::cout << "loss " << train::fmt_metric(r.loss, 6) << "  perplexity "
            << train::fmt_metric(r.perplexity, 4) << "  (" << r.windows << " windows of "
            << o.seq_len << " tokens, " << r.tokens << " predictions)\n";
}

void run_eval(const EvalOptions& o) {
  const MixedPrecision precision(o.precision == "bf16");
  if (!o.adapters.dir.empty() && o.model.empty())
    throw UsageError("--adapters goes with --model DIR (the base the adapters were trained on)");
  if (!o.model.empty()) return run_lm_eval(o);
  if (o.checkpoint.empty())
    throw UsageError("give a CHECKPOINT (or --model DIR for a language model)");
  const Device device = device_flag(o.device);
  const train::Checkpoint ck = train::load_checkpoint(o.checkpoint);
  std::unique_ptr<train::VqVae> model = train::restore_model(ck, o.checkpoint);
  model->to(device);  // evaluate() sends each batch where the model is
  // A NaN codebook still gives numbers (NaN, or an argmin over NaN): say so
  // before them, and fail after them.
  const std::string non_finite = train::non_finite_summary(ck, o.checkpoint);
  if (!non_finite.empty())
    std::cerr << "quanta: warning: " << non_finite << "; the metrics below are not meaningful\n";
  const std::string data_dir =
      o.data.empty() ? ck.info.config.value("data", std::string(data::kFashionMnistDir)) : o.data;
  const data::ImageDataset test = data::load_fashion_mnist(data_dir, data::Split::test, o.limit);
  if (test.size() == 0) throw UsageError("--limit 0 leaves no test images");
  const train::EvalResult r = train::evaluate(*model, test.images, o.batch_size);
  const std::string png =
      o.png.empty()
          ? (std::filesystem::path(o.checkpoint).parent_path() / "eval_reconstructions.png")
                .string()
          : o.png;
  const std::string type = ck.info.config["quantizer"].value("type", std::string("?"));
  train::write_reconstructions(png, *model, test.images,
                               "quantizer " + type + ", step " + std::to_string(ck.info.step) +
                                   ", test mse " + train::fmt_metric(r.mse, 5) + " (eval)");
  if (o.json) {
    nlohmann::ordered_json j;
    j["checkpoint"] = o.checkpoint;
    j["step"] = ck.info.step;
    j["quantizer"] = type;
    j["test_samples"] = r.samples;
    j["test_mse"] = r.mse;
    j["psnr"] = r.psnr;
    j["codebook_usage"] = r.usage;  // NaN prints as null
    j["perplexity"] = r.perplexity;
    j["precision"] = o.precision;
    if (!r.per_codebook.empty()) {
      nlohmann::ordered_json names;
      for (const train::CodebookFigures& c : r.per_codebook) names.push_back(c.name);
      j["codebook_names"] = names;
      const nlohmann::json lists = train::per_codebook_fields(r);
      for (const auto& [key, list] : lists.items()) j[key] = list;
    }
    j["reconstructions"] = png;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << o.checkpoint << " (step " << ck.info.step << ", quantizer " << type << ")\n"
              << "test images:     " << r.samples << "\n"
              << "test mse:        " << train::fmt_metric(r.mse, 6) << "\n"
              << "test psnr:       " << train::fmt_metric(r.psnr, 2) << " dB\n"
              << "codebook usage:  " << train::fmt_percent(r.usage) << "\n"
              << "perplexity:      " << train::fmt_metric(r.perplexity, 1) << "\n";
    for (const train::CodebookFigures& c : r.per_codebook)
      std::cout << "  " << c.name << ": usage " << train::fmt_percent(c.usage) << ", perplexity "
                << train::fmt_metric(c.perplexity, 1) << "\n";
    std::cout << "reconstructions: " << png << "\n";
  }
  if (!non_finite.empty())
    throw std::runtime_error(non_finite +
                             ": the model is not usable (retrain, or resume from "
                             "an earlier checkpoint)");
}

}  // namespace

void add_eval(CLI::App& app) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* sub = app.add_subcommand(
      "eval",
      "Test-set reconstruction MSE, codebook usage and perplexity of a checkpoint, "
      "and a PNG of test images above their reconstructions");
  sub->footer(
      "Examples:\n"
      "  quanta eval runs/baseline/checkpoint.safetensors\n"
      "  quanta eval runs/baseline/checkpoint.safetensors --limit 1000 --json\n"
      "  quanta eval ckpt.safetensors --data ~/fashion-mnist --png recon.png\n"
      "  quanta eval --model tests/data/llm/models/llama_gqa --data tokens.bin --seq-len 64");
  sub->add_option("checkpoint", o->checkpoint, "checkpoint.safetensors from quanta train");
  sub->add_option("--model", o->model,
                  "a language-model folder (config.json, safetensors) to score on --data");
  add_adapter_flags(*sub, o->adapters, "--model: ");
  sub->add_option("--seq-len", o->seq_len, "--model: tokens per window")
      ->transform(integer_in(2, 1 << 24));
  sub->add_option("--data", o->data,
                  "Fashion-MNIST folder (default: the one trained on); with --model, an "
                  "llm.c token file, a .txt read through the folder's tokenizer.model or "
                  "tokenizer.json, or a .jsonl of examples as finetune reads them (each "
                  "scored on its own)");
  sub->add_option("--png", o->png,
                  "reconstruction PNG to write (default: eval_reconstructions.png beside "
                  "the checkpoint)");
  sub->add_option("--limit", o->limit, "evaluate on the first N test images only")
      ->transform(integer_in(0, train::kMaxCount));
  add_device_flag(*sub, o->device, "the model and each batch");
  add_precision_flag(*sub, o->precision, "the model's");
  CLI::Option* batch = sub->add_option(
      "--batch-size", o->batch_size, "images (with --model: windows, default 1) per forward pass");
  batch->capture_default_str()->transform(integer_in(1, train::kMaxBatchSize));
  sub->add_flag("--json", o->json, "print one JSON object");
  add_document_flags(*sub, o->documents, "--model: ");
  sub->add_flag("--completions-only", o->completions_only,
                "--model with a .jsonl: score the completions of prompt-completion pairs alone "
                "(as finetune --train-on-completions-only trains them)");
  sub->add_flag("--assistant-only", o->assistant_only,
                "--model with a .jsonl: score the assistant's tokens of conversations alone, "
                "those the chat template's {% generation %} blocks mark (as finetune "
                "--assistant-only-loss trains them)");
  sub->add_option("--chat-template-path", o->chat_template_path,
                  "--model with a .jsonl: render conversations with this chat template (a .jinja "
                  "file, or a model folder's templates) instead of the folder's");
  sub->callback([o, batch] {
    if (!o->model.empty() && batch->count() == 0) o->batch_size = 1;
    run_eval(*o);
  });
}

}  // namespace quanta::cli
