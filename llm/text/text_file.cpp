#include <fstream>
#include <sstream>
#include <stdexcept>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

std::vector<int64_t> encode_text_file(const std::string& path, const std::string& model_dir) {
  const std::string model = tokenizer_model_in(model_dir);
  if (model.empty())
    throw std::invalid_argument(path + " is text, and " + model_dir +
                                " has no tokenizer.model or tokenizer.json to read it with "
                                "(tokenize it with its tokenizer into a token file, e.g. "
                                "tools/tokenize.py)");
  const Tokenizer tokenizer(model);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  return tokenizer.encode(text.str(), true);
}

}  // namespace quanta::llm
