// A BPE tokenizer.json as Hugging Face tokenizers runs it: added tokens
// split out of the text, the rest normalized (NFC, Prepend, Replace),
// pre-tokenized (Split by a regular expression, Digits, then ByteLevel or
// Metaspace, or not at all), each pre-token merged by BPE (bpe_model.h), and
// ids decoded through the decoder's steps (token_decoders.h). ICU gives the
// Unicode regular expressions and NFC. What else a tokenizer.json may hold
// (a WordPiece or Unigram model, another normalizer or pre-tokenizer) is
// refused by name.
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "llm/text/added_tokens.h"
#include "llm/text/bpe_model.h"
#include "llm/text/token_decoders.h"
#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenizing expression, which ByteLevel's use_regex applies.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

json read_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    throw std::invalid_argument(path + ": not JSON (" + e.what() + ")");
  }
}

// tokenizers' expressions are Oniguruma's, where \s is Unicode's White_Space
// (with U+000B and U+0085, which ICU's \s leaves out): spelled so for ICU.
std::string icu_pattern(const std::string& pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '\\' || i + 1 == pattern.size()) {
      out += pattern[i];
      continue;
    }
    const char next = pattern[++i];
    if (next == 's')
      out += "\\p{White_Space}";
    else if (next == 'S')
      out += "\\P{White_Space}";
    else
      out += {'\\', next};
  }
  return out;
}

std::string utf8(const icu::UnicodeString& s) {
  std::string out;
  s.toUTF8String(out);
  return out;
}

class JsonTokenizer : public Tokenizer::Impl {
 public:
  explicit JsonTokenizer(const std::string& path) : path_(path) {
    const json j = read_json(path);
    if (!j.is_object()) fail("not a tokenizer.json object");
    read_model(j);
    read_added_tokens(j);
    read_normalizer(j);
    read_pre_tokenizer(j);
    read_decoder(j);
    read_post_processor(j);
    const json config = tokenizer_config();
    apply_tokenizer_class(config);
    read_eos(config);
  }

  std::vector<int64_t> encode(const std::string& text,
                              std::vector<TextSegment>* segments) const override {
    // Metaspace's "first" prefixes the stretch at the text's start alone.
    return added_.encode(
        text,
        [&](const std::string& stretch, bool first, std::vector<int64_t>& ids) {
          encode_segment(stretch, first, ids);
        },
        segments);
  }
  void encode_stretch(const std::string& stretch, bool first,
                      std::vector<int64_t>& ids) const override {
    encode_segment(stretch, first, ids);
  }

  // As tokenizers' decode(skip_special_tokens=True): special tokens left
  // out, the others (added ones as their content) through the decoder.
  // Tokenizer::decode has checked the ids' range.
  std::string decode(const std::vector<int64_t>& ids) const override {
    return decode_tokens(added_.visible_tokens(ids, [&](int64_t id) { return token(id); }),
                         decoder_);
  }

  std::string token(int64_t id) const override {
    if (const AddedToken* added = added_.by_id(id)) return added->content;
    return model_->token_of(id);
  }
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t bos_id() const override { return bos_; }
  int64_t eos_id() const override { return eos_; }

 private:
  struct PreTokenizer {
    std::shared_ptr<icu::RegexPattern> split;  // pieces: the matches and what lies between
    bool byte_level = false;                   // the last step: bytes to byte-level characters
    bool prefix_space = false;                 // ByteLevel's add_prefix_space
    // Metaspace (the last step): spaces to `replacement`, which prefixes
    // every piece (prepend_scheme always) or the text's first (first), and
    // starts each piece when it splits.
    bool metaspace = false, meta_first_only = false, meta_split = false;
    std::string replacement;
    bool meta_prepend = false;
  };
  struct Normalizer {
    enum class Kind { nfc, prepend, replace } kind;
    std::string a, b;  // prepend: a; replace: a by b
  };

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(path_ + ": " + what);
  }

  std::shared_ptr<icu::RegexPattern> compile(const std::string& pattern) const {
    UErrorCode status = U_ZERO_ERROR;
    UParseError where{};
    std::shared_ptr<icu::RegexPattern> p(icu::RegexPattern::compile(
        icu::UnicodeString::fromUTF8(icu_pattern(pattern)), 0, where, status));
    if (U_FAILURE(status))
      fail("the pre-tokenizer's expression " + json(pattern).dump() + " does not compile (" +
           u_errorName(status) + " at offset " + std::to_string(where.offset) + ")");
    return p;
  }

  void read_model(const json& j) {
    if (!j.contains("model") || !j.at("model").is_object()) fail("no \"model\" object");
    const json& m = j.at("model");
    const std::string type = m.value("type", "BPE");
    if (type != "BPE")
      fail("model type \"" + type +
           "\" is not supported (a byte-level BPE; a model with a tokenizer.model is read "
           "through it)");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(key) && !m.at(key).is_null() && m.at(key) != "")
        fail(std::string("model \"") + key + "\" is not supported");
    if (m.contains("dropout") && !m.at("dropout").is_null() && m.at("dropout") != 0)
      fail("model \"dropout\" is not supported (encoding would be random)");
    if (!m.contains("vocab") || !m.at("vocab").is_object()) fail("model has no \"vocab\" object");
    std::unordered_map<std::string, int64_t> vocab;
    for (const auto& [token, id] : m.at("vocab").items()) {
      if (!id.is_number_integer()) fail("vocab entry \"" + token + "\" is not an integer id");
      vocab.emplace(token, id.get<int64_t>());
    }
    std::vector<std::pair<std::string, std::string>> merges;
    if (m.contains("merges")) {
      // Either "a b" strings (tokenizers before 0.20) or [a, b] pairs.
      for (const json& merge : m.at("merges")) {
        if (merge.is_string()) {
          const std::string s = merge.get<std::string>();
          const size_t space = s.find(' ', 1);
          if (space == std::string::npos) fail("merge \"" + s + "\" is not two tokens");
          merges.emplace_back(s.substr(0, space), s.substr(space + 1));
        } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
                   merge[1].is_string()) {
          merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
        } else {
          fail("merge " + merge.dump() + " is neither \"a b\" nor [\"a\", \"b\"]");
        }
      }
    }
    BpeUnknowns unknowns;
    unknowns.byte_fallback = m.value("byte_fallback", false);
    unknowns.fuse_unk = m.value("fuse_unk", false);
    if (m.contains("unk_token") && m.at("unk_token").is_string()) {
      const auto it = vocab.find(m.at("unk_token").get<std::string>());
      if (it == vocab.end()) fail("unk_token is not in the vocabulary");
      unknowns.unk_id = it->second;
    }
    model_ = std::make_unique<BpeModel>(std::move(vocab), merges, m.value("ignore_merges", false),
                                        unknowns, path_);
    vocab_size_ = model_->size();
  }

  void read_added_tokens(const json& j) {
    if (!j.contains("added_tokens")) return;
    std::vector<AddedToken> added;
    for (const json& t : j.at("added_tokens")) {
      if (!t.is_object() || !t.contains("content") || !t.contains("id"))
        fail("an added token lacks its content or id: " + t.dump());
      added.push_back({t.at("content").get<std::string>(), t.at("id").get<int64_t>(),
                       t.value("lstrip", false), t.value("rstrip", false),
                       t.value("single_word", false), t.value("special", false)});
    }
    added_ = AddedTokens(std::move(added), path_);
    vocab_size_ = std::max(vocab_size_, added_.end_id());
  }

  // NFC, Prepend and Replace (of a String), alone or in a Sequence.
  void read_normalizer(const json& j) {
    if (!j.contains("normalizer") || j.at("normalizer").is_null()) return;
    std::vector<json> steps{j.at("normalizer")};
    if (steps[0].value("type", "") == "Sequence")
      steps = steps[0].at("normalizers").get<std::vector<json>>();
    for (const json& n : steps) {
      const std::string type = n.value("type", "");
      if (type == "NFC") {
        UErrorCode status = U_ZERO_ERROR;
        nfc_ = icu::Normalizer2::getNFCInstance(status);
        if (U_FAILURE(status))
          fail(std::string("ICU has no NFC normalizer: ") + u_errorName(status));
        normalizers_.push_back({Normalizer::Kind::nfc, "", ""});
      } else if (type == "Prepend") {
        normalizers_.push_back({Normalizer::Kind::prepend, n.at("prepend").get<std::string>(), ""});
      } else if (type == "Replace" && n.at("pattern").contains("String")) {
        normalizers_.push_back({Normalizer::Kind::replace,
                                n.at("pattern").at("String").get<std::string>(),
                                n.at("content").get<std::string>()});
      } else {
        fail("normalizer " + n.dump().substr(0, 120) +
             " is not supported (NFC, Prepend, Replace of a String)");
      }
    }
  }

  void read_pre_tokenizer(const json& j) {
    const json none;
    const json& p = j.contains("pre_tokenizer") ? j.at("pre_tokenizer") : none;
    std::vector<json> steps;
    if (p.is_object() && p.value("type", "") == "Sequence")
      for (const json& s : p.at("pretokenizers")) steps.push_back(s);
    else if (p.is_object())
      steps.push_back(p);
    for (size_t i = 0; i < steps.size(); ++i) {
      const json& s = steps[i];
      const std::string type = s.value("type", "");
      PreTokenizer step;
      if (type == "Split") {
        if (s.value("behavior", "") != "Isolated" || s.value("invert", false))
          fail("a Split pre-tokenizer other than behavior Isolated, invert false is not supported");
        const json& pattern = s.at("pattern");
        if (pattern.contains("Regex"))
          step.split = compile(pattern.at("Regex").get<std::string>());
        else
          fail("a Split pre-tokenizer by a String pattern is not supported (a Regex is)");
      } else if (type == "Digits") {
        step.split = compile(s.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
      } else if (type == "ByteLevel") {
        if (i + 1 != steps.size()) fail("ByteLevel must be the last pre-tokenizer");
        step.byte_level = true;
        step.prefix_space = s.value("add_prefix_space", false);
        if (s.value("use_regex", true)) step.split = compile(kGpt2Pattern);
      } else if (type == "Metaspace") {
        if (i + 1 != steps.size()) fail("Metaspace must be the last pre-tokenizer");
        step.metaspace = true;
        step.replacement = s.value("replacement", "\u2581");
        // prepend_scheme, or before it add_prefix_space (true: always).
        const std::string scheme = s.contains("prepend_scheme")
                                       ? s.at("prepend_scheme").get<std::string>()
                                       : (s.value("add_prefix_space", true) ? "always" : "never");
        if (scheme != "always" && scheme != "first" && scheme != "never")
          fail("Metaspace prepend_scheme \"" + scheme + "\" is not always, first or never");
        step.meta_prepend = scheme != "never";
        step.meta_first_only = scheme == "first";
        step.meta_split = s.value("split", true);
      } else {
        fail("pre-tokenizer \"" + type +
             "\" is not supported (Split, Digits, ByteLevel and Metaspace)");
      }
      pre_.push_back(std::move(step));
    }
    byte_level_ = !pre_.empty() && pre_.back().byte_level;
  }

  // ByteLevel, or SentencePiece's Replace, ByteFallback, Fuse, Strip and
  // Metaspace, alone or in a Sequence; none: a byte-level model's ByteLevel.
  void read_decoder(const json& j) {
    using Kind = TokenDecoder::Kind;
    if (!j.contains("decoder") || j.at("decoder").is_null()) {
      if (!byte_level_) fail("no decoder (and no ByteLevel pre-tokenizer to decode as)");
      decoder_.push_back({Kind::byte_level, "", ""});
      return;
    }
    std::vector<json> steps{j.at("decoder")};
    if (steps[0].value("type", "") == "Sequence")
      steps = steps[0].at("decoders").get<std::vector<json>>();
    for (const json& d : steps) {
      const std::string type = d.value("type", "");
      TokenDecoder step{Kind::fuse, "", ""};
      if (type == "ByteLevel") {
        step.kind = Kind::byte_level;
      } else if (type == "Replace" && d.at("pattern").contains("String")) {
        step.kind = Kind::replace;
        step.pattern = d.at("pattern").at("String").get<std::string>();
        step.content = d.at("content").get<std::string>();
      } else if (type == "ByteFallback") {
        step.kind = Kind::byte_fallback;
      } else if (type == "Fuse") {
        step.kind = Kind::fuse;
      } else if (type == "Strip") {
        step.kind = Kind::strip;
        step.content = d.at("content").get<std::string>();
        step.start = d.value("start", int64_t{0});
        step.stop = d.value("stop", int64_t{0});
      } else if (type == "Metaspace") {
        step.kind = Kind::metaspace;
        step.pattern = d.value("replacement", "\u2581");
        const std::string scheme = d.contains("prepend_scheme")
                                       ? d.at("prepend_scheme").get<std::string>()
                                       : (d.value("add_prefix_space", true) ? "always" : "never");
        step.prepend = scheme != "never";
      } else {
        fail("decoder \"" + type +
             "\" is not supported (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace)");
      }
      decoder_.push_back(step);
    }
  }

  // The BOS a document starts with: the first special token of the
  // post-processor's single template (Llama 3's <|begin_of_text|>), none
  // when there is no template (Qwen2's ByteLevel post-processor).
  void read_post_processor(const json& j) {
    if (!j.contains("post_processor") || j.at("post_processor").is_null()) return;
    std::vector<json> processors{j.at("post_processor")};
    if (processors[0].value("type", "") == "Sequence")
      processors = processors[0].at("processors").get<std::vector<json>>();
    for (const json& p : processors) {
      if (p.value("type", "") != "TemplateProcessing") continue;
      const json& single = p.at("single");
      if (single.empty() || !single[0].contains("SpecialToken")) return;
      const std::string name = single[0]["SpecialToken"].value("id", "");
      const json& specials = p.at("special_tokens");
      if (!specials.contains(name) || specials[name].at("ids").size() != 1)
        fail("post_processor's template starts with " + json(name).dump() +
             ", which its special_tokens do not give one id");
      bos_ = specials[name]["ids"][0].get<int64_t>();
    }
  }

  // The tokenizer_config.json beside the file; null when there is none.
  json tokenizer_config() const {
    const auto config = std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
    return std::filesystem::exists(config) ? read_json(config.string()) : json();
  }

  // transformers 5 loads a folder through its tokenizer_class, and a class
  // of its own (LlamaTokenizer) takes only the vocabulary, merges and
  // post-processor from a tokenizer.json that is not byte-level: the text
  // goes through the class's Metaspace instead of the file's normalizer,
  // which changes the ids after a special token written in the text (a chat
  // template's <s>[INST]) and of leading spaces. A byte-level file is read
  // as it is (transformers falls back to the file too).
  void apply_tokenizer_class(const json& config) {
    if (!config.is_object() || byte_level_) return;
    const std::string cls = config.value("tokenizer_class", "");
    if (cls != "LlamaTokenizer" && cls != "LlamaTokenizerFast") return;
    const auto flag = [&](const char* key, bool otherwise) {
      const json& v = config.contains(key) ? config.at(key) : json();
      return v.is_boolean() ? v.get<bool>() : otherwise;
    };
    // LlamaTokenizer's defaults: add_prefix_space true, legacy false.
    const bool prefix = flag("add_prefix_space", true), legacy = flag("legacy", false);
    normalizers_.clear();
    PreTokenizer meta;
    meta.metaspace = true;
    meta.replacement = "\u2581";
    meta.meta_prepend = prefix;
    meta.meta_first_only = !legacy;
    meta.meta_split = false;
    pre_ = {meta};
    using Kind = TokenDecoder::Kind;
    decoder_ = {
        {Kind::replace, "\u2581", " "}, {Kind::byte_fallback, "", ""}, {Kind::fuse, "", ""}};
    if (prefix) {
      TokenDecoder strip{Kind::strip, "", " "};
      strip.start = 1;
      decoder_.push_back(strip);
    }
  }

  // The EOS: tokenizer_config.json's eos_token beside the file, else
  // config.json's eos_token_id (its first), else none.
  void read_eos(const json& c) {
    const std::filesystem::path dir = std::filesystem::path(path_).parent_path();
    const auto config = dir / "tokenizer_config.json";
    if (c.is_object()) {
      json e = c.contains("eos_token") ? c.at("eos_token") : json();
      if (e.is_object()) e = e.value("content", json());
      if (e.is_string()) {
        const std::string name = e.get<std::string>();
        for (const AddedToken& a : added_.tokens())
          if (a.content == name) eos_ = a.id;
        if (eos_ < 0) eos_ = model_->id_of(name);
        if (eos_ < 0)
          throw std::invalid_argument(config.string() + ": eos_token " + e.dump() +
                                      " is not a token of " + path_);
        return;
      }
    }
    const auto model_config = dir / "config.json";
    if (std::filesystem::exists(model_config)) {
      const json c = read_json(model_config.string());
      const json e = c.contains("eos_token_id") ? c.at("eos_token_id") : json();
      if (e.is_number_integer()) eos_ = e.get<int64_t>();
      if (e.is_array() && !e.empty() && e[0].is_number_integer()) eos_ = e[0].get<int64_t>();
    }
  }

  // Runs pre-tokenizer `step` and those after it over `piece`, then BPE over
  // each pre-token, one piece at a time (a corpus's pieces are never all
  // held). A Split keeps the matches and the text between them (tokenizers'
  // Isolated). `first`: the piece starts the text.
  void pre_tokenize(const icu::UnicodeString& piece, size_t step, bool first,
                    std::vector<int64_t>& ids) const {
    if (step == pre_.size()) {
      std::string word = utf8(piece);
      if (byte_level_) {
        const auto& chars = byte_level_chars();
        std::string mapped;
        for (const char b : word) mapped += chars[static_cast<unsigned char>(b)];
        word = std::move(mapped);
      }
      model_->encode(word, ids);
      return;
    }
    const PreTokenizer& s = pre_[step];
    icu::UnicodeString p = piece;
    if (s.metaspace) {
      const icu::UnicodeString mark = icu::UnicodeString::fromUTF8(s.replacement);
      p.findAndReplace(icu::UnicodeString(u" "), mark);
      if (s.meta_prepend && (first || !s.meta_first_only) && !p.startsWith(mark)) p.insert(0, mark);
      if (!s.meta_split) {
        pre_tokenize(p, step + 1, first, ids);
        return;
      }
      // Each piece starts at a mark (tokenizers' MergedWithNext).
      int32_t begin = 0;
      for (int32_t at = p.indexOf(mark, 1); at >= 0; at = p.indexOf(mark, at + 1)) {
        pre_tokenize(icu::UnicodeString(p, begin, at - begin), step + 1, first && begin == 0, ids);
        begin = at;
      }
      pre_tokenize(icu::UnicodeString(p, begin), step + 1, first && begin == 0, ids);
      return;
    }
    if (s.prefix_space && !p.startsWith(icu::UnicodeString(u" "))) p.insert(0, u' ');
    if (!s.split) {
      pre_tokenize(p, step + 1, first, ids);
      return;
    }
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(s.split->matcher(p, status));
    if (U_FAILURE(status))
      throw std::runtime_error(std::string("ICU regex matcher: ") + u_errorName(status));
    int32_t last = 0;
    while (m->find(status)) {
      const int32_t b = m->start(status), e = m->end(status);
      if (e == b) continue;
      if (b > last)
        pre_tokenize(icu::UnicodeString(p, last, b - last), step + 1, first && last == 0, ids);
      pre_tokenize(icu::UnicodeString(p, b, e - b), step + 1, first && b == 0, ids);
      last = e;
    }
    if (last < p.length())
      pre_tokenize(icu::UnicodeString(p, last), step + 1, first && last == 0, ids);
  }

  void encode_segment(const std::string& segment, bool first, std::vector<int64_t>& ids) const {
    if (segment.empty()) return;
    std::string text = segment;
    for (const Normalizer& n : normalizers_) {
      if (n.kind == Normalizer::Kind::nfc) {
        UErrorCode status = U_ZERO_ERROR;
        const icu::UnicodeString u = nfc_->normalize(icu::UnicodeString::fromUTF8(text), status);
        if (U_FAILURE(status)) throw std::runtime_error(std::string("NFC: ") + u_errorName(status));
        text = utf8(u);
      } else if (n.kind == Normalizer::Kind::prepend) {
        if (!text.empty()) text = n.a + text;
      } else {
        for (size_t at = text.find(n.a); !n.a.empty() && at != std::string::npos;
             at = text.find(n.a, at + n.b.size()))
          text.replace(at, n.a.size(), n.b);
      }
    }
    pre_tokenize(icu::UnicodeString::fromUTF8(text), 0, first, ids);
  }

  std::string path_;
  std::unique_ptr<BpeModel> model_;
  int64_t vocab_size_ = 0;
  AddedTokens added_;
  const icu::Normalizer2* nfc_ = nullptr;  // ICU's, not owned
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_;
  bool byte_level_ = false;  // pre-tokens in GPT-2's byte-level characters
  std::vector<TokenDecoder> decoder_;
  int64_t bos_ = -1, eos_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer::Impl> json_tokenizer(const std::string& path) {
  try {
    return std::make_unique<JsonTokenizer>(path);
  } catch (const json::exception& e) {
    // A key of the wrong type or shape: which file, and nlohmann's account.
    throw std::invalid_argument(path + ": not a tokenizer.json quanta reads (" + e.what() + ")");
  }
}

bool json_tokenizer_available() { return true; }

}  // namespace quanta::llm
