// A tokenizer.model through libsentencepiece (built when Meson finds it and
// ICU), with the special tokens transformers splits out of a text first: the
// model's control and unknown pieces (<s>, </s>, <unk>) and the added tokens
// of the tokenizer_config.json beside it.
#include <sentencepiece_processor.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "llm/text/added_tokens.h"
#include "llm/text/token_decoders.h"
#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {
namespace {

// tokenizer_config.json's added_tokens_decoder ({"32000": {"content": ...,
// "lstrip": ..., "special": ...}}), as transformers registers them.
std::vector<AddedToken> configured_added_tokens(const std::filesystem::path& config) {
  std::vector<AddedToken> added;
  if (!std::filesystem::exists(config)) return added;
  std::ifstream in(config);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(config.string() + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("added_tokens_decoder")) return added;
  for (const auto& [key, t] : j.at("added_tokens_decoder").items()) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(key, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != key.size() || !t.is_object() || !t.contains("content") ||
        !t.at("content").is_string())
      throw std::invalid_argument(config.string() + ": added_tokens_decoder entry \"" + key +
                                  "\" is not an id with a content");
    added.push_back({t.at("content").get<std::string>(), id, t.value("lstrip", false),
                     t.value("rstrip", false), t.value("single_word", false),
                     t.value("special", false)});
  }
  return added;
}

class SentencePieceTokenizer : public Tokenizer::Impl {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok())
      throw std::runtime_error(path + ": not a SentencePiece model (" + status.ToString() + ")");
    std::vector<AddedToken> added = configured_added_tokens(
        std::filesystem::path(path).parent_path() / "tokenizer_config.json");
    for (int i = 0; i < sp_.GetPieceSize(); ++i)
      if (sp_.IsControl(i) || sp_.IsUnknown(i))
        added.push_back({sp_.IdToPiece(i), i, false, false, false, true});
    added_ = AddedTokens(std::move(added), path);
    using Kind = TokenDecoder::Kind;
    decoder_ = {
        {Kind::replace, "\u2581", " "}, {Kind::byte_fallback, "", ""}, {Kind::fuse, "", ""}};
    // The model's normalizer adds a word boundary in front of a text (its
    // add_dummy_prefix) when a lone letter encodes with one.
    std::vector<std::string> probe;
    if (sp_.Encode("a", &probe).ok() && !probe.empty() && probe[0].rfind("\u2581", 0) == 0) {
      TokenDecoder strip{Kind::strip, "", " "};
      strip.start = 1;
      decoder_.push_back(strip);
    }
  }
  std::vector<int64_t> encode(const std::string& text,
                              std::vector<TextSegment>* segments) const override {
    return added_.encode(
        text,
        [&](const std::string& stretch, bool first, std::vector<int64_t>& ids) {
          encode_stretch(stretch, first, ids);
        },
        segments);
  }
  // Each stretch between special tokens is encoded as a text of its own, a
  // word boundary first, as transformers' conversion of the model does.
  void encode_stretch(const std::string& stretch, bool, std::vector<int64_t>& ids) const override {
    if (stretch.empty()) return;
    std::vector<int> pieces;
    const auto status = sp_.Encode(stretch, &pieces);
    if (!status.ok())
      throw std::runtime_error(path_ + ": cannot encode (" + status.ToString() + ")");
    ids.insert(ids.end(), pieces.begin(), pieces.end());
  }
  // As transformers' decode(skip_special_tokens=True) through the decoder
  // its conversion of the model gives: special tokens left out, the rest
  // (an added token as its content) with U+2581 as a space, <0xXX> pieces
  // as their bytes, one leading space dropped where encoding adds one.
  // Tokenizer::decode has checked the ids' range.
  std::string decode(const std::vector<int64_t>& ids) const override {
    return decode_tokens(added_.visible_tokens(ids, [&](int64_t id) { return token(id); }),
                         decoder_);
  }
  std::string token(int64_t id) const override {
    if (const AddedToken* added = added_.by_id(id)) return added->content;
    if (id >= sp_.GetPieceSize())
      throw std::invalid_argument(path_ + ": id " + std::to_string(id) +
                                  " is neither a piece of the model nor an added token");
    return sp_.IdToPiece(static_cast<int>(id));
  }
  int64_t vocab_size() const override {
    return std::max<int64_t>(sp_.GetPieceSize(), added_.end_id());
  }
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t eos_id() const override { return sp_.eos_id(); }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  AddedTokens added_;
  std::vector<TokenDecoder> decoder_;
};

}  // namespace

std::unique_ptr<Tokenizer::Impl> sentencepiece_tokenizer(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

bool sentencepiece_available() { return true; }

}  // namespace quanta::llm
