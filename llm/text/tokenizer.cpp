// Tokenizer: the file's kind chooses the implementation (tokenizer_impl.h).
#include "llm/text/tokenizer.h"

#include <filesystem>

#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {
namespace {

bool is_json(const std::string& path) { return std::filesystem::path(path).extension() == ".json"; }

}  // namespace

Tokenizer::Tokenizer(const std::string& path)
    : path_(path), impl_(is_json(path) ? json_tokenizer(path) : sentencepiece_tokenizer(path)) {}

Tokenizer::~Tokenizer() = default;

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_bos) const {
  std::vector<int64_t> ids;
  if (add_bos && impl_->bos_id() >= 0) ids.push_back(impl_->bos_id());
  const std::vector<int64_t> body = impl_->encode(text);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const { return impl_->decode(ids); }
int64_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }
int64_t Tokenizer::bos_id() const { return impl_->bos_id(); }
int64_t Tokenizer::eos_id() const { return impl_->eos_id(); }

bool Tokenizer::available(const std::string& path) {
  return is_json(path) ? json_tokenizer_available() : sentencepiece_available();
}

std::string tokenizer_model_in(const std::string& dir) {
  for (const char* name : {"tokenizer.model", "tokenizer.json"}) {
    const auto p = std::filesystem::path(dir) / name;
    if (std::filesystem::exists(p)) return p.string();
  }
  return {};
}

}  // namespace quanta::llm
