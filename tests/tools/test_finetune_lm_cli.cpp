// quanta finetune --model: QLoRA on the tiny model folders (tests/data/llm):
// the loss falls on a learnable token stream, the PEFT folder it writes
// scores what the run reported, --merge-to gives a loadable float model,
// 5 steps + --resume to 10 are the bytes of 10 in one go, JSONL data with
// labels, 2 ranks agree with 1 (sharded too, and across two launchers),
// PEFT's layer choice and modules trained whole, DoRA, training on from a
// PEFT folder (--adapters), and bad input is one line.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_runner.h"
#include "engine/autograd/grad_mode.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "llm/data/lm_examples.h"
#include "llm/data/token_file.h"
#include "llm/model/model_folder.h"
#include "llm/model/weight_names.h"
#include "llm/qlora/bnb_folder.h"
#include "llm/qlora/peft_folder.h"
#include "llm/qlora/qlora_model.h"
#include "llm/text/tokenizer.h"
#include "support/gpu.h"
#include "support/test_data.h"
#include "train/checkpoint.h"
#include "train/lm_task.h"
#include "train/run_folder.h"
#include "two_nodes.h"

using namespace quanta;
using namespace quanta::test;
using nlohmann::json;

namespace {

std::string model(const std::string& name) {
  return quanta::testing::test_data("llm/models/" + name);
}

// A stream a small model learns quickly: steps of 7 modulo 60, one token in
// ten replaced by another.
std::vector<int64_t> learnable_tokens(int64_t n, uint64_t seed) {
  std::vector<int64_t> ids;
  uint64_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    ids.push_back((x >> 33) % 10 == 0 ? int64_t((x >> 40) % 64) : (i * 7) % 60);
  }
  return ids;
}

// `count` JSONL lines of input_ids and labels: example i holds tokens
// [20 i, 20 i + length(i)) of learnable_tokens(20 count, seed), its label k
// ignored (-100) where ignored(i, k).
void write_labelled_jsonl(const std::string& path, uint64_t seed, int count,
                          const std::function<int64_t(int)>& length,
                          const std::function<bool(int, std::size_t)>& ignored) {
  std::ofstream jl(path);
  const std::vector<int64_t> t = learnable_tokens(20 * int64_t(count), seed);
  for (int i = 0; i < count; ++i) {
    const std::vector<int64_t> ids(t.begin() + i * 20, t.begin() + i * 20 + length(i));
    std::vector<int64_t> labels = ids;
    for (std::size_t k = 0; k < labels.size(); ++k)
      if (ignored(i, k)) labels[k] = -100;
    jl << json{{"input_ids", ids}, {"labels", labels}}.dump() << "\n";
  }
}

std::vector<json> records(const std::string& path) {
  std::vector<json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

std::vector<std::string> finetune(const std::string& name, const ScratchDir& d,
                                  const std::string& out, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"finetune",          "--model",     model(name), "--data",
                                   d.file("train.bin"), "--log-every", "5",         "--out",
                                   d.file(out)};
  // These tests' defaults, unless `extra` gives the flag.
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--seq-len", "32"}, {"--batch-size", "4"}, {"--lr", "1e-2"}})
    if (std::find(extra.begin(), extra.end(), flag) == extra.end())
      args.insert(args.end(), {flag, value});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The loss a run's output gives for its evaluation before fine-tuning.
double eval_before(const std::string& out) {
  return std::stod(out.substr(out.find("eval before fine-tuning: loss ") + 30));
}

void check_same_tensors(const std::string& a, const std::string& b) {
  const io::SafetensorsFile x = io::load_safetensors(a), y = io::load_safetensors(b);
  REQUIRE(x.tensors.size() == y.tensors.size());
  for (std::size_t i = 0; i < x.tensors.size(); ++i) {
    CAPTURE(x.tensors[i].first);
    CHECK(x.tensors[i].first == y.tensors[i].first);
    CHECK(x.tensors[i].second.to_vector<float>() == y.tensors[i].second.to_vector<float>());
  }
}

// The adapter folder `out`/adapters read back over the NF4 base, and the
// merged float model in `merged`, score `after`, what the run reported.
void check_scores(const ScratchDir& d, const std::string& base, const std::string& out,
                  double after) {
  const llm::LmExamples eval = llm::LmExamples::from_file(d.file("eval.bin"), 32, 64);
  auto adapted = llm::load_causal_lm(model(base));
  llm::apply_peft_adapters(*adapted, d.file(out + "/adapters"), model(base));
  CHECK(train::score_examples(*adapted, eval, 4).loss == doctest::Approx(after).epsilon(1e-6));
  auto merged = llm::load_causal_lm(d.file("merged"));
  CHECK(train::score_examples(*merged, eval, 4).loss == doctest::Approx(after).epsilon(1e-4));
}

// The flags of a run from start `init` without adapter dropout, added to
// `more` (check_resume_and_sharding's `with`).
std::function<std::vector<std::string>(std::vector<std::string>)> with_init(
    const std::string& init) {
  return [init](std::vector<std::string> more) {
    more.insert(more.end(), {"--init-lora-weights", init, "--lora-dropout", "0"});
    return more;
  };
}

// 3 steps and a resume to 6 are 6 in one go (a constant rate: a decaying one
// follows each run's --steps); on 2 ranks, sharded or not, the same tensors.
// `with` adds the run's own flags. Returns the sharded run's result.
CliResult check_resume_and_sharding(
    const ScratchDir& d, const std::string& base,
    const std::function<std::vector<std::string>(std::vector<std::string>)>& with) {
  REQUIRE(run_quanta(finetune(base, d, "six", with({"--steps", "6", "--lr-schedule", "constant"})))
              .code == 0);
  REQUIRE(run_quanta(finetune(base, d, "part", with({"--steps", "3", "--lr-schedule", "constant"})))
              .code == 0);
  const CliResult resumed = run_quanta(
      finetune(base, d, "part", with({"--steps", "6", "--lr-schedule", "constant", "--resume"})));
  REQUIRE_MESSAGE(resumed.code == 0, resumed.err);
  check_same_tensors(d.file("six/adapters/adapter_model.safetensors"),
                     d.file("part/adapters/adapter_model.safetensors"));
  REQUIRE(run_quanta(finetune(base, d, "two", with({"--steps", "4", "--nproc", "2"}))).code == 0);
  const CliResult sharded =
      run_quanta(finetune(base, d, "sharded", with({"--steps", "4", "--nproc", "2", "--shard"})));
  REQUIRE_MESSAGE(sharded.code == 0, sharded.err);
  check_same_tensors(d.file("two/adapters/adapter_model.safetensors"),
                     d.file("sharded/adapters/adapter_model.safetensors"));
  return sharded;
}

}  // namespace

TEST_CASE(
    "finetune --model: the eval loss falls on every tiny model folder; the PEFT folder "
    "scores what the run reported") {
  ScratchDir d("ft_lm");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(2400, 1), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 2), llm::TokenWidth::u16);
  for (const std::string name :
       {"llama_gqa",       "llama_tied_llama3",   "llama_bf16",        "qwen2_bias",
        "mistral_sharded", "qwen3_qk_norm",       "gemma_geglu",       "gemma2_softcap",
        "mistral_window",  "gemma3_text",         "gemma3_image_text", "phi3_fused",
        "phi3_longrope",   "olmo2_post_norms",    "qwen3_yarn",        "smollm3_nope",
        "olmo3_window",    "granite_multipliers", "ministral_window",  "exaone4_window"}) {
    CAPTURE(name);
    const std::string out = "run_" + name;
    // Granite's scalings (blocks' outputs times 0.22, logits over 4) damp
    // what the adapters change: it learns at a larger rate.
    const std::string lr = name.starts_with("granite") ? "5e-2" : "1e-2";
    const CliResult r = run_quanta(
        finetune(name, d, out, {"--steps", "30", "--eval-data", d.file("eval.bin"), "--lr", lr}));
    REQUIRE_MESSAGE(r.code == 0, r.err);
    // Phi-3's layers have four linear layers (q, k and v fused, gate and up).
    const std::string linear = name.starts_with("phi3") ? "8" : "14";
    CHECK(contains(r.out, "NF4: " + linear + " linear layers (all but lm_head)"));
    CHECK(contains(r.out, "on " + linear + " layers (all-linear)"));
    const std::vector<json> rec = records(d.file(out + "/metrics.jsonl"));
    REQUIRE(rec.size() >= 3);
    CHECK(rec.front()["kind"] == "header");
    CHECK(rec[1].contains("tokens_per_s"));
    CHECK(rec[1]["lr"].get<double>() < std::stod(lr));  // the linear schedule decays it
    const double before =
        std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
    const json& last = rec.back();
    REQUIRE(last["kind"] == "eval");
    MESSAGE(name << ": eval loss " << before << " -> " << last["eval_loss"].get<double>());
    CHECK(last["eval_loss"].get<double>() < 0.8 * before);

    // The adapters as PEFT would load them, over the NF4 base: the same score.
    auto m = llm::load_causal_lm(model(name));
    llm::apply_peft_adapters(*m, d.file(out + "/adapters"), model(name));
    const llm::LmExamples eval = llm::LmExamples::from_file(d.file("eval.bin"), 32, 64);
    const train::LmScore s = train::score_examples(*m, eval, 4);
    CHECK(s.loss == doctest::Approx(last["eval_loss"].get<double>()).epsilon(1e-6));
  }
}

TEST_CASE("finetune --model: --merge-to, JSONL with labels, --grad-accum and --target-modules") {
  ScratchDir d("ft_lm_opts");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 3), llm::TokenWidth::u16);
  write_labelled_jsonl(
      d.file("train.jsonl"), 4, 20, [](int i) { return 10 + i % 7; },
      [](int, std::size_t k) { return k < 4; });  // a prompt
  // Qwen2 with its q, k and v biases; Qwen3 with its per-head q and k norms
  // trained whole beside the adapters; Gemma 2 with its norms after the MLP
  // trained whole (1 + weight, merged as they are); Gemma 3's image-text
  // model; Phi-3's fused q, k and v (merged into the one layer) with
  // Phi-4-mini's RoPE.
  for (const auto& [name, saved] : std::vector<std::pair<std::string, std::string>>{
           {"qwen2_bias", ""},
           {"qwen3_qk_norm", "q_norm,k_norm"},
           {"gemma2_softcap", "pre_feedforward_layernorm,post_feedforward_layernorm"},
           {"gemma3_image_text", ""},
           {"phi3_longrope", ""}}) {
    CAPTURE(name);
    const std::string run = "merged_" + name, merged_dir = d.file("merged_" + name + "_model");
    const bool phi3 = name == "phi3_longrope";
    const std::string targets = phi3 ? "qkv_proj,o_proj" : "q_proj,v_proj";
    std::vector<std::string> flags = {
        "--steps",      "8", "--target-modules", targets,  "--lora-r",       "4", "--use-rslora",
        "--grad-accum", "2", "--lr-schedule",    "cosine", "--warmup-steps", "2", "--merge-to",
        merged_dir};
    if (!saved.empty()) flags.insert(flags.end(), {"--modules-to-save", saved});
    const CliResult merged = run_quanta(finetune(name, d, run, flags));
    REQUIRE_MESSAGE(merged.code == 0, merged.err);
    CHECK(contains(merged.out, "on 4 layers (" + targets));
    CHECK(contains(merged.out, "in 2 micro-batches"));
    std::ifstream cfg(d.file(run + "/adapters/adapter_config.json"));
    const json config = json::parse(cfg);
    CHECK(config["r"] == 4);
    CHECK(config["use_rslora"] == true);
    CHECK(config["target_modules"] ==
          (phi3 ? json({"qkv_proj", "o_proj"}) : json({"q_proj", "v_proj"})));
    auto base = llm::load_causal_lm(model(name));
    auto plain = llm::load_causal_lm(merged_dir);
    CHECK(plain->config().model_type == base->config().model_type);
    // The base's special token ids, which the config quanta writes lacks,
    // are carried over (a class default such as Phi-3's pad id 32000 would
    // otherwise stand in for them).
    {
      std::ifstream a(model(name) + "/config.json"), b(merged_dir + "/config.json");
      const json base_config = json::parse(a), merged_config = json::parse(b);
      const json base_text = base_config.value("text_config", json::object());
      const json merged_text = merged_config.value("text_config", json::object());
      int64_t ids = 0;
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
        for (const auto& [want, got] :
             {std::pair{&base_config, &merged_config}, std::pair{&base_text, &merged_text}}) {
          if (!want->contains(key)) continue;
          ++ids;
          CHECK(got->value(key, json("absent")) == want->at(key));
        }
      CHECK(ids >= 2);
    }
    if (name == "gemma3_image_text") {
      // PEFT is told to leave the vision tower alone; the merged folder
      // carries it as the base stores it.
      CHECK(config["exclude_modules"] == R"(model\.(?:vision_tower|multi_modal_projector)\..*)");
      CHECK(plain->config().image_text_config == base->config().image_text_config);
      const StateDict want = llm::read_non_decoder_weights(base->config(), model(name));
      const StateDict got = llm::read_non_decoder_weights(plain->config(), merged_dir);
      REQUIRE(got.size() == want.size());
      REQUIRE_FALSE(want.empty());
      for (std::size_t i = 0; i < want.size(); ++i) {
        CHECK(got[i].first == want[i].first);
        CHECK(got[i].second.to_vector<float>() == want[i].second.to_vector<float>());
      }
    }
    if (!saved.empty()) {
      const bool qwen3 = name == "qwen3_qk_norm";
      CHECK(config["modules_to_save"] ==
            (qwen3 ? json({"q_norm", "k_norm"})
                   : json({"pre_feedforward_layernorm", "post_feedforward_layernorm"})));
      // The trained norms are the merged model's, and only they moved.
      const StateDict before = base->state_dict(), after = plain->state_dict();
      int64_t moved = 0, others_moved = 0;
      for (std::size_t i = 0; i < before.size(); ++i) {
        const std::string& n = before[i].first;
        const bool trained = qwen3 ? n.find("self_attn.") != std::string::npos &&
                                         n.find("_norm.weight") != std::string::npos
                                   : n.find("feedforward_layernorm.weight") != std::string::npos;
        if (n.find("norm.weight") == std::string::npos) continue;
        const bool changed =
            before[i].second.to_vector<float>() != after[i].second.to_vector<float>();
        (trained ? moved : others_moved) += changed;
      }
      CHECK(moved == 4);
      CHECK(others_moved == 0);
    }
    // The merged folder computes what the adapters over the NF4 base do.
    auto adapted = llm::load_causal_lm(model(name));
    llm::apply_peft_adapters(*adapted, d.file(run + "/adapters"), model(name));
    adapted->eval();  // no adapter dropout
    const Tensor ids = from_vector<int64_t>({3, 10, 17, 24, 31, 38}, {1, 6});
    NoGradGuard no_grad;
    const auto a = adapted->logits(ids).to_vector<float>(),
               b = plain->logits(ids).to_vector<float>();
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, double(std::abs(a[i] - b[i])));
      scale = std::max(scale, double(std::abs(a[i])));
    }
    CHECK(worst < 1e-5 * scale);
    // quanta merge of the run's adapters afterwards writes the same folder,
    // on the CPU and on sim (modules trained whole, the vision tower and the
    // tokenizer files included).
    for (const std::string device : {"cpu", "sim"}) {
      const std::string again = d.file("again_" + name + "_" + device);
      const CliResult m =
          run_quanta({"merge", "--model", model(name), "--adapters", d.file(run + "/adapters"),
                      "--out", again, "--device", device});
      REQUIRE_MESSAGE(m.code == 0, m.err);
      CHECK(contains(m.out, "merged 4 adapted layers of " + d.file(run + "/adapters")));
      for (const char* file : {"config.json", "model.safetensors"})
        CHECK(slurp(again + "/" + file) == slurp(merged_dir + "/" + file));
      CHECK(fs::exists(again + "/tokenizer_config.json") ==
            fs::exists(merged_dir + "/tokenizer_config.json"));
    }
  }

  const CliResult jsonl = run_quanta({"finetune", "--model", model("llama_gqa"), "--data",
                                      d.file("train.jsonl"), "--seq-len", "32", "--batch-size", "5",
                                      "--steps", "6", "--out", d.file("jsonl_run")});
  REQUIRE_MESSAGE(jsonl.code == 0, jsonl.err);
  CHECK(contains(jsonl.out, "fine-tuning on 20 sequences of up to 32 tokens"));
}

// On sim, and on cuda:0 where a GPU is visible.
TEST_CASE("finetune --model --device sim: the captured step replays --no-graph's bytes") {
  // Forward, backward, clipping (max norm 1 by default) and AdamW with a
  // decaying lr in one graph; LoRA dropout drawn by each replay; each
  // batch's loss weight (its share of the scored tokens) an input.
  ScratchDir d("ft_lm_graph");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 5), llm::TokenWidth::u16);
  // Examples of 6 to 15 tokens, the first 3 labels ignored (a prompt);
  // every fourth one has no scored token at all.
  write_labelled_jsonl(
      d.file("train.jsonl"), 6, 24, [](int i) { return 6 + (i * 7) % 10; },
      [](int i, std::size_t k) { return k < 3 || i % 4 == 0; });
  struct Run {
    std::string name;
    std::vector<std::string> flags;
    const char* says;  // what the log says of the graph
    std::string data = "train.bin";
  };
  const std::vector<Run> runs = {
      {"tokens", {"--weight-decay", "0.01"}, "step 3 captured as a graph of "},
      {"recompute", {"--recompute", "--precision", "bf16"}, "step 3 captured as a graph of "},
      // NEFTune's noise drawn by each replay, as dropout's masks.
      {"neftune", {"--neftune-noise-alpha", "5"}, "step 3 captured as a graph of "},
      // Three micro-batches (of 2, 1 and 2 rows) in one graph.
      {"accum", {"--grad-accum", "3", "--batch-size", "5"}, "step 3 captured as a graph of "},
      // Packed: one shape for every batch, each its own loss weight.
      {"packed", {"--pack", "--batch-size", "2"}, "step 3 captured as a graph of ", "train.jsonl"},
      // Unpacked, the batches' lengths differ: three graphs serve one step
      // each, then the steps run as called.
      {"lengths",
       {"--batch-size", "1"},
       "the batches change shape from step to step",
       "train.jsonl"},
  };
  for (const Device device : quanta::testing::test_devices())
    for (Run run : runs) {
      run.name += "_" + std::to_string(static_cast<int>(device.type));
      CAPTURE(run.name);
      std::vector<std::string> flags = run.flags;
      flags.insert(flags.end(), {"--steps", "9", "--device", device.str()});
      auto args = [&](const std::string& out) {
        std::vector<std::string> a = finetune("llama_gqa", d, out, flags);
        a.at(4) = d.file(run.data);  // the value of --data
        a.at(6) = "1";               // of --log-every
        return a;
      };
      const CliResult a = run_quanta(args(run.name + "_graph"));
      flags.push_back("--no-graph");
      const CliResult b = run_quanta(args(run.name + "_eager"));
      REQUIRE_MESSAGE(a.code == 0, a.err);
      REQUIRE_MESSAGE(b.code == 0, b.err);
      CHECK(contains(a.out, run.says));
      CHECK_FALSE(contains(b.out, "captured"));
      if (run.name.rfind("tokens", 0) == 0) {
        // The step's launch budget: 163 kernels and copies on sim when it
        // was set (7 a LoRA layer, the rest norms, attention, the loss,
        // clipping and AdamW), where per-layer scalings, norms, table
        // copies, the loss's fills and copies and clipping's scalar ops had
        // made 247. A new launch a layer fails it.
        const std::size_t at = a.out.find("captured as a graph of ");
        REQUIRE(at != std::string::npos);
        const long nodes = std::stol(a.out.substr(at + 23));
        MESSAGE("the captured QLoRA step holds ", nodes, " kernels and copies");
        CHECK(nodes <= 168);
      }
      const std::vector<json> ra = records(d.file(run.name + "_graph/metrics.jsonl")),
                              rb = records(d.file(run.name + "_eager/metrics.jsonl"));
      CHECK(ra.front()["graph"] == true);
      CHECK(rb.front()["graph"] == false);
      std::vector<std::string> la, lb;
      for (const json& r : ra)
        if (r["kind"] == "train") la.push_back(r["loss"].dump());
      for (const json& r : rb)
        if (r["kind"] == "train") lb.push_back(r["loss"].dump());
      CHECK(la.size() == 9);
      CHECK(la == lb);
      check_same_tensors(d.file(run.name + "_graph/adapters/adapter_model.safetensors"),
                         d.file(run.name + "_eager/adapters/adapter_model.safetensors"));
    }
  // --profile: the steps run as called, each kernel call timed, the
  // language models' seam among the tables; the same bytes as --no-graph.
  {
    const std::string eager = "tokens_" + std::to_string(static_cast<int>(DeviceType::sim));
    std::vector<std::string> a =
        finetune("llama_gqa", d, "profiled",
                 {"--weight-decay", "0.01", "--steps", "9", "--device", "sim", "--profile", "2"});
    a.at(6) = "1";
    const CliResult p = run_quanta(a);
    REQUIRE_MESSAGE(p.code == 0, p.err);
    CHECK(contains(p.out, "profile of steps 3 to 4 (run as called;"));
    CHECK(contains(p.out, "llm.attention"));
    const std::vector<json> r = records(d.file("profiled/metrics.jsonl"));
    CHECK(r.front()["graph"] == false);
    bool attention = false;
    for (const json& rec : r)
      if (rec["kind"] == "profile")
        for (const json& e : rec["entries"])
          attention = attention || (e["name"] == "llm.attention" && e["calls_per_step"] > 0);
    CHECK(attention);
    check_same_tensors(d.file("profiled/adapters/adapter_model.safetensors"),
                       d.file(eager + "_eager/adapters/adapter_model.safetensors"));
  }
  const CliResult classifier =
      run_quanta({"finetune", "checkpoint.safetensors", "--no-graph", "--out", d.file("x")});
  CHECK(contains(classifier.err, "--no-graph is for a language model (--model DIR)"));
}

TEST_CASE(
    "finetune --model: --pack, --train-on-completions-only, and --recompute changes nothing") {
  ScratchDir d("ft_lm_pack");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(400, 8), llm::TokenWidth::u16);
  {
    std::ofstream pairs(d.file("pairs.jsonl")), plain(d.file("plain.jsonl"));
    const std::vector<int64_t> t = learnable_tokens(600, 9);
    for (int i = 0; i < 24; ++i) {
      const auto at = t.begin() + i * 24;
      pairs << json{{"prompt", std::vector<int64_t>(at, at + 3 + i % 4)},
                    {"completion", std::vector<int64_t>(at + 3 + i % 4, at + 9 + i % 5)}}
                   .dump()
            << "\n";
      plain << json{{"input_ids", std::vector<int64_t>(at, at + 8)}}.dump() << "\n";
    }
  }
  const auto run = [&](const std::string& out, std::vector<std::string> more,
                       const std::string& data = "pairs.jsonl") {
    std::vector<std::string> args = {"finetune",
                                     "--model",
                                     model("llama_gqa"),
                                     "--data",
                                     d.file(data),
                                     "--seq-len",
                                     "32",
                                     "--batch-size",
                                     "2",
                                     "--steps",
                                     "6",
                                     "--lora-dropout",
                                     "0.1",
                                     "--out",
                                     d.file(out)};
    args.insert(args.end(), more.begin(), more.end());
    return run_quanta(args);
  };
  const CliResult packed = run("packed", {"--pack", "--train-on-completions-only"});
  REQUIRE_MESSAGE(packed.code == 0, packed.err);
  CHECK(contains(packed.out, "(24 examples packed)"));
  const CliResult again =
      run("recomputed", {"--pack", "--train-on-completions-only", "--recompute"});
  REQUIRE_MESSAGE(again.code == 0, again.err);
  CHECK(contains(again.out, "layers recomputed in the backward"));
  check_same_tensors(d.file("packed/adapters/adapter_model.safetensors"),
                     d.file("recomputed/adapters/adapter_model.safetensors"));

  check_one_line_error(run("o1", {"--pack"}, "train.bin"), 2, "packing is for JSONL examples");
  check_one_line_error(run("o2", {"--train-on-completions-only"}, "plain.jsonl"), 1,
                       "line 1: no prompt and completion");
}

TEST_CASE("finetune --model --document-start: a token file's documents train as packed JSONL") {
  ScratchDir d("ft_lm_documents");
  // 16 documents, each llama_gqa's BOS (1) and then tokens that are never
  // its BOS or EOS (2), in pairs that fill a window of 32 exactly: the token file's windows
  // are then the rows --pack makes of the same documents as JSONL lines.
  const std::vector<int64_t> t = learnable_tokens(600, 11);
  std::vector<int64_t> stream;
  {
    std::ofstream jl(d.file("docs.jsonl"));
    for (int i = 0; i < 16; ++i) {
      const int64_t length = i % 2 == 0 ? 6 + (i * 5) % 19 : 32 - (6 + ((i - 1) * 5) % 19);
      std::vector<int64_t> doc = {1};
      for (int64_t k = 1; k < length; ++k) doc.push_back(std::max<int64_t>(3, t[i * 32 + k]));
      stream.insert(stream.end(), doc.begin(), doc.end());
      jl << json{{"input_ids", doc}}.dump() << "\n";
    }
  }
  REQUIRE(stream.size() == 8 * 32);
  llm::write_token_file(d.file("train.bin"), stream, llm::TokenWidth::u16);
  const std::vector<std::string> common = {"--steps",      "6", "--lora-dropout", "0.1",
                                           "--batch-size", "2"};
  const auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), common.begin(), common.end());
    return more;
  };
  const CliResult split =
      run_quanta(finetune("llama_gqa", d, "split", with({"--document-start", "bos"})));
  REQUIRE_MESSAGE(split.code == 0, split.err);
  CHECK(contains(split.out, "fine-tuning on 8 sequences of up to 32 tokens from " +
                                d.file("train.bin") + " (16 documents kept apart)"));
  std::vector<std::string> packed_args = finetune("llama_gqa", d, "packed", with({"--pack"}));
  packed_args.at(4) = d.file("docs.jsonl");  // the value of --data
  const CliResult packed = run_quanta(packed_args);
  REQUIRE_MESSAGE(packed.code == 0, packed.err);
  CHECK(contains(packed.out, "(16 examples packed)"));
  check_same_tensors(d.file("split/adapters/adapter_model.safetensors"),
                     d.file("packed/adapters/adapter_model.safetensors"));
  // Unsplit, each window's second document attends to its first: other
  // gradients, other adapters.
  const CliResult joined = run_quanta(finetune("llama_gqa", d, "joined", with({})));
  REQUIRE_MESSAGE(joined.code == 0, joined.err);
  const io::SafetensorsFile a = io::load_safetensors(
                                d.file("split/adapters/adapter_model.safetensors")),
                            b = io::load_safetensors(
                                d.file("joined/adapters/adapter_model.safetensors"));
  CHECK(a.tensors.back().second.to_vector<float>() != b.tensors.back().second.to_vector<float>());
  // The checkpoint keeps the boundaries: a resume may not drop them.
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "split",
                                           {"--steps", "8", "--lora-dropout", "0.1", "--batch-size",
                                            "2", "--resume"})),
                       2,
                       "--resume cannot change the run it continues (model.document_start: "
                       "checkpoint \"bos\", now not set)");
  const CliResult resumed =
      run_quanta(finetune("llama_gqa", d, "split",
                          {"--steps", "8", "--lora-dropout", "0.1", "--batch-size", "2", "--resume",
                           "--document-start", "bos"}));
  REQUIRE_MESSAGE(resumed.code == 0, resumed.err);
  CHECK(contains(resumed.out, "resuming at step 6 of 8 steps"));
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o1", with({"--document-end", "eos"}))),
                       1,
                       "train.bin: no token in its 256 windowed tokens marks a document boundary");
  std::vector<std::string> on_jsonl =
      finetune("llama_gqa", d, "o2", with({"--document-start", "bos"}));
  on_jsonl.at(4) = d.file("docs.jsonl");
  check_one_line_error(run_quanta(on_jsonl), 2,
                       "document boundaries are for token streams (--document-start)");
}

TEST_CASE(
    "finetune --model: 5 steps and --resume to 10 are 10 steps in one go, sharded on 2 ranks and "
    "2 nodes too") {
  ScratchDir d("ft_lm_resume");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 5), llm::TokenWidth::u16);
  // A decaying schedule follows each run's --steps, so a run that grows
  // continues on another curve; warmup alone is the same whatever the total.
  const std::vector<std::string> common = {"--lora-dropout", "0.1",      "--grad-accum",   "2",
                                           "--lr-schedule",  "constant", "--warmup-steps", "3"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), common.begin(), common.end());
    return more;
  };
  REQUIRE(run_quanta(finetune("llama_gqa", d, "whole", with({"--steps", "10"}))).code == 0);
  REQUIRE(run_quanta(finetune("llama_gqa", d, "split", with({"--steps", "5"}))).code == 0);
  const CliResult r =
      run_quanta(finetune("llama_gqa", d, "split", with({"--steps", "10", "--resume"})));
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "resuming at step 5 of 10 steps"));
  check_same_tensors(d.file("whole/adapters/adapter_model.safetensors"),
                     d.file("split/adapters/adapter_model.safetensors"));
  check_same_tensors(d.file("whole/checkpoint.safetensors"),
                     d.file("split/checkpoint.safetensors"));
  check_one_line_error(
      run_quanta(
          finetune("llama_gqa", d, "split", with({"--steps", "12", "--resume", "--lora-r", "4"}))),
      2, "--resume cannot change the run it continues (model.lora_r: checkpoint 8, now 4)");
  // A run in --out is not replaced silently.
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "whole", with({"--steps", "10"}))), 2,
                       "--resume");

  // Sharded: 5 steps + --resume to 10 on 2 ranks are the 10 steps of 2
  // unsharded ranks, bit for bit (dropout included), with and without
  // recomputation; the checkpoint is the ordinary one, so a run on another
  // number of ranks, unsharded, resumes it.
  REQUIRE(run_quanta(finetune("llama_gqa", d, "whole2", with({"--steps", "10", "--nproc", "2"})))
              .code == 0);
  REQUIRE(run_quanta(finetune("llama_gqa", d, "sharded",
                              with({"--steps", "5", "--nproc", "2", "--shard", "--recompute"})))
              .code == 0);
  const CliResult s = run_quanta(finetune(
      "llama_gqa", d, "sharded", with({"--steps", "10", "--nproc", "2", "--shard", "--resume"})));
  REQUIRE_MESSAGE(s.code == 0, s.err);
  CHECK(contains(s.out, "resuming at step 5 of 10 steps"));
  check_same_tensors(d.file("whole2/adapters/adapter_model.safetensors"),
                     d.file("sharded/adapters/adapter_model.safetensors"));
  // Each sharded rank kept AdamW state for its share of the adapters only;
  // the checkpoint gathers it into the ordinary layout, the same bytes.
  CHECK(contains(s.out, "optimizer state and gradients sharded: rank 0 keeps them for "));
  check_same_tensors(d.file("whole2/checkpoint.safetensors"),
                     d.file("sharded/checkpoint.safetensors"));
  // The same sharded run as one job of two nodes, a launcher and a rank each
  // (quanta launch --nnodes 2 on loopback): the same adapters.
  std::vector<std::string> program =
      finetune("llama_gqa", d, "nodes", with({"--steps", "10", "--shard", "--recompute"}));
  program.insert(program.begin(), std::getenv("QUANTA_EXE"));
  const TwoNodeJob nodes = launch_two_nodes(program, {1, 1}, 0, /*first=*/1);
  CAPTURE(nodes);
  REQUIRE(nodes.r0.code == 0);
  REQUIRE(nodes.r1.code == 0);
  check_same_tensors(d.file("whole2/adapters/adapter_model.safetensors"),
                     d.file("nodes/adapters/adapter_model.safetensors"));
  const CliResult other = run_quanta(
      finetune("llama_gqa", d, "sharded", with({"--steps", "12", "--nproc", "3", "--resume"})));
  REQUIRE_MESSAGE(other.code == 0, other.err);
  CHECK(contains(other.out, "resuming at step 10 of 12 steps"));
}

TEST_CASE(
    "finetune --model: PEFT's layer choice, r and alpha by layer, kept by the folder, sharded "
    "and resumed") {
  ScratchDir d("ft_lm_choice");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 8), llm::TokenWidth::u16);
  // Layer 1's q_proj takes the first rank_pattern key (6), layer 0's the
  // second (2); both v_proj take the first; layer 0's down_proj is excluded.
  const std::vector<std::string> choice = {"--target-modules",
                                           "q_proj,v_proj,down_proj",
                                           "--exclude-modules",
                                           "layers.0.mlp.down_proj",
                                           "--layers-to-transform",
                                           "0,1",
                                           "--rank-pattern",
                                           R"(v_proj|layers\.1\.self_attn\.q_proj=6)",
                                           "--rank-pattern",
                                           "q_proj=2",
                                           "--alpha-pattern",
                                           "down_proj=3",
                                           "--lora-r",
                                           "4"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), choice.begin(), choice.end());
    return more;
  };
  const CliResult one = run_quanta(finetune("llama_gqa", d, "one", with({"--steps", "4"})));
  REQUIRE_MESSAGE(one.code == 0, one.err);
  CHECK(contains(one.out,
                 "on 5 layers (q_proj,v_proj,down_proj; excluding layers.0.mlp.down_proj; layers "
                 "0,1; rank_pattern v_proj|layers\\.1\\.self_attn\\.q_proj=6, q_proj=2; "
                 "alpha_pattern down_proj=3)"));
  const json config = json::parse(std::ifstream(d.file("one/adapters/adapter_config.json")));
  CHECK(config["exclude_modules"] == json({"layers.0.mlp.down_proj"}));
  CHECK(config["layers_to_transform"] == json({0, 1}));
  CHECK(config["alpha_pattern"]["down_proj"] == 3.0);
  const std::map<std::string, int64_t> want = {{"model.layers.0.self_attn.q_proj", 2},
                                               {"model.layers.0.self_attn.v_proj", 6},
                                               {"model.layers.1.self_attn.q_proj", 6},
                                               {"model.layers.1.self_attn.v_proj", 6},
                                               {"model.layers.1.mlp.down_proj", 4}};
  std::map<std::string, int64_t> got;
  for (const auto& [name, t] :
       io::load_safetensors(d.file("one/adapters/adapter_model.safetensors")).tensors)
    if (name.ends_with(".lora_A.weight"))
      got[name.substr(17, name.size() - 17 - 14)] =
          t.size(0);  // base_model.model.<layer>.lora_A.weight
  CHECK(got == want);
  // Sharded on 2 ranks (adapters of unequal sizes split across them) is the
  // unsharded pair.
  REQUIRE(
      run_quanta(finetune("llama_gqa", d, "two", with({"--steps", "4", "--nproc", "2"}))).code ==
      0);
  const CliResult sharded = run_quanta(
      finetune("llama_gqa", d, "sharded", with({"--steps", "4", "--nproc", "2", "--shard"})));
  REQUIRE_MESSAGE(sharded.code == 0, sharded.err);
  check_same_tensors(d.file("two/adapters/adapter_model.safetensors"),
                     d.file("sharded/adapters/adapter_model.safetensors"));
  // The checkpoint keeps the choice: a resume may not change it.
  std::vector<std::string> changed = with({"--steps", "6", "--resume"});
  changed.insert(changed.end(), {"--rank-pattern", "k_proj=2"});
  check_one_line_error(
      run_quanta(finetune("llama_gqa", d, "one", changed)), 2,
      "--resume cannot change the run it continues (model.rank_pattern: checkpoint");
  const CliResult resumed =
      run_quanta(finetune("llama_gqa", d, "one", with({"--steps", "6", "--resume"})));
  REQUIRE_MESSAGE(resumed.code == 0, resumed.err);
  CHECK(contains(resumed.out, "resuming at step 4 of 6 steps"));

  // Modules trained whole: saved with the adapters under their own names,
  // and what --merge-to writes.
  const CliResult saved =
      run_quanta(finetune("llama_gqa", d, "saved",
                          {"--steps", "4", "--target-modules", "q_proj", "--modules-to-save",
                           "embed_tokens,lm_head", "--merge-to", d.file("merged")}));
  REQUIRE_MESSAGE(saved.code == 0, saved.err);
  CHECK(contains(saved.out, "with model.embed_tokens, lm_head trained whole)"));
  std::map<std::string, Tensor> adapters, merged, base;
  for (auto& [n, t] :
       io::load_safetensors(d.file("saved/adapters/adapter_model.safetensors")).tensors)
    adapters[n] = t;
  for (auto& [n, t] : io::load_safetensors(d.file("merged/model.safetensors")).tensors)
    merged[n] = t;
  for (auto& [n, t] : io::load_safetensors(model("llama_gqa") + "/model.safetensors").tensors)
    base[n] = t;
  for (const std::string name : {"lm_head.weight", "model.embed_tokens.weight"}) {
    CAPTURE(name);
    REQUIRE(adapters.count("base_model.model." + name) == 1);
    CHECK(adapters.at("base_model.model." + name).to_vector<float>() ==
          merged.at(name).to_vector<float>());
    CHECK(merged.at(name).to_vector<float>() != base.at(name).to_vector<float>());
  }
  // On 2 ranks, sharded (the embeddings' state split too) or not: the same.
  const std::vector<std::string> whole = {
      "--steps", "4", "--target-modules", "q_proj", "--modules-to-save", "embed_tokens,lm_head",
      "--nproc", "2"};
  std::vector<std::string> whole_sharded = whole;
  whole_sharded.push_back("--shard");
  REQUIRE(run_quanta(finetune("llama_gqa", d, "saved2", whole)).code == 0);
  REQUIRE(run_quanta(finetune("llama_gqa", d, "saved2s", whole_sharded)).code == 0);
  check_same_tensors(d.file("saved2/adapters/adapter_model.safetensors"),
                     d.file("saved2s/adapters/adapter_model.safetensors"));
}

TEST_CASE(
    "finetune --model --use-dora: the loss falls, the folder holds the magnitudes PEFT names, "
    "the merge and the resume agree, sharded is unsharded") {
  ScratchDir d("ft_lm_dora");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 9), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 10), llm::TokenWidth::u16);
  const std::vector<std::string> dora = {"--use-dora", "--lora-dropout", "0.1", "--eval-data",
                                         d.file("eval.bin")};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), dora.begin(), dora.end());
    return more;
  };
  const CliResult r = run_quanta(
      finetune("qwen2_bias", d, "one", with({"--steps", "20", "--merge-to", d.file("merged")})));
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, ", DoRA on 14 layers (all-linear)"));
  const json config = json::parse(std::ifstream(d.file("one/adapters/adapter_config.json")));
  CHECK(config["use_dora"] == true);
  int magnitudes = 0;
  for (const auto& [name, t] :
       io::load_safetensors(d.file("one/adapters/adapter_model.safetensors")).tensors)
    if (name.ends_with(".lora_magnitude_vector")) {
      ++magnitudes;
      CHECK(t.dim() == 1);
    }
  CHECK(magnitudes == 14);
  const std::vector<json> rec = records(d.file("one/metrics.jsonl"));
  REQUIRE(rec.back()["kind"] == "eval");
  const double before = std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
  const double after = rec.back()["eval_loss"].get<double>();
  MESSAGE("DoRA: eval loss " << before << " -> " << after);
  CHECK(after < 0.9 * before);

  // The folder read back over the NF4 base, and the merged float model,
  // score what the run reported; resumed and sharded runs agree, with the
  // magnitudes.
  check_scores(d, "qwen2_bias", "one", after);
  check_resume_and_sharding(d, "qwen2_bias", with);
}

TEST_CASE(
    "finetune --model --bias all --lora-bias: the biases train undecayed and are saved as PEFT "
    "names them; merge, resume and sharding agree") {
  ScratchDir d("ft_lm_bias");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 13), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 14), llm::TokenWidth::u16);
  // qwen2_bias: q, k and v have biases (adapted here); gate_proj has none.
  const std::vector<std::string> bias = {
      "--bias",         "all", "--lora-bias", "--target-modules", "q_proj,k_proj",
      "--weight-decay", "0.1", "--eval-data", d.file("eval.bin")};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), bias.begin(), bias.end());
    return more;
  };
  const CliResult r = run_quanta(
      finetune("qwen2_bias", d, "one", with({"--steps", "20", "--merge-to", d.file("merged")})));
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, " on 4 layers (q_proj,k_proj; bias all; lora_bias)"));
  const json config = json::parse(std::ifstream(d.file("one/adapters/adapter_config.json")));
  CHECK(config["bias"] == "all");
  CHECK(config["lora_bias"] == true);
  std::vector<std::string> biases;
  for (const auto& [name, t] :
       io::load_safetensors(d.file("one/adapters/adapter_model.safetensors")).tensors)
    if (name.ends_with("bias")) biases.push_back(name);
  std::sort(biases.begin(), biases.end());
  const std::string l0 = "base_model.model.model.layers.0.self_attn.";
  CHECK(biases.size() == 10);  // q's and k's base_layer and lora_B biases, v's own, 2 layers
  CHECK(std::count(biases.begin(), biases.end(), l0 + "q_proj.base_layer.bias") == 1);
  CHECK(std::count(biases.begin(), biases.end(), l0 + "q_proj.lora_B.bias") == 1);
  CHECK(std::count(biases.begin(), biases.end(), l0 + "v_proj.bias") == 1);
  // AdamW decays A and B (8 tensors) and leaves the 10 biases alone, as
  // transformers' Trainer does.
  const train::Checkpoint ck =
      train::load_checkpoint(d.file("one/checkpoint.safetensors"), "quanta-lm-finetune-1");
  std::map<std::string, double> groups;
  for (const auto& [name, t] : ck.optimizer)
    if (name.starts_with("groups.")) groups[name] = t.to_vector<double>()[0];
  CHECK(groups["groups.0.weight_decay"] == doctest::Approx(0.1));
  CHECK(groups["groups.0.num_params"] == 8);
  CHECK(groups["groups.1.weight_decay"] == 0);
  CHECK(groups["groups.1.num_params"] == 10);
  const std::vector<json> rec = records(d.file("one/metrics.jsonl"));
  REQUIRE(rec.back()["kind"] == "eval");
  const double before = std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
  const double after = rec.back()["eval_loss"].get<double>();
  MESSAGE("bias all + lora_bias: eval loss " << before << " -> " << after);
  CHECK(after < 0.95 * before);  // adapters on q and k alone: a smaller fall than all-linear's

  // The folder read back, and the merged float model (B's biases folded
  // into q's and k's), score what the run reported; resumed and sharded
  // runs (the two groups' AdamW state split across the ranks) agree.
  check_scores(d, "qwen2_bias", "one", after);
  const CliResult sharded = check_resume_and_sharding(d, "qwen2_bias", with);
  CHECK(contains(sharded.out, "optimizer state and gradients sharded"));

  // A norm trained whole is not decayed either (it was refused with
  // --weight-decay before the rule).
  const CliResult norms =
      run_quanta(finetune("llama_gqa", d, "norms",
                          {"--steps", "2", "--modules-to-save", "norm", "--weight-decay", "0.1"}));
  REQUIRE_MESSAGE(norms.code == 0, norms.err);
  const train::Checkpoint nck =
      train::load_checkpoint(d.file("norms/checkpoint.safetensors"), "quanta-lm-finetune-1");
  for (const auto& [name, t] : nck.optimizer)
    if (name == "groups.1.num_params") CHECK(t.to_vector<double>()[0] == 5);  // 2 x 2 + 1 norms
}

TEST_CASE(
    "finetune --model --trainable-token-indices: the rows train, saved as PEFT names them, "
    "merged; sharded is unsharded") {
  ScratchDir d("ft_lm_tokens");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 15), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 16), llm::TokenWidth::u16);
  // A tied model: its output layer shares the embeddings' trained rows.
  const std::vector<std::string> tokens = {"--trainable-token-indices", "7,14,21,30", "--eval-data",
                                           d.file("eval.bin")};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), tokens.begin(), tokens.end());
    return more;
  };
  const CliResult r = run_quanta(finetune("llama_tied_llama3", d, "one",
                                          with({"--steps", "20", "--merge-to", d.file("merged")})));
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "trainable tokens 7,14,21,30"));
  const json config = json::parse(std::ifstream(d.file("one/adapters/adapter_config.json")));
  CHECK(config["trainable_token_indices"] == json({7, 14, 21, 30}));
  const io::SafetensorsFile saved =
      io::load_safetensors(d.file("one/adapters/adapter_model.safetensors"));
  bool found = false;
  for (const auto& [name, t] : saved.tensors)
    if (name == "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta") {
      found = true;
      CHECK(t.shape() == Shape{4, 32});
    }
  CHECK(found);
  const std::vector<json> rec = records(d.file("one/metrics.jsonl"));
  REQUIRE(rec.back()["kind"] == "eval");
  const double before = std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
  const double after = rec.back()["eval_loss"].get<double>();
  MESSAGE("trainable tokens: eval loss " << before << " -> " << after);
  CHECK(after < 0.9 * before);
  check_scores(d, "llama_tied_llama3", "one", after);
  // The evaluation command reads the folder (its rows written into the
  // weights once, for inference): the run's figure.
  const CliResult scored = run_quanta({"eval", "--model", model("llama_tied_llama3"), "--adapters",
                                       d.file("one/adapters"), "--data", d.file("eval.bin"),
                                       "--seq-len", "32", "--json"});
  REQUIRE_MESSAGE(scored.code == 0, scored.err);
  CHECK(json::parse(scored.out)["loss"].get<double>() == doctest::Approx(after).epsilon(1e-6));

  REQUIRE(
      run_quanta(finetune("llama_tied_llama3", d, "two", with({"--steps", "4", "--nproc", "2"})))
          .code == 0);
  const CliResult sharded = run_quanta(finetune("llama_tied_llama3", d, "sharded",
                                                with({"--steps", "4", "--nproc", "2", "--shard"})));
  REQUIRE_MESSAGE(sharded.code == 0, sharded.err);
  check_same_tensors(d.file("two/adapters/adapter_model.safetensors"),
                     d.file("sharded/adapters/adapter_model.safetensors"));
}

TEST_CASE(
    "finetune --model --init-lora-weights: LoftQ's start, recorded as PEFT records it; "
    "resumed, on 2 ranks and sharded") {
  ScratchDir d("ft_lm_init");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 17), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 18), llm::TokenWidth::u16);
  const std::vector<std::string> eval = {"--steps", "2", "--eval-data", d.file("eval.bin")};
  const CliResult plain = run_quanta(finetune("llama_gqa", d, "plain", eval));
  REQUIRE_MESSAGE(plain.code == 0, plain.err);
  std::vector<std::string> loftq_flags = eval;
  loftq_flags.insert(loftq_flags.end(), {"--init-lora-weights", "loftq"});
  const CliResult loftq = run_quanta(finetune("llama_gqa", d, "loftq", loftq_flags));
  REQUIRE_MESSAGE(loftq.code == 0, loftq.err);
  CHECK(contains(loftq.out, "init loftq on 14 layers"));
  CHECK(contains(loftq.out, "LoftQ: the adapted layers' quantization error "));
  // The base alone scores the NF4 model; LoftQ's adapters move it.
  CHECK(eval_before(loftq.out) != eval_before(plain.out));
  // PEFT records LoftQ's adapters as replace_lora_weights_loftq leaves the
  // config, gaussian ones by name.
  CHECK(json::parse(std::ifstream(
            d.file("loftq/adapters/adapter_config.json")))["init_lora_weights"] == true);
  const CliResult gaussian = run_quanta(
      finetune("llama_gqa", d, "gaussian", {"--steps", "1", "--init-lora-weights", "gaussian"}));
  REQUIRE_MESSAGE(gaussian.code == 0, gaussian.err);
  CHECK(json::parse(std::ifstream(
            d.file("gaussian/adapters/adapter_config.json")))["init_lora_weights"] == "gaussian");
  // A resume starts from the checkpoint's adapters: no SVD, the bytes of
  // one run; 2 ranks, sharded or not, start from rank 0's.
  const auto with = with_init("loftq");
  check_resume_and_sharding(d, "llama_gqa", with);
  const CliResult resumed = run_quanta(finetune(
      "llama_gqa", d, "part", with({"--steps", "7", "--lr-schedule", "constant", "--resume"})));
  REQUIRE_MESSAGE(resumed.code == 0, resumed.err);
  CHECK_FALSE(contains(resumed.out, "LoftQ"));
  // Over a 4-bit folder there are no float weights to correct toward.
  const CliResult four_bit = run_quanta(
      {"finetune", "--model", quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa"),
       "--data", d.file("train.bin"), "--seq-len", "32", "--out", d.file("four_bit"),
       "--init-lora-weights", "loftq"});
  CHECK(four_bit.code != 0);
  CHECK(contains(four_bit.err, "was loaded in 4 bits (a 4-bit folder): start from the float"));
  CHECK_FALSE(std::filesystem::exists(d.file("four_bit/adapters")));
  const CliResult bad =
      run_quanta(finetune("llama_gqa", d, "bad", {"--steps", "1", "--init-lora-weights", "pca"}));
  CHECK(bad.code != 0);
  CHECK(contains(bad.err, "--init-lora-weights"));
  CHECK(contains(bad.err, "eva or corda, got \"pca\""));
}

TEST_CASE(
    "finetune --model --init-lora-weights pissa, olora, orthogonal: the starts, a folder that "
    "scores what the run reported, resumed, on 2 ranks and sharded") {
  ScratchDir d("ft_lm_residual");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 21), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 22), llm::TokenWidth::u16);
  const std::vector<std::string> eval = {"--steps",          "4",        "--eval-data",
                                         d.file("eval.bin"), "--lora-r", "4"};
  const CliResult plain = run_quanta(finetune("llama_gqa", d, "plain", eval));
  REQUIRE_MESSAGE(plain.code == 0, plain.err);
  for (const std::string init : {"pissa", "pissa_niter_2", "olora", "orthogonal"}) {
    CAPTURE(init);
    std::vector<std::string> flags = eval;
    flags.insert(flags.end(), {"--init-lora-weights", init, "--merge-to", d.file("merged")});
    const CliResult r = run_quanta(finetune("llama_gqa", d, init, flags));
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(contains(r.out, "init " + init + " on 14 layers"));
    const json config = json::parse(std::ifstream(d.file(init + "/adapters/adapter_config.json")));
    const std::vector<json> rec = records(d.file(init + "/metrics.jsonl"));
    REQUIRE(rec.back()["kind"] == "eval");
    const double after = rec.back()["eval_loss"].get<double>();
    if (init == "orthogonal") {
      // Starts from the base (B A = 0): the plain run's first figure.
      CHECK(eval_before(r.out) == doctest::Approx(eval_before(plain.out)).epsilon(1e-5));
      CHECK(config["init_lora_weights"] == "orthogonal");
      CHECK(config["r"] == 4);
    } else {
      // The base holds the residual: another NF4 model from the start.
      CHECK(eval_before(r.out) != eval_before(plain.out));
      CHECK(contains(r.out, init == "olora" ? "OLoRA: the adapted layers' quantization error"
                                            : "PiSSA: the adapted layers' quantization error"));
      // Saved converted, as PEFT's path_initial_model_for_weight_conversion.
      CHECK(config["r"] == 8);
      CHECK(config["init_lora_weights"] == true);
      CHECK(config["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] == init);
    }
    // The folder over the NF4 base, and the merged model, score what the
    // run reported: the start is taken back out of the base.
    check_scores(d, "llama_gqa", init, after);
  }
  // Resumed from a checkpoint, the residual base is rebuilt: the bytes of
  // one run; 2 ranks, sharded or not, agree.
  check_resume_and_sharding(d, "llama_gqa", with_init("pissa"));
  // Training on from the converted folder keeps its start.
  const CliResult on = run_quanta(
      finetune("llama_gqa", d, "on", {"--steps", "2", "--adapters", d.file("pissa/adapters")}));
  REQUIRE_MESSAGE(on.code == 0, on.err);
  const json on_config = json::parse(std::ifstream(d.file("on/adapters/adapter_config.json")));
  CHECK(on_config["r"] == 8);
  CHECK(on_config["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] == "pissa");
  // Over a 4-bit folder: OLoRA decomposes the stored base, PiSSA needs the
  // float weights.
  const std::string four_bit = quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa");
  const CliResult olora = run_quanta(
      {"finetune", "--model", four_bit, "--data", d.file("train.bin"), "--seq-len", "32", "--steps",
       "1", "--out", d.file("four_bit_olora"), "--init-lora-weights", "olora"});
  CHECK_MESSAGE(olora.code == 0, olora.err);
  CHECK_FALSE(contains(olora.out, "quantization error"));  // no float weights to measure it by
  const CliResult pissa =
      run_quanta({"finetune", "--model", four_bit, "--data", d.file("train.bin"), "--seq-len", "32",
                  "--out", d.file("four_bit_pissa"), "--init-lora-weights", "pissa"});
  CHECK(pissa.code != 0);
  CHECK(contains(pissa.err, "init_lora_weights pissa takes its start out of the float weights"));
  CHECK_FALSE(std::filesystem::exists(d.file("four_bit_pissa/adapters")));
  const CliResult odd =
      run_quanta(finetune("llama_gqa", d, "odd",
                          {"--steps", "1", "--lora-r", "3", "--init-lora-weights", "orthogonal"}));
  CHECK(odd.code != 0);
  CHECK(contains(odd.err, "orthogonal needs an even r, got 3"));
}

TEST_CASE(
    "finetune --model --init-lora-weights eva: ranks by explained variance, a folder that scores "
    "what the run reported, resumed, on 2 ranks and sharded, and its refusals") {
  ScratchDir d("ft_lm_eva");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 31), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 32), llm::TokenWidth::u16);
  const std::vector<std::string> eval = {"--steps",          "4",        "--eval-data",
                                         d.file("eval.bin"), "--lora-r", "4"};
  const CliResult plain = run_quanta(finetune("llama_gqa", d, "plain", eval));
  REQUIRE_MESSAGE(plain.code == 0, plain.err);
  std::vector<std::string> flags = eval;
  flags.insert(flags.end(), {"--init-lora-weights", "eva", "--merge-to", d.file("merged")});
  const CliResult r = run_quanta(finetune("llama_gqa", d, "eva", flags));
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "init eva on 14 layers (all-linear)"));
  CHECK(contains(r.out, "8 distinct inputs of 14 layers"));
  // B is zero: the run starts from the base.
  CHECK(eval_before(r.out) == doctest::Approx(eval_before(plain.out)).epsilon(1e-6));
  const json config = json::parse(std::ifstream(d.file("eva/adapters/adapter_config.json")));
  CHECK(config["init_lora_weights"] == "eva");
  CHECK(config["eva_config"]["rho"] == 2.0);
  CHECK(config["eva_config"]["tau"] == 0.99);
  // Ranks moved between layers, their total kept; alphas with them.
  int64_t total = 0;
  for (const auto& name : config["target_modules"]) {
    const std::string n = name.get<std::string>();
    total += config["rank_pattern"].contains(n) ? config["rank_pattern"][n].get<int64_t>() : 4;
  }
  CHECK_FALSE(config["rank_pattern"].empty());
  CHECK(total == 14 * 4);
  for (const auto& [n, rank] : config["rank_pattern"].items())
    CHECK(config["alpha_pattern"][n].get<double>() ==
          doctest::Approx(config["lora_alpha"].get<double>() * rank.get<double>() / 4));
  const std::vector<json> rec = records(d.file("eva/metrics.jsonl"));
  REQUIRE(rec.back()["kind"] == "eval");
  check_scores(d, "llama_gqa", "eva", rec.back()["eval_loss"].get<double>());
  // rho 1 keeps every layer's r; EVA's settings recorded.
  flags = eval;
  flags.insert(flags.end(), {"--init-lora-weights", "eva", "--eva-rho", "1", "--eva-tau", "0.95",
                             "--eva-whiten", "--eva-use-label-mask", "false",
                             "--eva-adjust-scaling-factors", "false", "--eva-batch-size", "8"});
  const CliResult rho1 = run_quanta(finetune("llama_gqa", d, "rho1", flags));
  REQUIRE_MESSAGE(rho1.code == 0, rho1.err);
  CHECK(contains(rho1.out, "batches of up to 8 rows"));
  const json c1 = json::parse(std::ifstream(d.file("rho1/adapters/adapter_config.json")));
  CHECK(c1["rank_pattern"].empty());
  CHECK(c1["eva_config"] == json::parse(R"({"rho": 1.0, "tau": 0.95, "use_label_mask": false,
      "label_mask_value": -100, "whiten": true, "adjust_scaling_factors": false})"));
  // A resume runs EVA again for the adapters' shapes, then takes the
  // checkpoint's: the bytes of one run; 2 ranks, sharded or not, agree.
  check_resume_and_sharding(d, "llama_gqa", with_init("eva"));
  // Training on from the folder keeps its ranks and its record of EVA.
  const CliResult on = run_quanta(
      finetune("llama_gqa", d, "on", {"--steps", "2", "--adapters", d.file("eva/adapters")}));
  REQUIRE_MESSAGE(on.code == 0, on.err);
  CHECK_FALSE(contains(on.out, "EVA:"));
  const json on_config = json::parse(std::ifstream(d.file("on/adapters/adapter_config.json")));
  CHECK(on_config["rank_pattern"] == config["rank_pattern"]);
  CHECK(on_config["init_lora_weights"] == "eva");
  // Over a 4-bit folder: the same base, the same start.
  const CliResult four_bit = run_quanta(
      {"finetune", "--model", quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa"),
       "--data", d.file("train.bin"), "--seq-len", "32", "--steps", "1", "--lora-r", "4", "--out",
       d.file("four_bit"), "--init-lora-weights", "eva"});
  REQUIRE_MESSAGE(four_bit.code == 0, four_bit.err);
  CHECK(json::parse(std::ifstream(d.file(
            "four_bit/adapters/adapter_config.json")))["rank_pattern"] == config["rank_pattern"]);
  // Phi-3's fused layers read one input each.
  const CliResult phi3 =
      run_quanta(finetune("phi3_fused", d, "phi3", {"--steps", "1", "--init-lora-weights", "eva"}));
  REQUIRE_MESSAGE(phi3.code == 0, phi3.err);
  CHECK(contains(phi3.out, "init eva on 8 layers"));
  // Refusals: one clear line, no adapters written.
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--eva-rho", "2"}, "--eva-rho is a setting of --init-lora-weights eva"},
           {{"--init-lora-weights", "eva", "--eva-rho", "0.5"}, "--eva-rho"},
           {{"--init-lora-weights", "eva", "--eva-rho", "9", "--lora-r", "4"},
            "may take 36 components (round(r x rho), rho 9), more than its 32 input features"},
           {{"--init-lora-weights", "eva", "--eva-max-forwards", "2"},
            "have not converged (tau 0.99)"}}) {
    CAPTURE(message);
    std::vector<std::string> f = {"--steps", "1"};
    f.insert(f.end(), extra.begin(), extra.end());
    const CliResult bad = run_quanta(finetune("llama_gqa", d, "bad", f));
    CHECK(bad.code != 0);
    CHECK(contains(bad.err, message));
    CHECK_FALSE(std::filesystem::exists(d.file("bad/adapters")));
  }
}

TEST_CASE(
    "finetune --model --init-lora-weights corda: the start from --data's covariances, a folder "
    "that scores what the run reported, resumed, on 2 ranks and sharded, and its refusals") {
  ScratchDir d("ft_lm_corda");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 41), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 42), llm::TokenWidth::u16);
  const std::vector<std::string> eval = {"--steps",          "4",        "--eval-data",
                                         d.file("eval.bin"), "--lora-r", "4"};
  const CliResult plain = run_quanta(finetune("llama_gqa", d, "plain", eval));
  REQUIRE_MESSAGE(plain.code == 0, plain.err);
  double ipm_before = 0;
  for (const std::string method : {"ipm", "kpm"}) {
    CAPTURE(method);
    std::vector<std::string> flags = eval;
    flags.insert(flags.end(), {"--init-lora-weights", "corda", "--corda-method", method,
                               "--corda-samples", "24", "--merge-to", d.file("merged")});
    const CliResult r = run_quanta(finetune("llama_gqa", d, method, flags));
    REQUIRE_MESSAGE(r.code == 0, r.err);
    CHECK(contains(r.out, "init corda on 14 layers"));
    CHECK(contains(r.out, "over the first 24 examples of"));
    CHECK(contains(r.out, "CorDA: the adapted layers' quantization error"));
    // The base holds the residual: another NF4 model from the start.
    CHECK(eval_before(r.out) != eval_before(plain.out));
    if (method == "ipm") ipm_before = eval_before(r.out);
    // Saved converted, as PEFT's path_initial_model_for_weight_conversion.
    const json config =
        json::parse(std::ifstream(d.file(method + "/adapters/adapter_config.json")));
    CHECK(config["r"] == 8);
    CHECK(config["init_lora_weights"] == true);
    CHECK(config["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] == "corda");
    const std::vector<json> rec = records(d.file(method + "/metrics.jsonl"));
    REQUIRE(rec.back()["kind"] == "eval");
    check_scores(d, "llama_gqa", method, rec.back()["eval_loss"].get<double>());
  }
  // Fewer samples, another covariance: another start.
  std::vector<std::string> few = eval;
  few.insert(few.end(), {"--init-lora-weights", "corda", "--corda-samples", "2"});
  const CliResult fewer = run_quanta(finetune("llama_gqa", d, "few", few));
  REQUIRE_MESSAGE(fewer.code == 0, fewer.err);
  CHECK(eval_before(fewer.out) != ipm_before);
  // The covariances kept in a file: the second run reads it instead of the
  // samples and trains the same adapters.
  std::vector<std::string> kept = eval;
  kept.insert(kept.end(), {"--init-lora-weights", "corda", "--corda-covariance-file",
                           d.file("covariances.safetensors")});
  const CliResult writes = run_quanta(finetune("llama_gqa", d, "writes", kept));
  REQUIRE_MESSAGE(writes.code == 0, writes.err);
  CHECK(contains(writes.out, "the covariances written to " + d.file("covariances.safetensors")));
  const CliResult reads = run_quanta(finetune("llama_gqa", d, "reads", kept));
  REQUIRE_MESSAGE(reads.code == 0, reads.err);
  CHECK(contains(reads.out, "covariances from " + d.file("covariances.safetensors") +
                                " (37 samples; --data is not read for them)"));  // 1200 / 32
  check_same_tensors(d.file("writes/adapters/adapter_model.safetensors"),
                     d.file("reads/adapters/adapter_model.safetensors"));
  // Resumed from a checkpoint, the covariances and the residual base are
  // made again: the bytes of one run; 2 ranks, sharded or not, agree.
  check_resume_and_sharding(d, "llama_gqa", with_init("corda"));
  // Training on from the converted folder keeps its start.
  const CliResult on = run_quanta(
      finetune("llama_gqa", d, "on", {"--steps", "2", "--adapters", d.file("ipm/adapters")}));
  REQUIRE_MESSAGE(on.code == 0, on.err);
  CHECK_FALSE(contains(on.out, "CorDA: the adapted layers' input covariances"));
  const json on_config = json::parse(std::ifstream(d.file("on/adapters/adapter_config.json")));
  CHECK(on_config["quanta_base_quantization"]["start_taken_out"]["init_lora_weights"] == "corda");
  // Refusals: one clear line, no adapters written.
  const std::string four_bit = quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa");
  const CliResult over_4bit =
      run_quanta({"finetune", "--model", four_bit, "--data", d.file("train.bin"), "--seq-len", "32",
                  "--out", d.file("bad"), "--init-lora-weights", "corda"});
  CHECK(over_4bit.code != 0);
  CHECK(
      contains(over_4bit.err, "init_lora_weights corda takes its start out of the float weights"));
  CHECK_FALSE(std::filesystem::exists(d.file("bad/adapters")));
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--corda-method", "kpm"}, "--corda-method is a setting of --init-lora-weights corda"},
           {{"--corda-covariance-file", "c.safetensors"},
            "--corda-covariance-file is a setting of --init-lora-weights corda"},
           {{"--init-lora-weights", "corda", "--corda-method", "svd"}, "--corda-method"},
           {{"--init-lora-weights", "corda", "--corda-samples", "-1"}, "--corda-samples"}}) {
    CAPTURE(message);
    std::vector<std::string> f = {"--steps", "1"};
    f.insert(f.end(), extra.begin(), extra.end());
    const CliResult bad = run_quanta(finetune("llama_gqa", d, "bad", f));
    CHECK(bad.code != 0);
    CHECK(contains(bad.err, message));
    CHECK_FALSE(std::filesystem::exists(d.file("bad/adapters")));
  }
}

TEST_CASE("finetune --model: 2 and 3 ranks train what 1 does") {
  ScratchDir d("ft_lm_ranks");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 6), llm::TokenWidth::u16);
  // An uneven batch (5 sequences on 2 or 3 ranks, in 2 micro-batches); no
  // dropout, so the ranks' sums are the one process's up to the order of
  // the f32 additions.
  const std::vector<std::string> flags = {"--steps",        "4", "--batch-size", "5",
                                          "--lora-dropout", "0", "--lr",         "1e-3",
                                          "--grad-accum",   "2"};
  REQUIRE(run_quanta(finetune("llama_gqa", d, "one", flags)).code == 0);
  const io::SafetensorsFile a =
      io::load_safetensors(d.file("one/adapters/adapter_model.safetensors"));
  const std::vector<json> one = records(d.file("one/metrics.jsonl"));
  for (const std::string ranks : {"2", "3"}) {
    CAPTURE(ranks);
    std::vector<std::string> more = flags;
    more.insert(more.end(), {"--nproc", ranks});
    const std::string out = "ranks" + ranks;
    const CliResult r = run_quanta(finetune("llama_gqa", d, out, more));
    REQUIRE_MESSAGE(r.code == 0, r.err);
    const io::SafetensorsFile b =
        io::load_safetensors(d.file(out + "/adapters/adapter_model.safetensors"));
    REQUIRE(a.tensors.size() == b.tensors.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.tensors.size(); ++i) {
      const auto x = a.tensors[i].second.to_vector<float>();
      const auto y = b.tensors[i].second.to_vector<float>();
      for (std::size_t k = 0; k < x.size(); ++k)
        worst = std::max(worst, double(std::abs(x[k] - y[k])));
    }
    MESSAGE("1 rank vs " << ranks << ": adapters max |diff| " << worst
                         << " after 4 AdamW steps of lr 1e-3");
    // Adam divides by |g| + eps: an element whose gradient is rounding noise
    // (~1e-9) moves by a noisy fraction of lr, well under 0.1 lr.
    CHECK(worst < 1e-4);
    const std::vector<json> many = records(d.file(out + "/metrics.jsonl"));
    CHECK(one[1]["loss"].get<double>() ==
          doctest::Approx(many[1]["loss"].get<double>()).epsilon(1e-5));
  }
}

TEST_CASE(
    "finetune --model: an f64 model on 2, 3 and 4 ranks, sharded or not, trains what 1 does "
    "within 1e-9") {
  ScratchDir d("ft_lm_ranks64");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 12), llm::TokenWidth::u16);
  {
    // The tiny Llama's shapes in f64: the NF4 base dequantizes to f32 values
    // that f64 holds exactly, so ranks differ only by f64 summation order.
    llm::DecoderConfig c = llm::read_decoder_config(model("llama_gqa") + "/config.json");
    c.dtype = DType::f64;
    Generator gen(21);
    llm::save_causal_lm(*llm::CausalLM::random(c, gen, Device::cpu(), 0.1), d.file("f64_model"));
  }
  const auto run = [&](const std::string& out, const std::string& ranks,
                       std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"finetune",
                                     "--model",
                                     d.file("f64_model"),
                                     "--data",
                                     d.file("train.bin"),
                                     "--seq-len",
                                     "32",
                                     "--steps",
                                     "4",
                                     "--grad-accum",
                                     "2",
                                     "--lora-dropout",
                                     "0",
                                     "--lr",
                                     "1e-3",
                                     "--nproc",
                                     ranks,
                                     "--out",
                                     d.file(out)};
    if (std::find(extra.begin(), extra.end(), "--batch-size") == extra.end())
      extra.insert(extra.end(), {"--batch-size", "5"});
    args.insert(args.end(), extra.begin(), extra.end());
    const CliResult r = run_quanta(args);
    REQUIRE_MESSAGE(r.code == 0, r.err);
    return r;
  };
  const auto adapters = [&](const std::string& out) {
    StateDict all =
        train::load_checkpoint(d.file(out + "/checkpoint.safetensors"), "quanta-lm-finetune-1")
            .model;
    StateDict lora;
    for (auto& [name, t] : all)
      if (name.find("lora_") != std::string::npos) lora.emplace_back(name, t);
    CHECK(lora.size() == 28);
    return lora;
  };
  const auto max_diff = [](const StateDict& a, const StateDict& b) {
    REQUIRE(a.size() == b.size());
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].first == b[i].first);
      CHECK(a[i].second.dtype() == DType::f64);
      const auto x = a[i].second.to_vector<double>(), y = b[i].second.to_vector<double>();
      for (std::size_t k = 0; k < x.size(); ++k) worst = std::max(worst, std::abs(x[k] - y[k]));
    }
    return worst;
  };
  run("one", "1");
  const StateDict one = adapters("one");
  for (const std::string ranks : {"2", "3"}) {
    CAPTURE(ranks);
    run("ranks" + ranks, ranks);
    const StateDict many = adapters("ranks" + ranks);
    MESSAGE("f64: 1 rank vs " << ranks << ": adapters max |diff| " << max_diff(one, many));
    CHECK(max_diff(one, many) < 1e-9);
    // Sharding the base moves bytes only, and the adapters' gradients are
    // reduced into their owners rather than all-reduced: the same adapters
    // as the same ranks unsharded, with the layers recomputed (gathered
    // again in the backward) or not; bit for bit on two ranks (a sum of two
    // is the same either way), within rounding on three (Gloo's reduce and
    // all-reduce add the three in other orders).
    const std::string out = "sharded" + ranks;
    // Evaluations run on every rank then (a sharded forward is a collective).
    std::vector<std::string> shard = {"--shard", "--eval-data", d.file("train.bin"), "--eval-every",
                                      "2"};
    if (ranks == "3") shard.push_back("--recompute");
    const CliResult r = run(out, ranks, shard);
    CHECK(r.out.find("kept per rank") != std::string::npos);
    if (ranks == "2")
      CHECK(max_diff(many, adapters(out)) == 0);
    else
      CHECK(max_diff(many, adapters(out)) < 1e-13);
    int evals = 0;
    for (const json& rec : records(d.file(out + "/metrics.jsonl"))) evals += rec["kind"] == "eval";
    CHECK(evals == 2);
  }
  // 4 sharded ranks on a batch of 3: one rank's share is empty (it still
  // gathers every layer with the others).
  run("one_b3", "1", {"--batch-size", "3"});
  run("sharded4", "4", {"--batch-size", "3", "--shard", "--recompute"});
  const double worst = max_diff(adapters("one_b3"), adapters("sharded4"));
  MESSAGE("f64: 1 rank vs 4 sharded ranks, batch 3: adapters max |diff| " << worst);
  CHECK(worst < 1e-9);
}

TEST_CASE("quantize MODEL_DIR OUT_DIR: transformers' 4-bit folder; refusals") {
  ScratchDir d("quantize_folder");
  const CliResult r =
      run_quanta({"quantize", model("qwen2_bias"), d.file("q4"), "--compute-dtype", "float32"});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "14 linear layers (all but lm_head) in NF4, block 64, double quant"));
  CHECK(contains(r.out, "model.layers.1.mlp.down_proj"));
  const io::SafetensorsFile want = io::load_safetensors(
      quanta::testing::test_data("llm/qlora/transformers_4bit/qwen2_bias/model.safetensors"));
  const io::SafetensorsFile got = io::load_safetensors(d.file("q4/model.safetensors"));
  std::map<std::string, Tensor> theirs(want.tensors.begin(), want.tensors.end());
  REQUIRE(got.tensors.size() == theirs.size());
  for (const auto& [name, t] : got.tensors) {
    CAPTURE(name);
    REQUIRE(theirs.count(name) == 1);
    CHECK(t.to_vector<double>() == theirs.at(name).to_vector<double>());
  }
  CHECK(std::filesystem::exists(d.file("q4/tokenizer.model")) ==
        std::filesystem::exists(model("qwen2_bias") + "/tokenizer.model"));
  // Fine-tuning over the 4-bit folder is fine-tuning over the float one: the
  // same NF4 bytes, so the same adapters, bit for bit.
  llm::write_token_file(d.file("train.bin"), learnable_tokens(600, 13), llm::TokenWidth::u16);
  for (const auto& [base, out] : {std::pair{model("qwen2_bias"), std::string("from_float")},
                                  std::pair{d.file("q4"), std::string("from_4bit")}}) {
    const CliResult f =
        run_quanta({"finetune", "--model", base, "--data", d.file("train.bin"), "--seq-len", "32",
                    "--steps", "4", "--batch-size", "4", "--lr", "1e-2", "--out", d.file(out)});
    REQUIRE_MESSAGE(f.code == 0, f.err);
    CHECK(contains(f.out, "NF4: 14 linear layers (all but lm_head)"));
  }
  check_same_tensors(d.file("from_float/adapters/adapter_model.safetensors"),
                     d.file("from_4bit/adapters/adapter_model.safetensors"));
  // In shards past --max-shard-size: the same tensors, read through the index.
  const CliResult sharded = run_quanta({"quantize", model("qwen2_bias"), d.file("q4s"),
                                        "--compute-dtype", "float32", "--max-shard-size", "8KB"});
  REQUIRE_MESSAGE(sharded.code == 0, sharded.err);
  CHECK(std::filesystem::exists(d.file("q4s/model.safetensors.index.json")));
  CHECK_FALSE(std::filesystem::exists(d.file("q4s/model.safetensors")));
  const StateDict shards = llm::read_model_weights(d.file("q4s"));
  REQUIRE(shards.size() == got.tensors.size());
  for (const auto& [name, t] : shards) {
    CAPTURE(name);
    CHECK(t.to_vector<double>() == theirs.at(name).to_vector<double>());
  }
  check_one_line_error(run_quanta({"quantize", d.file("q4/model.safetensors"), d.file("q8.st"),
                                   "--max-shard-size", "1MB"}),
                       2, "--max-shard-size is for a model folder IN");
  check_one_line_error(
      run_quanta({"quantize", model("qwen2_bias"), d.file("q5"), "--format", "torchao"}), 2,
      "--format torchao: a model folder becomes transformers' 4-bit folder");
  check_one_line_error(
      run_quanta({"quantize", model("qwen2_bias"), d.file("q6"), "--block-size", "128"}), 2,
      "in blocks of 64");
  check_one_line_error(run_quanta({"quantize", model("qwen2_bias"), model("qwen2_bias")}), 2,
                       "is the model folder IN");
  // Gemma 3's image-text model: its decoder in NF4, its vision tower beside
  // (as transformers saves it with that skipped); loaded back, the same
  // model as quantized in process.
  const CliResult vlm = run_quanta(
      {"quantize", model("gemma3_image_text"), d.file("q7"), "--compute-dtype", "float32"});
  REQUIRE_MESSAGE(vlm.code == 0, vlm.err);
  CHECK(contains(vlm.out, "14 linear layers (all but lm_head)"));
  auto loaded = llm::load_bnb_folder(d.file("q7"));
  auto in_process = llm::load_causal_lm(model("gemma3_image_text"));
  llm::BaseQuantization f32;
  f32.compute_dtype = DType::f32;
  llm::quantize_base(*in_process, f32);
  {
    NoGradGuard no_grad;
    const Tensor ids = from_vector<int64_t>({3, 9, 27, 5, 1, 40}, {1, 6});
    CHECK(loaded->logits(ids).to_vector<float>() == in_process->logits(ids).to_vector<float>());
  }
  CHECK(llm::read_non_decoder_weights(loaded->config(), d.file("q7")).size() ==
        llm::read_non_decoder_weights(in_process->config(), model("gemma3_image_text")).size());
}

TEST_CASE(
    "finetune --model --adapters: training goes on from a PEFT folder as its config describes "
    "it; resume and sharding agree; refusals") {
  ScratchDir d("ft_lm_from_adapters");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 17), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 18), llm::TokenWidth::u16);
  const std::string eval = d.file("eval.bin");
  // The first run shapes adapters unlike the defaults: r 4 on q and v, rsLoRA.
  const CliResult first = run_quanta(
      finetune("qwen2_bias", d, "first",
               {"--steps", "10", "--lora-r", "4", "--lora-alpha", "8", "--target-modules",
                "q_proj,v_proj", "--use-rslora", "--lora-dropout", "0", "--eval-data", eval}));
  REQUIRE_MESSAGE(first.code == 0, first.err);
  const std::string start = d.file("first/adapters");
  const double first_after =
      records(d.file("first/metrics.jsonl")).back()["eval_loss"].get<double>();

  // The second starts where the first ended: its first eval is the first's
  // last, its adapters have the folder's shape, and training moves them on.
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), {"--adapters", start, "--eval-data", eval});
    return more;
  };
  const CliResult second = run_quanta(finetune("qwen2_bias", d, "second", with({"--steps", "10"})));
  REQUIRE_MESSAGE(second.code == 0, second.err);
  CHECK(contains(second.out, "LoRA: r 4, alpha 8, dropout 0, rslora, from " + start +
                                 " on 4 layers (q_proj,v_proj)"));
  const double second_before =
      std::stod(second.out.substr(second.out.find("eval before fine-tuning: loss ") + 30));
  CHECK(second_before == doctest::Approx(first_after).epsilon(1e-6));
  const double second_after =
      records(d.file("second/metrics.jsonl")).back()["eval_loss"].get<double>();
  MESSAGE("from adapters: eval loss " << second_before << " -> " << second_after);
  CHECK(second_after < second_before);
  const json a = json::parse(std::ifstream(start + "/adapter_config.json"));
  const json b = json::parse(std::ifstream(d.file("second/adapters/adapter_config.json")));
  for (const char* field : {"r", "lora_alpha", "target_modules", "use_rslora", "lora_dropout"}) {
    CAPTURE(field);
    CHECK(a[field] == b[field]);
  }
  const io::SafetensorsFile x = io::load_safetensors(start + "/adapter_model.safetensors");
  const io::SafetensorsFile y =
      io::load_safetensors(d.file("second/adapters/adapter_model.safetensors"));
  REQUIRE(x.tensors.size() == y.tensors.size());
  for (std::size_t i = 0; i < x.tensors.size(); ++i) {
    CHECK(x.tensors[i].first == y.tensors[i].first);
    CHECK(x.tensors[i].second.to_vector<float>() != y.tensors[i].second.to_vector<float>());
  }
  // The run's config names the folder: a resume checks its adapters are the
  // ones it started from.
  const train::Checkpoint ck =
      train::load_checkpoint(d.file("second/checkpoint.safetensors"), "quanta-lm-finetune-1");
  CHECK(ck.info.config["model"]["adapters"] ==
        std::filesystem::absolute(start).lexically_normal().string());

  // The dropout, a training setting, may change; it is what the new folder records.
  const CliResult dropout = run_quanta(
      finetune("qwen2_bias", d, "dropout", with({"--steps", "2", "--lora-dropout", "0.2"})));
  REQUIRE_MESSAGE(dropout.code == 0, dropout.err);
  CHECK(contains(dropout.out, "LoRA: r 4, alpha 8, dropout 0.2, rslora, from "));
  CHECK(json::parse(
            std::ifstream(d.file("dropout/adapters/adapter_config.json")))["lora_dropout"] == 0.2);

  check_resume_and_sharding(d, "qwen2_bias", with);
  // A resume names the folder it started from; the run may not write over it.
  check_one_line_error(
      run_quanta(finetune("qwen2_bias", d, "second",
                          {"--steps", "12", "--resume", "--adapters", d.file("dropout/adapters")})),
      2, "--resume cannot change the run it continues (model.adapters: checkpoint \"");
  check_one_line_error(
      run_quanta(finetune("qwen2_bias", d, "first", with({"--steps", "2", "--overwrite"}))), 2,
      "is the adapter folder this command reads");

  // A folder PEFT saved (q and v adapters beside embed_tokens and lm_head
  // trained whole): the run starts from what quanta eval scores it at, and
  // the folder it writes keeps the modules trained whole.
  const std::string peft = quanta::testing::test_data("llm/qlora/llama_gqa_saved/adapter_init");
  const CliResult scored = run_quanta({"eval", "--model", model("llama_gqa"), "--adapters", peft,
                                       "--data", eval, "--seq-len", "32", "--json"});
  REQUIRE_MESSAGE(scored.code == 0, scored.err);
  const CliResult from_peft = run_quanta(finetune(
      "llama_gqa", d, "from_peft", {"--steps", "3", "--adapters", peft, "--eval-data", eval}));
  REQUIRE_MESSAGE(from_peft.code == 0, from_peft.err);
  CHECK(contains(from_peft.out, "(q_proj,v_proj; modules_to_save embed_tokens,lm_head)"));
  CHECK(
      std::stod(from_peft.out.substr(from_peft.out.find("eval before fine-tuning: loss ") + 30)) ==
      doctest::Approx(json::parse(scored.out)["loss"].get<double>()).epsilon(1e-5));
  CHECK(json::parse(
            std::ifstream(d.file("from_peft/adapters/adapter_config.json")))["modules_to_save"] ==
        json::array({"embed_tokens", "lm_head"}));

  // Flags that shape adapters contradict the folder's; the folder must fit the base.
  check_one_line_error(run_quanta(finetune("qwen2_bias", d, "bad1", with({"--lora-r", "8"}))), 2,
                       "--lora-r shapes new adapters, and --adapters DIR trains the folder's");
  check_one_line_error(
      run_quanta(finetune("qwen2_bias", d, "bad2", with({"--target-modules", "q_proj"}))), 2,
      "--target-modules shapes new adapters");
  check_one_line_error(run_quanta(finetune("qwen2_bias", d, "bad3", {"--adapters-any-base"})), 2,
                       "--adapters-any-base goes with --adapters DIR");
  check_one_line_error(
      run_quanta(finetune("llama_gqa", d, "bad4", {"--adapters", start, "--eval-data", eval})), 1,
      "(--adapters-any-base uses them anyway, their shapes checked)");
  check_one_line_error(
      run_quanta(finetune("qwen2_bias", d, "bad5", {"--adapters", d.file("nowhere")})), 1,
      "nowhere");
  check_one_line_error(run_quanta(finetune("mistral_sharded", d, "bad6",
                                           {"--adapters", start, "--adapters-any-base"})),
                       1, "adapter_model.safetensors does not fit the model");
}

TEST_CASE(
    "finetune --model --epochs, --warmup-ratio and --adam-*: transformers' TrainingArguments; "
    "a resume with more epochs goes on") {
  ScratchDir d("ft_lm_trainer_args");
  // 37 windows of 32 tokens: 10 steps of 4 a pass.
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 21), llm::TokenWidth::u16);
  const std::vector<std::string> constant = {"--lr-schedule", "constant"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.end(), constant.begin(), constant.end());
    return more;
  };
  auto adapters = [&](const std::string& out) {
    return d.file(out + "/adapters/adapter_model.safetensors");
  };
  const CliResult two = run_quanta(finetune("llama_gqa", d, "two", with({"--epochs", "2"})));
  REQUIRE_MESSAGE(two.code == 0, two.err);
  CHECK(contains(two.out, ": 20 steps (2 epochs of 10), global batch 4"));
  const std::vector<json> rec = records(d.file("two/metrics.jsonl"));
  REQUIRE(rec.back()["kind"] == "eval");
  CHECK(rec.back()["step"] == 20);
  CHECK(rec.back()["epoch"] == 2);
  // One epoch, then a resume to two: the run of two in one go.
  REQUIRE(run_quanta(finetune("llama_gqa", d, "resumed", with({"--epochs", "1"}))).code == 0);
  const CliResult resumed =
      run_quanta(finetune("llama_gqa", d, "resumed", with({"--epochs", "2", "--resume"})));
  REQUIRE_MESSAGE(resumed.code == 0, resumed.err);
  CHECK(contains(resumed.out, "resuming at step 10 of 20 steps (2 epochs of 10)"));
  check_same_tensors(adapters("two"), adapters("resumed"));
  // The same --epochs again has nothing left to train.
  const CliResult again =
      run_quanta(finetune("llama_gqa", d, "resumed", with({"--epochs", "2", "--resume"})));
  CHECK(again.code == 1);
  CHECK(contains(again.err, "the checkpoint is at step 20, the run asks for 20 steps"));
  // Fractions round up, as the Trainer's steps do.
  const CliResult part = run_quanta(finetune("llama_gqa", d, "part", {"--epochs", "0.25"}));
  REQUIRE_MESSAGE(part.code == 0, part.err);
  CHECK(contains(part.out, ": 3 steps (0.25 epochs of 10)"));

  // --warmup-ratio 0.25 of 8 steps is --warmup-steps 2.
  const CliResult ratio =
      run_quanta(finetune("llama_gqa", d, "ratio", {"--steps", "8", "--warmup-ratio", "0.25"}));
  REQUIRE_MESSAGE(ratio.code == 0, ratio.err);
  CHECK(contains(ratio.out, "(linear, warmup 2)"));
  REQUIRE(run_quanta(finetune("llama_gqa", d, "warmup", {"--steps", "8", "--warmup-steps", "2"}))
              .code == 0);
  check_same_tensors(adapters("ratio"), adapters("warmup"));

  // AdamW's defaults given are the defaults; another beta2 moves the
  // adapters elsewhere, is what the optimizer state holds, and stays on --resume.
  REQUIRE(run_quanta(finetune("llama_gqa", d, "adam", {"--steps", "4"})).code == 0);
  REQUIRE(run_quanta(finetune("llama_gqa", d, "adam_given",
                              {"--steps", "4", "--adam-beta1", "0.9", "--adam-beta2", "0.999",
                               "--adam-epsilon", "1e-8"}))
              .code == 0);
  check_same_tensors(adapters("adam"), adapters("adam_given"));
  const CliResult beta2 =
      run_quanta(finetune("llama_gqa", d, "beta2", {"--steps", "4", "--adam-beta2", "0.95"}));
  REQUIRE_MESSAGE(beta2.code == 0, beta2.err);
  CHECK(contains(beta2.out, "AdamW lr 0.01 (linear, warmup 0; betas 0.9, 0.95)"));
  const train::Checkpoint ck =
      train::load_checkpoint(d.file("beta2/checkpoint.safetensors"), "quanta-lm-finetune-1");
  std::map<std::string, double> hparams;
  for (const auto& [name, t] : ck.optimizer)
    if (name.starts_with("hparams.")) hparams[name] = t.to_vector<double>()[0];
  CHECK(hparams["hparams.beta1"] == 0.9);
  CHECK(hparams["hparams.beta2"] == 0.95);
  CHECK(hparams["hparams.eps"] == 1e-8);
  CHECK(io::load_safetensors(adapters("adam")).tensors[1].second.to_vector<float>() !=
        io::load_safetensors(adapters("beta2")).tensors[1].second.to_vector<float>());
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "beta2", {"--steps", "6", "--resume"})),
                       2, "--resume cannot change the run it continues (model.adam_beta2: ");

  check_one_line_error(
      run_quanta(finetune("llama_gqa", d, "bad1", {"--steps", "3", "--epochs", "1"})), 2,
      "give --steps or --epochs, not both");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "bad2",
                                           {"--warmup-steps", "1", "--warmup-ratio", "0.1"})),
                       2, "give --warmup-steps or --warmup-ratio, not both");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "bad3", {"--adam-beta1", "1"})), 2,
                       "--adam-beta1: must be below 1, got '1'");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "bad4", {"--epochs", "0"})), 2,
                       "--epochs: must be a number > 0, got '0'");
}

TEST_CASE(
    "finetune --model --neftune-noise-alpha: noisy embeddings in training, none in evaluation; "
    "resume and sharding agree") {
  ScratchDir d("ft_lm_neftune");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(1200, 23), llm::TokenWidth::u16);
  llm::write_token_file(d.file("eval.bin"), learnable_tokens(400, 24), llm::TokenWidth::u16);
  const std::vector<std::string> common = {"--lora-dropout", "0", "--eval-data",
                                           d.file("eval.bin")};
  auto plain = [&](std::vector<std::string> more) {
    more.insert(more.end(), common.begin(), common.end());
    return more;
  };
  auto with = [&](std::vector<std::string> more) {
    more = plain(more);
    more.insert(more.end(), {"--neftune-noise-alpha", "5"});
    return more;
  };
  const CliResult noisy = run_quanta(finetune("llama_gqa", d, "noisy", with({"--steps", "20"})));
  REQUIRE_MESSAGE(noisy.code == 0, noisy.err);
  CHECK(contains(noisy.out, "(linear, warmup 0), NEFTune alpha 5, seed 0"));
  const CliResult quiet = run_quanta(finetune("llama_gqa", d, "quiet", plain({"--steps", "20"})));
  REQUIRE_MESSAGE(quiet.code == 0, quiet.err);
  auto before = [](const CliResult& r) {
    return std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
  };
  // Evaluation sees no noise; training does, and still learns.
  CHECK(before(noisy) == before(quiet));
  const double noisy_after = records(d.file("noisy/metrics.jsonl")).back()["eval_loss"];
  const double quiet_after = records(d.file("quiet/metrics.jsonl")).back()["eval_loss"];
  MESSAGE("NEFTune alpha 5: eval loss " << before(noisy) << " -> " << noisy_after
                                        << " (without: " << quiet_after << ")");
  CHECK(noisy_after != quiet_after);
  CHECK(noisy_after < 0.9 * before(noisy));
  // The noise's stream is in the checkpoint: a resume draws what one run
  // would; 2 ranks sharded or not agree.
  check_resume_and_sharding(d, "llama_gqa", with);
  check_one_line_error(
      run_quanta(finetune("llama_gqa", d, "noisy", plain({"--steps", "30", "--resume"}))), 2,
      "--resume cannot change the run it continues (model.neftune_noise_alpha: checkpoint 5.0, "
      "now not set)");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "bad", {"--neftune-noise-alpha", "-1"})),
                       2, "--neftune-noise-alpha: must be a number >= 0, got '-1'");
}

TEST_CASE("finetune --model: bad input is one clear line") {
  ScratchDir d("ft_lm_bad");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(200, 7), llm::TokenWidth::u16);
  llm::write_token_file(d.file("short.bin"), learnable_tokens(20, 7), llm::TokenWidth::u16);
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o1", {"--target-modules", "qproj"})), 1,
                       "target_modules entry \"qproj\" matches no linear layer");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o2", {"--lora-r", "40"})), 1,
                       "lora r 40 is larger than layer");
  // PEFT's layer choice.
  const std::vector<std::pair<std::vector<std::string>, std::pair<int, const char*>>> choice = {
      {{"--target-modules", "q_proj", "--target-modules-regex", ".*"},
       {2, "give --target-modules or --target-modules-regex, not both"}},
      {{"--rank-pattern", "q_proj"}, {2, "--rank-pattern \"q_proj\" is not PATTERN=VALUE"}},
      {{"--rank-pattern", "q_proj=two"}, {2, "--rank-pattern q_proj=two: \"two\" is not a whole"}},
      {{"--alpha-pattern", "q_proj=x"}, {2, "--alpha-pattern q_proj=x: \"x\" is not a number"}},
      {{"--layers-to-transform", "0"},
       {2, "layers_to_transform needs target_modules as a list of names"}},
      {{"--target-modules-regex", "(?<=attn\\.)q_proj"},
       {2, "is not a regular expression quanta reads"}},
      {{"--target-modules", "q_proj", "--rank-pattern", "k_proj=2"},
       {1, "rank_pattern key \"k_proj\" gives no adapted layer its value"}},
      {{"--target-modules", "q_proj", "--exclude-modules", "q_proj"},
       {1, "no linear layer gets an adapter"}},
      {{"--bias", "all"}, {1, "bias \"all\" trains nothing: the model has no biases"}},
      {{"--bias", "some"}, {2, "--bias"}},
      {{"--lora-bias", "--use-dora"}, {2, "lora_bias is not available with use_dora"}},
      {{"--trainable-token-indices", "2,99"}, {1, "token 99 is outside the vocabulary of 64"}},
      {{"--trainable-token-indices", "2,x"}, {2, "\"x\" is not a whole number"}},
      {{"--trainable-token-indices", "=3"}, {2, "--trainable-token-indices =3 names no module"}},
      {{"--trainable-token-indices", "3", "--trainable-token-indices", "lm_head=4"},
       {2, "trainable_token_indices is a list or an object, not both"}},
      {{"--modules-to-save", "q_proj"}, {1, "a linear layer quantized to NF4"}},
      {{"--target-modules", "q_proj", "--rank-pattern", "q_proj=40"},
       {1, "lora r 40 is larger than layer model.layers.0.self_attn.q_proj"}},
  };
  int n = 0;
  for (const auto& [flags, error] : choice) {
    CAPTURE(flags);
    check_one_line_error(run_quanta(finetune("llama_gqa", d, "oc" + std::to_string(n++), flags)),
                         error.first, error.second);
  }
  check_one_line_error(run_quanta({"finetune", "--model", model("llama_gqa"), "--data",
                                   d.file("short.bin"), "--seq-len", "32", "--out", d.file("o3")}),
                       1, "20 tokens, fewer than one sequence of 32");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o4", {"--seq-len", "4096"})), 2,
                       "longer than the model's max_position_embeddings 128");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o5", {"--merge"})), 2,
                       "--merge is for the classifier of quanta train, not --model");
  check_one_line_error(
      run_quanta({"finetune", "--model", model("llama_gqa"), "--out", d.file("o6")}), 2,
      "--model needs --data FILE");
  check_one_line_error(
      run_quanta({"finetune", "x.safetensors", "--out", d.file("o7"), "--seq-len", "8"}), 2,
      "--seq-len is for a language model (--model DIR)");
  check_one_line_error(run_quanta(finetune("llama_gqa", d, "o8", {"--compute-dtype", "int8"})), 2,
                       "--compute-dtype must be auto, bfloat16, float32 or float16");
  check_one_line_error(run_quanta({"finetune", "--model", model("nonexistent"), "--data",
                                   d.file("train.bin"), "--out", d.file("o9")}),
                       1, "nonexistent");
  // A 4-bit image-text folder as load_in_4bit saves it by default: its
  // vision tower stored quantized, which a merged float folder cannot carry.
  check_one_line_error(
      run_quanta(
          {"finetune", "--model",
           quanta::testing::test_data("llm/qlora/transformers_4bit/gemma3_image_text_vision_4bit"),
           "--data", d.file("train.bin"), "--seq-len", "32", "--out", d.file("o10"), "--merge-to",
           d.file("o10m")}),
      2, "--merge-to over a 4-bit image-text folder whose vision tower is stored quantized");
}

TEST_CASE("quanta merge: bad input is one clear line, and nothing is written") {
  ScratchDir d("merge_bad");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(400, 9), llm::TokenWidth::u16);
  // lora_bias on o_proj, which has no bias to take it: trained without
  // --merge-to (which would refuse it up front), merging it is refused.
  REQUIRE(run_quanta(finetune("qwen2_bias", d, "run",
                              {"--steps", "2", "--target-modules", "o_proj", "--lora-bias"}))
              .code == 0);
  const std::string adapters = d.file("run/adapters");
  const auto merge = [&](const std::string& base, std::vector<std::string> more) {
    std::vector<std::string> args = {"merge", "--model", model(base)};
    args.insert(args.end(), more.begin(), more.end());
    return run_quanta(args);
  };
  check_one_line_error(merge("qwen2_bias", {"--adapters", adapters, "--out", d.file("m1")}), 2,
                       "o_proj has lora_bias but no bias of its own");
  check_one_line_error(merge("qwen2_bias", {"--out", d.file("m2")}), 2, "--adapters is required");
  check_one_line_error(merge("qwen2_bias", {"--adapters", adapters}), 2, "--out is required");
  check_one_line_error(merge("llama_gqa", {"--adapters", adapters, "--out", d.file("m3")}), 1,
                       "the adapters were made for base");
  check_one_line_error(merge("qwen2_bias", {"--adapters", adapters, "--out", model("qwen2_bias")}),
                       2, "is the base model this command reads");
  check_one_line_error(merge("qwen2_bias", {"--adapters", d.file("none"), "--out", d.file("m4")}),
                       1, "none");
  check_one_line_error(
      run_quanta(
          {"merge", "--model",
           quanta::testing::test_data("llm/qlora/transformers_4bit/gemma3_image_text_vision_4bit"),
           "--adapters", adapters, "--out", d.file("m5")}),
      2, "--out over a 4-bit image-text folder whose vision tower is stored quantized");
  check_one_line_error(merge("qwen2_bias", {"--adapters", adapters, "--out", d.file("m6"),
                                            "--max-shard-size", "5GiB"}),
                       2, "--max-shard-size: shard size \"5GiB\" is not a size");
  // A sharded base's own folder: the merge would remove the shards it reads.
  check_one_line_error(
      merge("mistral_sharded", {"--adapters", adapters, "--out", model("mistral_sharded") + "/"}),
      2, "is the base model's folder");
  check_one_line_error(
      run_quanta(finetune("llama_gqa", d, "o1", {"--steps", "1", "--max-shard-size", "1MB"})), 2,
      "--max-shard-size goes with --merge-to DIR");
  for (const char* out : {"m1", "m3", "m4", "m5", "m6"})
    CHECK_FALSE(fs::exists(d.file(std::string(out) + "/model.safetensors")));
}

TEST_CASE("quanta merge --max-shard-size: save_pretrained's shards, read back as the same model") {
  ScratchDir d("merge_shards");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(400, 9), llm::TokenWidth::u16);
  REQUIRE(run_quanta(finetune("llama_gqa", d, "run", {"--steps", "2"})).code == 0);
  const auto merge = [&](const std::string& out, std::vector<std::string> more) {
    std::vector<std::string> args = {
        "merge", "--model",  model("llama_gqa"), "--adapters", d.file("run/adapters"),
        "--out", d.file(out)};
    args.insert(args.end(), more.begin(), more.end());
    const CliResult r = run_quanta(args);
    REQUIRE_MESSAGE(r.code == 0, r.err);
  };
  const auto files = [&](const std::string& out) {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(d.file(out)))
      if (e.path().extension() == ".safetensors" || e.path().extension() == ".json")
        names.insert(e.path().filename().string());
    return names;
  };
  merge("one", {});
  merge("shards", {"--max-shard-size", "20KB"});
  CHECK(files("one") == std::set<std::string>{"config.json", "model.safetensors"});
  const std::set<std::string> sharded = files("shards");
  CHECK(sharded.count("model.safetensors.index.json") == 1);
  CHECK(sharded.count("model-00001-of-00005.safetensors") == 1);
  CHECK(sharded.count("model.safetensors") == 0);
  const auto weights = [&](const std::string& out) {
    std::map<std::string, std::vector<float>> w;
    for (const auto& [name, t] : llm::read_model_weights(d.file(out)))
      w[name] = t.to_vector<float>();
    return w;
  };
  CHECK(weights("shards") == weights("one"));
  // inspect lists a folder's shards and their total, the index's.
  const CliResult listed = run_quanta({"inspect", d.file("shards"), "--json"});
  REQUIRE_MESSAGE(listed.code == 0, listed.err);
  const json inspected = json::parse(listed.out);
  const json index = json::parse(std::ifstream(d.file("shards/model.safetensors.index.json")));
  CHECK(inspected["files"].size() == 5);
  CHECK(inspected["total_bytes"] == index["metadata"]["total_size"]);
  CHECK(inspected["total_tensors"] == index["weight_map"].size());
  CHECK(contains(run_quanta({"inspect", d.file("shards")}).out,
                 d.file("shards") + ": 5 weight files, "));
  // Merged again in one file over the sharded folder: no shard is left to
  // be taken for the model's.
  merge("shards", {});
  CHECK(files("shards") == files("one"));

  // --onto float: the float base's weights plus s B A (r 8, alpha 16).
  merge("float", {"--onto", "float"});
  const auto merged = weights("float");
  const auto base = [&] {
    std::map<std::string, Tensor> w;
    for (const auto& [name, t] : llm::read_model_weights(model("llama_gqa"))) w[name] = t;
    return w;
  }();
  const io::SafetensorsFile adapters =
      io::load_safetensors(d.file("run/adapters/adapter_model.safetensors"));
  const auto adapter = [&](const std::string& name) {
    for (const auto& [n, t] : adapters.tensors)
      if (n == "base_model.model." + name) return t;
    FAIL("no adapter tensor " << name);
    return Tensor();
  };
  const std::string layer = "model.layers.1.mlp.up_proj";
  NoGradGuard no_grad;
  const Tensor want =
      base.at(layer + ".weight") +
      matmul(adapter(layer + ".lora_B.weight"), adapter(layer + ".lora_A.weight")) * 2.0;
  const std::vector<float> w = want.to_vector<float>(), got = merged.at(layer + ".weight");
  REQUIRE(w.size() == got.size());
  double worst = 0;
  for (std::size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, double(std::abs(w[i] - got[i])));
  CHECK(worst < 1e-6);
  CHECK(merged.at("model.embed_tokens.weight") ==
        base.at("model.embed_tokens.weight").to_vector<float>());
  // A 4-bit base has no float weights to merge onto.
  check_one_line_error(
      run_quanta({"merge", "--model",
                  quanta::testing::test_data("llm/qlora/transformers_4bit/llama_gqa"), "--adapters",
                  d.file("run/adapters"), "--adapters-any-base", "--out", d.file("f4"), "--onto",
                  "float"}),
      2, "--onto float needs the float base folder");
}

TEST_CASE("finetune --model: text through the folder's tokenizer.model, merged with it") {
  if (!llm::Tokenizer::available("tokenizer.model")) {
    MESSAGE("skipped: quanta was built without libsentencepiece (-Dsentencepiece=disabled)");
    return;
  }
  ScratchDir d("ft_lm_text");
  {
    std::ofstream text(d.file("train.txt"));
    for (int i = 0; i < 200; ++i)
      text << "the quick brown fox jumps over the lazy dog " << i % 7 << "\n";
  }
  const CliResult r =
      run_quanta({"finetune", "--model", model("llama_gqa"), "--data", d.file("train.txt"),
                  "--eval-data", d.file("train.txt"), "--seq-len", "64", "--steps", "20", "--lr",
                  "1e-2", "--out", d.file("run"), "--merge-to", d.file("merged")});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(contains(r.out, "sequences of up to 64 tokens from " + d.file("train.txt")));
  CHECK(std::filesystem::exists(d.file("merged/tokenizer.model")));
  const CliResult e = run_quanta({"eval", "--model", d.file("merged"), "--data",
                                  d.file("train.txt"), "--seq-len", "64", "--json"});
  REQUIRE_MESSAGE(e.code == 0, e.err);
  const double after = std::stod(r.out.substr(r.out.find("eval after fine-tuning: loss ") + 29));
  // eval scores the text's windows without the run's BOS-led ids split: the
  // same ids and windows, so the same loss up to the merge's rounding.
  CHECK(json::parse(e.out)["loss"].get<double>() == doctest::Approx(after).epsilon(1e-4));
  check_one_line_error(
      run_quanta({"finetune", "--model", model("qwen2_bias"), "--data", d.file("train.txt"),
                  "--seq-len", "16", "--out", d.file("run2")}),
      2, "has no tokenizer.model or tokenizer.json to read it with");
}

TEST_CASE("finetune --model: text and prompt-completion pairs through a tokenizer.json") {
  const std::string base = model("qwen2_bpe");
  if (!llm::Tokenizer::available(base + "/tokenizer.json")) {
    MESSAGE("skipped: quanta was built without ICU (-Dicu=disabled)");
    return;
  }
  ScratchDir d("ft_lm_bpe");
  {
    std::ofstream text(d.file("train.txt"));
    for (int i = 0; i < 100; ++i)
      text << "the quick brown fox jumps over the lazy dog " << i % 7 << "\n";
    std::ofstream pairs(d.file("pairs.jsonl"));
    for (int i = 0; i < 16; ++i)
      pairs << R"({"prompt": "<|im_start|>user\nsay )" << i % 5
            << R"(<|im_end|>\n<|im_start|>assistant\n", "completion": "number )" << i % 5
            << "\"}\n";
  }
  const CliResult r =
      run_quanta({"finetune", "--model", base, "--data", d.file("train.txt"), "--eval-data",
                  d.file("train.txt"), "--seq-len", "64", "--steps", "20", "--lr", "1e-2", "--out",
                  d.file("run"), "--merge-to", d.file("merged")});
  REQUIRE_MESSAGE(r.code == 0, r.err);
  CHECK(std::filesystem::exists(d.file("merged/tokenizer.json")));
  const double before = std::stod(r.out.substr(r.out.find("eval before fine-tuning: loss ") + 30));
  const double after = std::stod(r.out.substr(r.out.find("eval after fine-tuning: loss ") + 29));
  CHECK(after < 0.8 * before);
  const CliResult e = run_quanta({"eval", "--model", d.file("merged"), "--data",
                                  d.file("train.txt"), "--seq-len", "64", "--json"});
  REQUIRE_MESSAGE(e.code == 0, e.err);
  CHECK(json::parse(e.out)["loss"].get<double>() == doctest::Approx(after).epsilon(1e-4));
  // Chat-formatted pairs: the special tokens in the prompt are their ids,
  // the completion ends with the tokenizer's EOS (<|im_end|>), and only it
  // is scored.
  const CliResult c = run_quanta({"finetune", "--model", base, "--data", d.file("pairs.jsonl"),
                                  "--train-on-completions-only", "--seq-len", "32", "--steps", "4",
                                  "--out", d.file("run_pairs")});
  REQUIRE_MESSAGE(c.code == 0, c.err);
  const llm::Tokenizer tok(base + "/tokenizer.json");
  CHECK(tok.eos_id() == 2);
  const std::vector<int64_t> prompt = tok.encode("<|im_start|>user\nsay 1<|im_end|>\n", true);
  REQUIRE(prompt.size() > 2);
  CHECK(prompt.front() == 1);  // <|im_start|>, no BOS: Qwen's template has none
  CHECK(std::count(prompt.begin(), prompt.end(), int64_t{2}) == 1);
  // TRL's text lines, packed: each document its text and EOS.
  {
    std::ofstream docs(d.file("docs.jsonl"));
    for (int i = 0; i < 24; ++i)
      docs << R"({"text": "the quick brown fox )" << i % 6 << R"("})"
           << "\n";
  }
  const CliResult t =
      run_quanta({"finetune", "--model", base, "--data", d.file("docs.jsonl"), "--pack",
                  "--seq-len", "32", "--steps", "4", "--out", d.file("run_text")});
  REQUIRE_MESSAGE(t.code == 0, t.err);
}

namespace {
// Sets environment variables for a scope (the quanta processes a test
// starts inherit them), and removes them after.
struct ScopedEnv {
  std::vector<std::string> names;
  explicit ScopedEnv(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const auto& [name, value] : vars) {
      ::setenv(name.c_str(), value.c_str(), 1);
      names.push_back(name);
    }
  }
  ~ScopedEnv() {
    for (const std::string& name : names) ::unsetenv(name.c_str());
  }
};
}  // namespace

TEST_CASE("finetune --model, one epoch: the checkpoint records its step count for restarts") {
  ScratchDir d("ft_lm_epoch");
  llm::write_token_file(d.file("train.bin"), learnable_tokens(600, 1), llm::TokenWidth::u16);
  const int64_t sequences = llm::LmExamples::from_file(d.file("train.bin"), 32, 64).size();
  const int64_t steps = (sequences + 3) / 4;  // batch 4
  REQUIRE(steps > 1);
  const CliResult r = run_quanta(finetune("llama_gqa", d, "run"));  // no --steps: one epoch
  REQUIRE_MESSAGE(r.code == 0, r.err);
  const auto meta = io::read_safetensors_header(d.file("run/checkpoint.safetensors")).metadata;
  CHECK(json::parse(meta.at("config"))["steps"] == steps);
  // A launcher's restart of the job that wrote the folder: the run is
  // complete at that count (a checkpoint short of it would resume).
  train::claim_run(d.file("run"), "job-epoch");
  const ScopedEnv env({{"QUANTA_RESTART_COUNT", "1"},
                       {"QUANTA_MAX_RESTARTS", "1"},
                       {"QUANTA_RUN_ID", "job-epoch"}});
  const CliResult again = run_quanta(finetune("llama_gqa", d, "run"));
  CAPTURE(again.err);
  CHECK(again.code == 0);
  CHECK(contains(again.out, "is complete (its checkpoint is at its last step, " +
                                std::to_string(steps) + "); nothing left to fine-tune"));
}
