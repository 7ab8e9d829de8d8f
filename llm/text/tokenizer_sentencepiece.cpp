// A tokenizer.model through libsentencepiece (built when Meson finds it).
#include <sentencepiece_processor.h>

#include <stdexcept>

#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {
namespace {

class SentencePieceTokenizer : public Tokenizer::Impl {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok())
      throw std::runtime_error(path + ": not a SentencePiece model (" + status.ToString() + ")");
  }
  std::vector<int64_t> encode(const std::string& text) const override {
    std::vector<int> pieces;
    const auto status = sp_.Encode(text, &pieces);
    if (!status.ok())
      throw std::runtime_error(path_ + ": cannot encode (" + status.ToString() + ")");
    return std::vector<int64_t>(pieces.begin(), pieces.end());
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::vector<int> pieces;
    const int n = sp_.GetPieceSize();
    for (int64_t id : ids) {
      if (id < 0 || id >= n)
        throw std::invalid_argument(path_ + ": id " + std::to_string(id) +
                                    " is outside the tokenizer's " + std::to_string(n) + " pieces");
      pieces.push_back(static_cast<int>(id));
    }
    std::string text;
    const auto status = sp_.Decode(pieces, &text);
    if (!status.ok())
      throw std::runtime_error(path_ + ": cannot decode (" + status.ToString() + ")");
    return text;
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t eos_id() const override { return sp_.eos_id(); }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer::Impl> sentencepiece_tokenizer(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

bool sentencepiece_available() { return true; }

}  // namespace quanta::llm
