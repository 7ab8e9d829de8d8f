// A build without ICU: a tokenizer.json says how to get it.
#include <stdexcept>

#include "llm/text/tokenizer_impl.h"

namespace quanta::llm {

std::unique_ptr<Tokenizer::Impl> json_tokenizer(const std::string& path) {
  throw std::runtime_error(path +
                           ": quanta was built without ICU, so it cannot read a tokenizer.json "
                           "(install libicu-dev and reconfigure, or tokenize ahead of time with "
                           "tools/tokenize.py)");
}

bool json_tokenizer_available() { return false; }

}  // namespace quanta::llm
