// Tokenizer on libsentencepiece (built when Meson finds it).
#include <sentencepiece_processor.h>

#include <stdexcept>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

struct Tokenizer::Impl {
  sentencepiece::SentencePieceProcessor sp;
};

Tokenizer::Tokenizer(const std::string& path) : path_(path), impl_(std::make_unique<Impl>()) {
  const auto status = impl_->sp.Load(path);
  if (!status.ok())
    throw std::runtime_error(path + ": not a SentencePiece model (" + status.ToString() + ")");
}

Tokenizer::~Tokenizer() = default;

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_bos) const {
  std::vector<int> pieces;
  const auto status = impl_->sp.Encode(text, &pieces);
  if (!status.ok()) throw std::runtime_error(path_ + ": cannot encode (" + status.ToString() + ")");
  std::vector<int64_t> ids;
  ids.reserve(pieces.size() + 1);
  if (add_bos && impl_->sp.bos_id() >= 0) ids.push_back(impl_->sp.bos_id());
  for (int p : pieces) ids.push_back(p);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<int> pieces;
  const int n = impl_->sp.GetPieceSize();
  for (int64_t id : ids) {
    if (id < 0 || id >= n)
      throw std::invalid_argument(path_ + ": id " + std::to_string(id) +
                                  " is outside the tokenizer's " + std::to_string(n) + " pieces");
    pieces.push_back(static_cast<int>(id));
  }
  std::string text;
  const auto status = impl_->sp.Decode(pieces, &text);
  if (!status.ok()) throw std::runtime_error(path_ + ": cannot decode (" + status.ToString() + ")");
  return text;
}

int64_t Tokenizer::vocab_size() const { return impl_->sp.GetPieceSize(); }
int64_t Tokenizer::bos_id() const { return impl_->sp.bos_id(); }
int64_t Tokenizer::eos_id() const { return impl_->sp.eos_id(); }
bool Tokenizer::available() { return true; }

}  // namespace quanta::llm
