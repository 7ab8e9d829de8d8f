#include "document_flags.h"

#include <vector>

#include "commands.h"
#include "llm/model/model_folder.h"

namespace quanta::cli {

namespace {

std::vector<int64_t> ids_of(const std::string& text, const char* flag,
                            const std::string& model_dir) {
  std::vector<int64_t> ids;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    const std::size_t comma = std::min(text.find(',', begin), text.size());
    const std::string entry = text.substr(begin, comma - begin);
    begin = comma + 1;
    if (entry == "bos" || entry == "eos") {
      const std::string key = entry + "_token_id";
      const std::vector<int64_t> named = llm::special_token_ids(model_dir, key);
      if (named.empty())
        throw UsageError(std::string(flag) + " " + entry + ": " + model_dir + " names no " + key +
                         " (give the id)");
      ids.insert(ids.end(), named.begin(), named.end());
      continue;
    }
    std::size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(entry, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (entry.empty() || used != entry.size() || id < 0)
      throw UsageError(std::string(flag) + " \"" + text + "\": \"" + entry +
                       "\" is not a token id, bos or eos");
    ids.push_back(id);
  }
  return ids;
}

}  // namespace

void add_document_flags(CLI::App& sub, DocumentFlags& flags, const std::string& prefix) {
  sub.add_option("--document-start", flags.start,
                 prefix +
                     "token files and text: a document starts at each of these ids (bos: the "
                     "model's bos_token_id; comma-separated), and a window keeps the documents "
                     "in it apart: each attends only to itself, its positions restart at 0, "
                     "its first token is not scored");
  sub.add_option("--document-end", flags.end,
                 prefix +
                     "... or ends with each of these ids (eos: the model's eos_token_id), the "
                     "next document starting after it");
}

llm::DocumentBoundaries document_boundaries(const DocumentFlags& flags,
                                            const std::string& model_dir) {
  llm::DocumentBoundaries d;
  if (!flags.start.empty()) d.start_ids = ids_of(flags.start, "--document-start", model_dir);
  if (!flags.end.empty()) d.end_ids = ids_of(flags.end, "--document-end", model_dir);
  return d;
}

}  // namespace quanta::cli
