// A build without libsentencepiece or ICU: a tokenizer.model says how to
// get them.
#include <stdexcept>

#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {

std::unique_ptr<Tokenizer::Impl> sentencepiece_tokenizer(const std::string& path) {
  throw std::runtime_error(path +
                           ": quanta was built without libsentencepiece or ICU, so it cannot read "
                           "a tokenizer.model (install libsentencepiece-dev and libicu-dev and "
                           "reconfigure, or "
                           "tokenize ahead of time with tools/tokenize.py)");
}

bool sentencepiece_available() { return false; }

}  // namespace quanta::llm
