// `quanta finetune --model DIR --data FILE --out DIR`: QLoRA on a language
// model. The model folder's linear layers but lm_head become frozen NF4
// weights quantized as bitsandbytes does; LoRA adapters (PEFT's) on the
// layers --target-modules names are trained with AdamW on the next-token
// loss of --data, in the training loop of quanta train (progress in tokens/s,
// metrics.jsonl, checkpoints, SIGTERM, --resume, --nproc). --out gets the
// adapters as a PEFT folder (adapters/, rewritten at every checkpoint);
// --merge-to DIR writes the merged model as a Hugging Face folder.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "commands.h"
#include "dist/sharded_units.h"
#include "engine/cpu/parallel.h"
#include "engine/precision.h"
#include "engine/text.h"
#include "eva_flags.h"
#include "graph_flag.h"
#include "llm/data/lm_examples.h"
#include "llm/model/config.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/eva_init.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"
#include "llm/text/chat_template.h"
#include "llm/text/tokenizer.h"
#include "merged_folder.h"
#include "quanta_config.h"
#include "run.h"
#include "train/checkpoint.h"
#include "train/limits.h"
#include "train/lm_task.h"
#include "train/loop.h"
#include "train/outputs.h"

namespace quanta::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

inline constexpr const char* kAdaptersDir = "adapters";
inline constexpr const char* kLmFinetuneFormat = "quanta-lm-finetune-1";

// The settings a language-model fine-tune's checkpoint keeps; what defines
// the run (train::resume_conflict: batch_size, lr, seed, model) may not
// change on --resume, nor the base.
json lm_config_json(const FinetuneOptions& o, int64_t seq_len) {
  return {{"task", "finetune-lm"},
          {"base", fs::absolute(o.model).lexically_normal().string()},
          {"data", o.data},
          {"eval_data", o.eval_data},
          {"steps", o.steps},
          {"batch_size", o.batch_size},
          {"lr", o.lr},
          {"seed", o.seed},
          {"log_every", o.log_every},
          {"precision", o.precision},
          {"model",
           {{"seq_len", seq_len},
            {"lora_r", o.lora_r},
            {"lora_alpha", o.lora_alpha},
            {"lora_dropout", o.lora_dropout},
            {"target_modules", o.target_modules},
            {"use_rslora", o.use_rslora},
            {"pack", o.pack},
            {"train_on_completions_only", o.completions_only},
            {"compute_dtype", o.compute_dtype},
            {"grad_accum", o.grad_accum},
            {"weight_decay", o.weight_decay},
            {"max_grad_norm", o.max_grad_norm},
            {"lr_schedule", o.lr_schedule},
            {"warmup_steps", o.warmup_steps}}}};
}

// The layer choice a checkpoint keeps beside lm_config_json's, only where
// set: a checkpoint written before these flags existed still resumes.
void add_layer_choice(json& model, const FinetuneOptions& o) {
  const std::pair<const char*, const std::string*> texts[] = {
      {"target_modules_regex", &o.target_modules_regex},
      {"exclude_modules", &o.exclude_modules},
      {"exclude_modules_regex", &o.exclude_modules_regex},
      {"layers_to_transform", &o.layers_to_transform},
      {"layers_pattern", &o.layers_pattern},
      {"modules_to_save", &o.modules_to_save}};
  for (const auto& [key, value] : texts)
    if (!value->empty()) model[key] = *value;
  if (o.use_dora) model["use_dora"] = true;
  if (o.warmup_ratio > 0) model["warmup_ratio"] = o.warmup_ratio;
  if (o.neftune_noise_alpha > 0) model["neftune_noise_alpha"] = o.neftune_noise_alpha;
  const FinetuneOptions defaults;
  if (o.adam_beta1 != defaults.adam_beta1) model["adam_beta1"] = o.adam_beta1;
  if (o.adam_beta2 != defaults.adam_beta2) model["adam_beta2"] = o.adam_beta2;
  if (o.adam_epsilon != defaults.adam_epsilon) model["adam_epsilon"] = o.adam_epsilon;
  if (o.init_lora_weights != "true") model["init_lora_weights"] = o.init_lora_weights;
  if (o.init_lora_weights == "eva") model["eva"] = eva_flags_json(o.eva);
  if (o.init_lora_weights == "corda") model["corda"] = corda_flags_json(o.corda);
  if (o.bias != "none") model["bias"] = o.bias;
  if (o.lora_bias) model["lora_bias"] = true;
  if (!o.rank_pattern.empty()) model["rank_pattern"] = o.rank_pattern;
  if (!o.trainable_token_indices.empty())
    model["trainable_token_indices"] = o.trainable_token_indices;
  if (!o.alpha_pattern.empty()) model["alpha_pattern"] = o.alpha_pattern;
  // Not layers, but kept the same way: where documents meet in the data.
  if (o.assistant_only) model["assistant_only_loss"] = true;
  if (!o.chat_template_path.empty()) model["chat_template_path"] = o.chat_template_path;
  if (!o.adapters.dir.empty()) {
    model["adapters"] = fs::absolute(o.adapters.dir).lexically_normal().string();
    if (o.adapters.any_base) model["adapters_any_base"] = true;
  }
  if (!o.documents.start.empty()) model["document_start"] = o.documents.start;
  if (!o.documents.end.empty()) model["document_end"] = o.documents.end;
}

// "PATTERN=VALUE" split at its last '=' (a pattern may hold one, a number
// does not).
std::pair<std::string, std::string> pattern_value(const std::string& text, const char* flag) {
  const std::size_t eq = text.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == text.size())
    throw std::invalid_argument(std::string(flag) + " \"" + text +
                                "\" is not PATTERN=VALUE (e.g. down_proj=32)");
  return {text.substr(0, eq), text.substr(eq + 1)};
}

// `text` read whole as a T (int64_t: "a whole number", double: "a number"),
// or std::invalid_argument naming `what` and the text.
template <typename T>
T number_of(const std::string& text, const std::string& what) {
  std::size_t used = 0;
  T v = 0;
  try {
    if constexpr (std::is_integral_v<T>)
      v = std::stoll(text, &used);
    else
      v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw std::invalid_argument(what + ": \"" + text + "\" is not a " +
                                (std::is_integral_v<T> ? "whole number" : "number"));
  return v;
}

// The layer choice in one line: "q_proj,v_proj; excluding
// layers.0.mlp.down_proj; layers 0,1; rank_pattern q_proj=2".
std::string layer_choice_text(const llm::LoraSettings& l) {
  std::string s = !l.target_modules_regex.empty() ? "regex " + l.target_modules_regex
                                                  : join_names(l.target_modules, ",");
  if (!l.exclude_modules_regex.empty()) s += "; excluding regex " + l.exclude_modules_regex;
  if (!l.exclude_modules.empty()) s += "; excluding " + join_names(l.exclude_modules, ",");
  if (!l.layers_to_transform.empty()) {
    std::vector<std::string> i;
    for (int64_t v : l.layers_to_transform) i.push_back(std::to_string(v));
    s += "; layers " + join_names(i, ",");
  }
  const auto patterns = [&](const char* field, const auto& keys) {
    if (keys.empty()) return;
    std::vector<std::string> kv;
    for (const auto& [key, value] : keys) {
      std::ostringstream v;
      v << value;
      kv.push_back(key + "=" + v.str());
    }
    s += std::string("; ") + field + " " + join_names(kv, ", ");
  };
  patterns("rank_pattern", l.rank_pattern);
  patterns("alpha_pattern", l.alpha_pattern);
  if (!l.modules_to_save.empty()) s += "; modules_to_save " + join_names(l.modules_to_save, ",");
  if (l.bias != llm::TrainedBiases::none)
    s += std::string("; bias ") + llm::trained_biases_name(l.bias);
  if (l.lora_bias) s += "; lora_bias";
  for (const auto& [module, indices] : l.trainable_token_indices) {
    std::vector<std::string> i;
    for (int64_t v : indices) i.push_back(std::to_string(v));
    s += "; trainable tokens " + (module.empty() ? std::string() : module + " ") +
         join_names(i, ",");
  }
  return s;
}

// The flags choosing layers and their ranks, into PEFT's fields.
void read_layer_choice(const FinetuneOptions& o, llm::LoraSettings& l) {
  l.target_modules_regex = o.target_modules_regex;
  l.target_modules = o.target_modules_regex.empty()
                         ? llm::parse_module_names(o.target_modules, "--target-modules")
                         : std::vector<std::string>{};
  if (!o.exclude_modules.empty())
    l.exclude_modules = llm::parse_module_names(o.exclude_modules, "--exclude-modules");
  l.exclude_modules_regex = o.exclude_modules_regex;
  if (!o.layers_to_transform.empty())
    for (const std::string& i :
         llm::parse_module_names(o.layers_to_transform, "--layers-to-transform"))
      l.layers_to_transform.push_back(number_of<int64_t>(i, "--layers-to-transform"));
  if (!o.layers_pattern.empty())
    l.layers_pattern = llm::parse_module_names(o.layers_pattern, "--layers-pattern");
  if (!o.modules_to_save.empty())
    l.modules_to_save = llm::parse_module_names(o.modules_to_save, "--modules-to-save");
  for (const std::string& p : o.rank_pattern) {
    const auto [key, value] = pattern_value(p, "--rank-pattern");
    l.rank_pattern.emplace_back(key, number_of<int64_t>(value, "--rank-pattern " + p));
  }
  for (const std::string& p : o.alpha_pattern) {
    const auto [key, value] = pattern_value(p, "--alpha-pattern");
    l.alpha_pattern.emplace_back(key, number_of<double>(value, "--alpha-pattern " + p));
  }
  l.bias = llm::parse_trained_biases(o.bias);
  l.lora_bias = o.lora_bias;
  for (const std::string& t : o.trainable_token_indices) {
    // "2,25,60" (the input embeddings') or "lm_head=5,9".
    const std::size_t eq = t.find('=');
    const std::string module = eq == std::string::npos ? "" : t.substr(0, eq);
    std::vector<int64_t> indices;
    for (const std::string& i : llm::parse_module_names(
             eq == std::string::npos ? t : t.substr(eq + 1), "--trainable-token-indices"))
      indices.push_back(number_of<int64_t>(i, "--trainable-token-indices " + t));
    if (eq != std::string::npos && module.empty())
      throw std::invalid_argument("--trainable-token-indices " + t + " names no module");
    l.trainable_token_indices.emplace_back(module, std::move(indices));
  }
}

// transformers' Trainer decays every trained tensor but biases and norm
// weights (get_decay_parameter_names: names holding "bias", "layernorm",
// "rmsnorm", a "norm" part or a part ending in "_norm"); quanta's tensor
// names are the model's, so the same rule picks the same tensors.
bool trainer_decays(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (lower.find("bias") != std::string::npos || lower.find("layernorm") != std::string::npos ||
      lower.find("rmsnorm") != std::string::npos)
    return false;
  std::size_t start = 0;
  while (start <= lower.size()) {
    const std::size_t dot = std::min(lower.find('.', start), lower.size());
    const std::string part = lower.substr(start, dot - start);
    if (part == "norm" || part.ends_with("_norm")) return false;
    start = dot + 1;
  }
  return true;
}

// The data flags given, for an error about their use: " (--pack)".
std::string data_flags_given(const FinetuneOptions& o) {
  std::string s;
  const auto add = [&](bool given, const char* flag) {
    if (given) s += (s.empty() ? " (" : ", ") + std::string(flag);
  };
  add(o.pack, "--pack");
  add(o.completions_only, "--train-on-completions-only");
  add(o.assistant_only, "--assistant-only-loss");
  add(!o.chat_template_path.empty(), "--chat-template-path");
  add(!o.documents.start.empty(), "--document-start");
  add(!o.documents.end.empty(), "--document-end");
  return s.empty() ? s : s + ")";
}

// --data / --eval-data: a token file, JSONL, or text (.txt) through the
// model folder's tokenizer.
llm::LmExamples read_examples(const std::string& path, const FinetuneOptions& o, int64_t seq_len,
                              int64_t vocab_size, const llm::DocumentBoundaries& documents) {
  const std::string& model_dir = o.model;
  try {
    if (fs::path(path).extension() != ".txt")
      return llm::LmExamples::from_file(
          path, seq_len, vocab_size,
          {.prompts =
               llm::folder_text_reader(model_dir, {.completions_only = o.completions_only,
                                                   .assistant_only = o.assistant_only,
                                                   .chat_template_path = o.chat_template_path}),
           .pack = o.pack,
           .documents = documents});
    if (o.pack || o.completions_only || o.assistant_only)
      throw UsageError(path +
                       " is text, one stream cut into full windows: --pack, "
                       "--train-on-completions-only and --assistant-only-loss are for JSONL "
                       "examples");
    return llm::LmExamples::from_ids(llm::encode_text_file(path, model_dir), path, seq_len,
                                     vocab_size, documents);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(e.what()) + data_flags_given(o));
  }
}

// " (120 examples packed)", " (57 documents kept apart)" or "".
std::string data_layout_text(const llm::LmExamples& d) {
  if (d.packed()) return " (" + std::to_string(d.documents()) + " examples packed)";
  if (d.has_position_ids()) return " (" + std::to_string(d.documents()) + " documents kept apart)";
  return "";
}

std::string score_text(const train::LmScore& s) {
  char line[96];
  std::snprintf(line, sizeof line, "loss %.5f  perplexity %.3f", s.loss, s.perplexity);
  return line;
}

}  // namespace

void add_lm_finetune_flags(CLI::App& sub, FinetuneOptions& o) {
  sub.add_option("--eval-data", o.eval_data,
                 "--model: data scored before, during (--eval-every) and after training");
  sub.add_option("--seq-len", o.seq_len,
                 "--model: tokens per sequence (token files are cut into windows of it; "
                 "min(512, the model's max_position_embeddings) when not given)")
      ->transform(integer_in(2, 1 << 20));
  sub.add_option("--grad-accum", o.grad_accum,
                 "--model: micro-batches per step (each rank's share of the batch split)")
      ->capture_default_str()
      ->transform(integer_in(1, 4096));
  sub.add_option("--lr-schedule", o.lr_schedule, "--model: constant, linear or cosine")
      ->capture_default_str()
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  sub.add_option("--warmup-steps", o.warmup_steps, "--model: steps of linear warmup")
      ->capture_default_str()
      ->transform(integer_in(0, train::kMaxSteps));
  sub.add_option("--warmup-ratio", o.warmup_ratio,
                 "--model: instead of --warmup-steps, warmup as a fraction of the steps, "
                 "rounded up (transformers' warmup_ratio)")
      ->check(number_in(0, 1));
  sub.add_option("--neftune-noise-alpha", o.neftune_noise_alpha,
                 "--model: NEFTune: in training, noise uniform in +-alpha / sqrt(seq_len x "
                 "hidden) added to the input embeddings (transformers' neftune_noise_alpha; "
                 "its paper used 5)")
      ->check(number_in(0, 1e6));
  sub.add_option("--epochs", o.epochs,
                 "--model: instead of --steps, passes over --data, fractions too: "
                 "ceil(epochs x steps per epoch) steps (transformers' num_train_epochs)")
      ->check(number_in(0, double(train::kMaxEpochs), true));
  sub.add_option("--adam-beta1", o.adam_beta1, "--model: AdamW's beta1")
      ->capture_default_str()
      ->check(number_in(0, 1, false, true));
  sub.add_option("--adam-beta2", o.adam_beta2, "--model: AdamW's beta2")
      ->capture_default_str()
      ->check(number_in(0, 1, false, true));
  sub.add_option("--adam-epsilon", o.adam_epsilon,
                 "--model: AdamW's epsilon, added to the root of its second moment")
      ->capture_default_str()
      ->check(number_in(0, 1, true));
  sub.add_option("--weight-decay", o.weight_decay, "--model: AdamW's decoupled weight decay")
      ->capture_default_str()
      ->check(number_in(0, 1));
  sub.add_option("--max-grad-norm", o.max_grad_norm,
                 "--model: clip the adapters' gradient norm to this (0: no clipping)")
      ->capture_default_str()
      ->check(number_in(0, 1e6));
  sub.add_option("--target-modules", o.target_modules,
                 "--model: layers that get adapters, PEFT's target_modules: name suffixes "
                 "(q_proj,v_proj) or all-linear")
      ->capture_default_str();
  sub.add_option("--target-modules-regex", o.target_modules_regex,
                 "--model: instead of --target-modules, a regular expression a layer's full name "
                 "must match entirely (PEFT's target_modules as one string), e.g. "
                 "'.*\\.(q_proj|v_proj)'");
  sub.add_option("--exclude-modules", o.exclude_modules,
                 "--model: layers never adapted, by name suffix or full name "
                 "(model.layers.0.self_attn.q_proj), comma-separated (PEFT's exclude_modules)");
  sub.add_option("--exclude-modules-regex", o.exclude_modules_regex,
                 "--model: ... or by a regular expression matching the full name entirely");
  sub.add_option("--layers-to-transform", o.layers_to_transform,
                 "--model: with --target-modules names, adapt only decoder layers of these "
                 "indexes (0,1,5; PEFT's layers_to_transform)");
  sub.add_option("--layers-pattern", o.layers_pattern,
                 "--model: the name the layer index follows (layers; PEFT's layers_pattern)");
  sub.add_option("--rank-pattern", o.rank_pattern,
                 "--model: PATTERN=R, repeatable: r for the layers whose name ends in a match of "
                 "PATTERN (a regular expression after a dot; the first that matches wins), e.g. "
                 "--rank-pattern down_proj=32 (PEFT's rank_pattern)");
  sub.add_option("--alpha-pattern", o.alpha_pattern,
                 "--model: PATTERN=ALPHA, repeatable: lora_alpha by layer, as --rank-pattern "
                 "(PEFT's alpha_pattern)");
  sub.add_option("--modules-to-save", o.modules_to_save,
                 "--model: modules trained whole beside the adapters and saved with them, by name "
                 "suffix (embed_tokens,lm_head; PEFT's modules_to_save): for new tokens or chat "
                 "templates. Not with tied embeddings");
  sub.add_flag("--use-rslora", o.use_rslora,
               "--model: scale the adapters by alpha / sqrt(r) (rank-stabilised LoRA)");
  sub.add_flag("--use-dora", o.use_dora,
               "--model: DoRA (PEFT's use_dora): train a magnitude per output row beside the "
               "adapters, which set the rows' direction");
  sub.add_option("--init-lora-weights", o.init_lora_weights,
                 "--model: how the adapters start (PEFT's init_lora_weights): true (A "
                 "Kaiming-uniform, B zero), gaussian (A normal, std 1/r), false (A and B both "
                 "random: the model changes from the first step), loftq (B A the best rank-r "
                 "correction of each layer's quantization error, one SVD per adapted layer on the "
                 "host; PEFT's replace_lora_weights_loftq, B A divided by alpha / r so that the "
                 "layer adds exactly the correction), pissa (B A the weight's r principal singular "
                 "triplets, the base their residual quantized: one SVD per layer; pissa_niter_N: "
                 "a randomized SVD with N power iterations, far faster), olora (B A the leading "
                 "columns of the quantized weight's QR, the residual quantized again) or "
                 "orthogonal (A and B random with B A = 0; even r), or eva (A the top principal "
                 "components of each layer's inputs over --data's batches, B zero, the ranks "
                 "redistributed among the layers by explained variance: PEFT's "
                 "initialize_lora_eva_weights; --eva-*), or corda (B A the singular triplets of "
                 "W C, C the covariance of each layer's inputs over --data's first examples, "
                 "the base the residual quantized: PEFT's preprocess_corda; --corda-*). pissa, "
                 "olora and corda adapters "
                 "are saved converted to LoRA of rank 2r over the original base, as PEFT's "
                 "path_initial_model_for_weight_conversion writes them")
      ->capture_default_str()
      ->check([](const std::string& text) {
        llm::LoraSettings scratch;
        try {
          llm::set_lora_init(scratch, text);
        } catch (const std::invalid_argument& e) {
          return std::string(e.what());
        }
        return std::string();
      });
  add_eva_flags(sub, o.eva);
  add_corda_flags(sub, o.corda);
  sub.add_option("--bias", o.bias,
                 "--model: the base's biases that train beside the adapters and are saved with "
                 "them (PEFT's bias): none, all, or lora_only (the adapted layers'); never "
                 "weight-decayed")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "all", "lora_only"}));
  sub.add_option("--trainable-token-indices", o.trainable_token_indices,
                 "--model: token rows trained beside the adapters (PEFT's "
                 "trainable_token_indices), for tokens the base never learned: 2,25,60 (the "
                 "embeddings'; a tied output layer shares them), or repeated MODULE=LIST, "
                 "embed_tokens=2,25 and lm_head=5,9");
  sub.add_flag("--lora-bias", o.lora_bias,
               "--model: a trained bias on each adapter's output (PEFT's lora_bias); not with "
               "--use-dora, and --merge-to needs the adapted layers to have biases");
  sub.add_option("--compute-dtype", o.compute_dtype,
                 "--model: the dtype NF4 weights are dequantized to (bitsandbytes' "
                 "bnb_4bit_compute_dtype): auto (the model's dtype, what bitsandbytes uses "
                 "for f32 and bf16 layers), bfloat16 or float32")
      ->capture_default_str();
  sub.add_flag("--pack", o.pack,
               "--model: pack JSONL examples several to a sequence, each attending only to "
               "itself (positions restart at each), for fewer padding tokens");
  sub.add_flag("--train-on-completions-only", o.completions_only,
               "--model: JSONL lines of prompt and completion (text or ids); only the "
               "completion and its EOS are scored");
  sub.add_flag("--assistant-only-loss", o.assistant_only,
               "--model: JSONL conversations; only the assistant's tokens are scored, those the "
               "chat template's {% generation %} blocks mark (TRL's assistant_only_loss)");
  sub.add_option("--chat-template-path", o.chat_template_path,
                 "--model: render JSONL conversations with this chat template instead of the "
                 "folder's (TRL's chat_template_path): a .jinja file, e.g. one whose assistant "
                 "turns sit in {% generation %} blocks, or a model folder's templates");
  add_no_graph_flag(sub, o.no_graph, "--model: ");
  add_document_flags(sub, o.documents, "--model: ");
  sub.add_flag("--recompute", o.recompute,
               "--model: recompute each decoder layer's activations in the backward (memory of "
               "one layer's activations, about a third more compute, less its down_proj's "
               "product, which the backward does not need again; same results)");
  sub.add_flag("--shard", o.shard,
               "--model with several ranks: each rank keeps 1/N of the NF4 base and gathers a "
               "decoder layer's just before it runs (with --recompute, again in the backward: "
               "the base's memory per rank is then about 1/N), and 1/N of the adapters' "
               "averaged gradients and AdamW state; same results");
  sub.add_option("--eval-every", o.eval_every,
                 "--model: steps between evaluations and checkpoints (0: at the end only)")
      ->capture_default_str()
      ->transform(integer_in(0, train::kMaxSteps));
  add_adapter_flags(sub, o.adapters, "--model: ",
                    " to train on from (PEFT's from_pretrained with is_trainable): its r, "
                    "lora_alpha, target_modules and the rest are the run's, its tensors the "
                    "start; --lora-dropout may change the dropout");
  sub.add_option("--merge-to", o.merge_to,
                 "--model: also write the model with the adapters merged, as a Hugging Face "
                 "folder in the base's dtype");
  add_max_shard_size_flag(sub, o.max_shard_size, "--model: --merge-to's weights");
}

void run_lm_finetune(const FinetuneOptions& flags) {
  FinetuneOptions o = flags;
  if (o.data.empty())
    throw UsageError("--model needs --data FILE (an llm.c token file, or JSONL of input_ids)");
  const llm::DecoderConfig config =
      llm::read_decoder_config((fs::path(o.model) / "config.json").string());
  const int64_t seq_len =
      o.seq_len > 0 ? o.seq_len : std::min<int64_t>(512, config.max_position_embeddings);
  if (seq_len > config.max_position_embeddings)
    throw UsageError("--seq-len " + std::to_string(seq_len) + " is longer than the model's " +
                     "max_position_embeddings " + std::to_string(config.max_position_embeddings));
  llm::QLoRAOptions q;
  const bool from_folder = !o.adapters.dir.empty();
  if (from_folder) {
    // The folder's settings are the run's, recorded in its config as if
    // given: a resume rebuilds the same adapters.
    const llm::AdapterFolderConfig folder =
        llm::read_adapter_folder_config(o.adapters.dir, config.dtype);
    q.lora = folder.lora;
    q.quantization = folder.quantization;
    if (o.lora_dropout < 0) o.lora_dropout = q.lora.lora_dropout;
    o.lora_r = q.lora.r;
    o.lora_alpha = q.lora.lora_alpha;
    o.use_rslora = q.lora.use_rslora;
    o.use_dora = q.lora.use_dora;
    o.target_modules = q.lora.target_modules_regex.empty() ? join_names(q.lora.target_modules, ",")
                                                           : q.lora.target_modules_regex;
  }
  try {
    if (!from_folder) read_layer_choice(o, q.lora);
    q.lora.r = o.lora_r;
    q.lora.lora_alpha = o.lora_alpha;
    q.lora.lora_dropout = o.lora_dropout;
    q.lora.use_rslora = o.use_rslora;
    q.lora.use_dora = o.use_dora;
    // A folder's start is its own (a PiSSA folder's, taken out of the base).
    if (!from_folder) llm::set_lora_init(q.lora, o.init_lora_weights);
    if (q.lora.init_lora_weights == llm::LoraInit::eva && !from_folder)
      q.lora.eva_config = eva_config(o.eva);
    if (q.lora.init_lora_weights == llm::LoraInit::corda && !from_folder)
      q.lora.corda_config = corda_config(o.corda);
    q.lora.base_model_name_or_path = o.model;
    llm::check_lora_settings(q.lora);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--target-modules / --lora-* / the layer choice: ") + e.what());
  }
  // "auto": the folder's, else the model's dtype.
  if (!from_folder || o.compute_dtype != "auto")
    q.quantization.compute_dtype = compute_dtype_flag(o.compute_dtype, config.dtype);
  q.seed = o.seed;
  if (!o.merge_to.empty()) refuse_unmergeable("--merge-to", o.model, o.merge_to);
  if (!o.max_shard_size.empty() && o.merge_to.empty())
    throw UsageError("--max-shard-size goes with --merge-to DIR");
  const llm::SaveOptions merged_save{.max_shard_bytes = max_shard_size_flag(o.max_shard_size)};

  RunSpec spec;
  spec.files = {train::kCheckpointFile, train::kMetricsFile, kAdaptersDir};
  spec.config = lm_config_json(o, seq_len);
  add_layer_choice(spec.config["model"], o);
  spec.inputs = {{"the training data", o.data}};
  if (from_folder) spec.inputs.push_back({"the adapter folder", o.adapters.dir});
  if (!o.eval_data.empty()) spec.inputs.push_back({"the evaluation data", o.eval_data});
  spec.done_marker = std::string(kAdaptersDir) + "/" + llm::kAdapterWeightsFile;
  spec.checkpoint_format = kLmFinetuneFormat;
  std::optional<StartedRun> run = start_finetune_run(o, spec);
  if (!run) return;
  dist::ProcessGroup& group = *run->group;
  const bool lead = group.rank() == 0;
  std::ostream& log = train::lead_log(std::cout, lead);

  const llm::DocumentBoundaries documents = document_boundaries(o.documents, o.model);
  llm::LmExamples train_data = read_examples(o.data, o, seq_len, config.vocab_size, documents);
  std::optional<llm::LmExamples> eval_data;
  if (!o.eval_data.empty())
    eval_data = read_examples(o.eval_data, o, seq_len, config.vocab_size, documents);
  const int64_t steps_per_epoch = (train_data.size() + o.batch_size - 1) / o.batch_size;
  if (o.steps == 0)
    o.steps = o.epochs > 0 ? steps_of_epochs(o.epochs, steps_per_epoch) : steps_per_epoch;
  // transformers' rule: warmup_ratio of the steps, rounded up.
  const int64_t warmup_steps =
      o.warmup_ratio > 0 ? int64_t(std::ceil(o.warmup_ratio * double(o.steps))) : o.warmup_steps;

  // A 4-bit folder's NF4 bases are taken as they are stored.
  if (const std::optional<llm::BaseQuantization> stored = llm::folder_quantization(o.model))
    q.quantization.double_quant = stored->double_quant;
  // A float folder's layer weights stay in their files until apply_qlora
  // quantizes them, one layer at a time on the host: the device never holds
  // the float model (CorDA's passes over it read them all first).
  std::shared_ptr<llm::CausalLM> model = llm::load_base_model(
      o.model, run->device, q.quantization.compute_dtype, {.defer_layer_weights = true});
  // A resumed run's adapters come from its checkpoint: no LoftQ to compute.
  // PiSSA's and OLoRA's starts are taken out of the base, which a resumed
  // run rebuilds the same way.
  const bool loftq = q.lora.init_lora_weights == llm::LoraInit::loftq && !run->resume;
  if (!loftq && q.lora.init_lora_weights == llm::LoraInit::loftq)
    q.lora.init_lora_weights = llm::LoraInit::kaiming_uniform;
  const bool from_base = llm::takes_start_from_base(q.lora.init_lora_weights);
  const bool reports_error = loftq || (from_base && !llm::folder_quantization(o.model));
  const std::string start_name = loftq                                              ? "LoftQ"
                                 : q.lora.init_lora_weights == llm::LoraInit::pissa ? "PiSSA"
                                 : q.lora.init_lora_weights == llm::LoraInit::corda ? "CorDA"
                                                                                    : "OLoRA";
  if (loftq)
    log << "LoftQ: one SVD of each adapted layer's quantization error, on the host's cores "
           "(a 7B Llama's 224 layers: about 2.6 core-hours)\n"
        << std::flush;
  else if (q.lora.init_lora_weights == llm::LoraInit::pissa)
    log << "PiSSA: " << (q.lora.pissa_niter < 0 ? "one SVD" : "one randomized SVD")
        << " of each adapted layer's weight, on the host's cores"
        << (q.lora.pissa_niter < 0 ? " (a 7B Llama's 224 layers: hours; pissa_niter_4 takes "
                                     "seconds a layer)"
                                   : "")
        << "\n"
        << std::flush;
  // The layer choice as given: EVA's start rewrites it as the layers it
  // gives ranks, by name.
  const std::string layer_choice = layer_choice_text(q.lora);
  const bool eva = !from_folder && q.lora.init_lora_weights == llm::LoraInit::eva;
  const bool corda = !from_folder && q.lora.init_lora_weights == llm::LoraInit::corda;
  llm::EvaStarts eva_starts;
  // With --shard, each decoder layer is sharded as soon as it is converted,
  // so that a rank never holds the whole 4-bit base.
  std::shared_ptr<dist::ShardedUnits> shards;
  if (o.shard) {
    shards = std::make_shared<dist::ShardedUnits>(*model, group);
    q.on_layer_converted = [&shards](const std::string& layer) { shards->shard(layer); };
  }
  const auto conversion_start = std::chrono::steady_clock::now();
  const llm::QLoRAReport report =
      from_folder ? apply_adapter_folder(*model, o.adapters, o.model,
                                         {.seed = q.seed,
                                          .lora_dropout = q.lora.lora_dropout,
                                          .compute_dtype = q.quantization.compute_dtype,
                                          .on_layer_converted = q.on_layer_converted})
      : eva       ? llm::apply_qlora_eva(*model, q,
                                         eva_data(train_data, o.eva, o.batch_size, o.seed, o.data, log),
                                         &eva_starts)
      : corda
          ? llm::apply_qlora_corda(*model, q, corda_data(train_data, o.corda, o.data, lead, log))
          : llm::apply_qlora(*model, q);
  const double conversion_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - conversion_start).count();
  model->set_neftune_noise(o.neftune_noise_alpha, o.seed);
  if (!o.merge_to.empty()) {
    try {
      llm::check_qlora_mergeable(*model);
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--lora-bias with --merge-to: ") + e.what());
    }
  }
  model->set_recompute_layers(o.recompute);
  uint64_t before = 0, after = 0;
  int64_t adapted = 0;
  for (const llm::QLoRALayer& l : report.layers) {
    before += l.bytes_before;
    after += l.bytes_after;
    adapted += l.adapted;
  }
  log << "base: " << o.model << " (" << config.model_type << ", " << config.num_hidden_layers
      << " layers, " << with_commas(uint64_t(report.total_parameters)) << " parameters, "
      << llm::torch_dtype_name(config.dtype) << ")\n"
      << "NF4: " << report.layers.size() << " linear layers (all but lm_head), "
      << with_commas(before) << " -> " << with_commas(after)
      << " bytes (block 64, double quant, compute "
      << llm::torch_dtype_name(q.quantization.compute_dtype) << ")\n"
      << "LoRA: r " << o.lora_r << ", alpha " << o.lora_alpha << ", dropout " << o.lora_dropout
      << (o.use_rslora ? ", rslora" : "") << (o.use_dora ? ", DoRA" : "")
      << (o.init_lora_weights != "true" ? ", init " + o.init_lora_weights : std::string())
      << (from_folder ? ", from " + o.adapters.dir : std::string()) << " on " << adapted
      << " layers (" << layer_choice << "): " << with_commas(uint64_t(report.trainable_parameters))
      << " trainable parameters (" << std::fixed << std::setprecision(3)
      << 100.0 * double(report.trainable_parameters) / double(report.total_parameters)
      << std::defaultfloat << std::setprecision(6) << "%"
      << (report.saved_modules.empty()
              ? std::string()
              : ", with " + join_names(report.saved_modules) + " trained whole")
      << ")\n";
  if (eva) log << eva_summary(eva_starts, q.lora, conversion_s) << "\n";
  if (reports_error) {
    double error_before = 0, error_after = 0;
    for (const llm::QLoRALayer& l : report.layers)
      if (l.quantization_error) {
        error_before += l.quantization_error->before;
        error_after += l.quantization_error->after;
      }
    const double change = 100.0 * (1.0 - std::sqrt(error_after / error_before));
    log << start_name << ": the adapted layers' quantization error " << std::setprecision(4)
        << std::sqrt(error_before) << " -> " << std::sqrt(error_after)
        << " (Frobenius norm over all of them, " << std::fixed << std::setprecision(1)
        << std::abs(change) << (change >= 0 ? "% less), " : "% more), ") << conversion_s << " s\n"
        << std::defaultfloat << std::setprecision(6);
  }
  const int64_t eval_rows = o.batch_size;
  // A sharded layer's forward is a collective: every rank evaluates then.
  if ((lead || shards) && eval_data && !run->resume) {
    // In the run's precision, as every evaluation of the loop: comparable.
    const MixedPrecision precision(o.precision == "bf16");
    log << "eval before fine-tuning: "
        << score_text(train::score_examples(*model, *eval_data, eval_rows)) << "\n";
  }

  const std::string adapters_dir = (fs::path(o.out) / kAdaptersDir).string();
  std::ostringstream epochs_text;
  if (o.epochs > 0) epochs_text << " (" << o.epochs << " epochs of " << steps_per_epoch << ")";
  std::ostringstream adam_text;  // AdamW's settings where not PyTorch's defaults
  const FinetuneOptions defaults;
  if (o.adam_beta1 != defaults.adam_beta1 || o.adam_beta2 != defaults.adam_beta2)
    adam_text << "; betas " << o.adam_beta1 << ", " << o.adam_beta2;
  if (o.adam_epsilon != defaults.adam_epsilon) adam_text << "; epsilon " << o.adam_epsilon;
  std::ostringstream neftune_text;
  if (o.neftune_noise_alpha > 0) neftune_text << ", NEFTune alpha " << o.neftune_noise_alpha;
  train::LmFinetuneTask task(
      model, std::move(train_data), std::move(eval_data), eval_rows, adapters_dir, q.lora,
      q.quantization, [&](std::ostream& os, int64_t start, int64_t total) {
        os << "fine-tuning on " << task.examples() << " sequences of up to " << seq_len
           << " tokens from " << o.data << data_layout_text(task.train_data())
           << (o.recompute ? ", layers recomputed in the backward" : "") << ": "
           << (start > 0 ? "resuming at step " + std::to_string(start) + " of " : std::string())
           << total << " steps" << epochs_text.str() << ", global batch " << o.batch_size
           << (o.grad_accum > 1 ? " in " + std::to_string(o.grad_accum) + " micro-batches" : "")
           << ", AdamW lr " << o.lr << " (" << o.lr_schedule << ", warmup " << warmup_steps
           << adam_text.str() << ")" << neftune_text.str() << ", seed " << o.seed << ", "
           << group.size() << (group.size() == 1 ? " rank, " : " ranks, ") << num_threads()
           << " threads each\n"
           << std::flush;
      });

  train::LoopSettings s;
  s.out_dir = o.out;
  s.resume = run->resume;
  s.progress_bar = lead && ::isatty(STDOUT_FILENO) == 1;
  s.examples = task.examples();
  s.batch_size = o.batch_size;
  s.total_steps = o.steps;
  s.seed = o.seed;
  s.log_every = o.log_every;
  s.eval_every = o.eval_every > 0 ? o.eval_every : train::kEvalAtEnd;
  s.lr = o.lr;
  s.mixed_precision = o.precision == "bf16";
  s.graph = !o.no_graph;
  s.profile = o.profile.settings();
  s.optimizer = {.adamw = true,
                 .weight_decay = o.weight_decay,
                 .decays = trainer_decays,
                 .schedule = o.lr_schedule,
                 .warmup_steps = warmup_steps,
                 .betas = {o.adam_beta1, o.adam_beta2},
                 .eps = o.adam_epsilon,
                 .max_grad_norm = o.max_grad_norm,
                 .grad_accum = o.grad_accum};
  if (o.shard) {
    // The decoder layers hold the NF4 bases; frozen state needs no broadcast
    // after the first.
    if (shards)
      s.data_parallel.sharded_units = shards;
    else
      s.data_parallel.shard_units = model->layer_names();
    s.data_parallel.broadcast_buffers = false;
    // And the adapters' averaged gradients and AdamW state: each rank
    // keeps its share.
    s.shard_optimizer_state = true;
  }
  s.throughput_unit = "tokens";
  s.items_per_row = seq_len;
  s.checkpoint_format = kLmFinetuneFormat;
  s.checkpoint_config = spec.config;
  // --steps 0 (one epoch) was resolved from the data just now: the checkpoint
  // records the count, so a restart can tell a complete run from one to resume.
  s.checkpoint_config["steps"] = o.steps;
  // And what an epoch is, so that a restart with --epochs counts its steps.
  s.checkpoint_config["steps_per_epoch"] = steps_per_epoch;
  s.header = {{"quanta_version", QUANTA_VERSION},
              {"config", s.checkpoint_config},
              {"device", run->device.str()}};
  s.activity = "fine-tuning";
  const train::LoopResult r = train::run_loop(task, s, group, std::cout);
  if (r.interrupted || !lead) return;
  if (task.last_score())
    log << "eval after fine-tuning: " << score_text(*task.last_score()) << "\n";
  log << "adapters: " << adapters_dir << " (PEFT: adapter_config.json, " << llm::kAdapterWeightsFile
      << ")\n";
  if (!o.merge_to.empty()) {
    const std::string holds =
        write_merged_folder(*model, o.model, o.merge_to, o.chat_template_path, merged_save);
    log << "merged model: " << o.merge_to << " (" << holds << ")\n";
  }
}

}  // namespace quanta::cli
