// Tokenizer: the file's kind chooses the implementation (tokenizer_impl.h).
#include "llm/text/tokenizer.h"

#include <filesystem>
#include <stdexcept>

#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {
namespace {

bool is_json(const std::string& path) { return std::filesystem::path(path).extension() == ".json"; }

}  // namespace

Tokenizer::Tokenizer(const std::string& path)
    : path_(path), impl_(is_json(path) ? json_tokenizer(path) : sentencepiece_tokenizer(path)) {}

Tokenizer::~Tokenizer() = default;

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_bos,
                                       std::vector<TextSegment>* segments) const {
  std::vector<int64_t> ids;
  if (add_bos && impl_->bos_id() >= 0) ids.push_back(impl_->bos_id());
  const std::size_t before = segments ? segments->size() : 0;
  const std::vector<int64_t> body = impl_->encode(text, segments);
  if (segments)
    for (std::size_t k = before; k < segments->size(); ++k) (*segments)[k].first_id += ids.size();
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::vector<int64_t> Tokenizer::encode_stretch(const std::string& stretch, bool first) const {
  std::vector<int64_t> ids;
  impl_->encode_stretch(stretch, first, ids);
  return ids;
}

namespace {

// Every id a tokenizer is asked to name lies in its vocabulary.
void check_id(int64_t id, int64_t vocab_size, const std::string& path) {
  if (id < 0 || id >= vocab_size)
    throw std::invalid_argument(path + ": id " + std::to_string(id) +
                                " is outside the tokenizer's " + std::to_string(vocab_size) +
                                " tokens");
}

}  // namespace

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  for (const int64_t id : ids) check_id(id, impl_->vocab_size(), path_);
  return impl_->decode(ids);
}
std::string Tokenizer::token(int64_t id) const {
  check_id(id, impl_->vocab_size(), path_);
  return impl_->token(id);
}
int64_t Tokenizer::vocab_size() const { return impl_->vocab_size(); }
int64_t Tokenizer::bos_id() const { return impl_->bos_id(); }
int64_t Tokenizer::eos_id() const { return impl_->eos_id(); }

bool Tokenizer::available(const std::string& path) {
  return is_json(path) ? json_tokenizer_available() : sentencepiece_available();
}

std::string tokenizer_model_in(const std::string& dir) {
  const auto json_path = (std::filesystem::path(dir) / "tokenizer.json").string();
  const auto model_path = (std::filesystem::path(dir) / "tokenizer.model").string();
  const bool has_json = std::filesystem::exists(json_path);
  const bool has_model = std::filesystem::exists(model_path);
  if (!has_model) return has_json ? json_path : std::string();
  if (!has_json || !json_tokenizer_available()) return model_path;
  // Both: transformers reads the tokenizer.json. One this build refuses (a
  // model or step it does not run) leaves the tokenizer.model to read.
  try {
    (void)json_tokenizer(json_path);
    return json_path;
  } catch (const std::invalid_argument&) {
    return model_path;
  }
}

}  // namespace quanta::llm
