#pragma once
// --document-start and --document-end of quanta finetune --model and quanta
// eval --model: the ids that mark where the documents of a token stream (a
// token file, a text) meet, so that a window holding the end of one and the
// start of the next keeps them apart (llm::DocumentBoundaries).
#include <CLI/CLI.hpp>
#include <string>

#include "llm/data/lm_examples.h"

namespace quanta::cli {

struct DocumentFlags {
  std::string start, end;  // as written: ids and bos/eos, comma-separated
  bool any() const { return !start.empty() || !end.empty(); }
};

/** Adds --document-start and --document-end to `sub`; `prefix` starts their
 * help texts ("--model: "). */
void add_document_flags(CLI::App& sub, DocumentFlags& flags, const std::string& prefix = "");

/** The boundaries the flags name: whole numbers, `bos` (the bos_token_id of
 * model folder `model_dir`) and `eos` (its eos_token_id, every id of a
 * list). A UsageError names the flag and the entry that is not an id, or
 * the folder that names no such token. */
llm::DocumentBoundaries document_boundaries(const DocumentFlags& flags,
                                            const std::string& model_dir);

}  // namespace quanta::cli
