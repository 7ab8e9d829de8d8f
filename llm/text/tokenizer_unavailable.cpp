// Tokenizer in a build without libsentencepiece: every use says how to get it.
#include <stdexcept>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

struct Tokenizer::Impl {};

Tokenizer::Tokenizer(const std::string& path) : path_(path) {
  throw std::runtime_error(path +
                           ": quanta was built without libsentencepiece, so it cannot read a "
                           "tokenizer.model (install libsentencepiece-dev and reconfigure, or "
                           "tokenize ahead of time with tools/tokenize.py)");
}

Tokenizer::~Tokenizer() = default;
std::vector<int64_t> Tokenizer::encode(const std::string&, bool) const { return {}; }
std::string Tokenizer::decode(const std::vector<int64_t>&) const { return {}; }
int64_t Tokenizer::vocab_size() const { return 0; }
int64_t Tokenizer::bos_id() const { return -1; }
int64_t Tokenizer::eos_id() const { return -1; }
bool Tokenizer::available() { return false; }

}  // namespace quanta::llm
