#include "llm/data/lm_examples.h"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include "engine/factory.h"

namespace quanta::llm {

namespace {

// Scored next-token predictions of one example: labels at 1..n-1 that are
// not ignored.
int64_t scored_in(const std::vector<int64_t>& labels) {
  int64_t n = 0;
  for (std::size_t i = 1; i < labels.size(); ++i) n += labels[i] != kIgnoreIndex;
  return n;
}

bool holds(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

// Whether token i of `ids` starts a document `d` marks, `before` the id
// ahead of ids[0] (-1: none).
bool starts_document(const int64_t* ids, int64_t i, int64_t before, const DocumentBoundaries& d) {
  const int64_t previous = i > 0 ? ids[i - 1] : before;
  return holds(d.start_ids, ids[i]) || (previous >= 0 && holds(d.end_ids, previous));
}

// Splits window `ids` [n] into the documents `d` marks: positions restart at
// 0 where one starts (and at the window's first token), and the first
// token of a document is not scored. Either output may be null. Returns the
// predictions scored: positions 1..n-1 that start no document.
int64_t split_documents(const int64_t* ids, int64_t n, const DocumentBoundaries& d, int64_t* labels,
                        int64_t* positions) {
  int64_t scored = 0, p = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool starts = i == 0 || starts_document(ids, i, -1, d);
    p = starts ? 0 : p + 1;
    if (positions) positions[i] = p;
    if (i == 0) continue;
    if (!starts)
      ++scored;
    else if (labels)
      labels[i] = kIgnoreIndex;
  }
  return scored;
}

void check_boundary_ids(const DocumentBoundaries& d, int64_t vocab_size) {
  for (const std::vector<int64_t>* ids : {&d.start_ids, &d.end_ids})
    for (int64_t id : *ids)
      if (id < 0 || (vocab_size > 0 && id >= vocab_size))
        throw std::invalid_argument(
            "document " + std::string(ids == &d.start_ids ? "start" : "end") + " id " +
            std::to_string(id) + " is outside the vocabulary of " + std::to_string(vocab_size));
}

std::string ids_text(const std::vector<int64_t>& ids) {
  std::string s;
  for (int64_t id : ids) s += (s.empty() ? "" : ",") + std::to_string(id);
  return s;
}

std::vector<int64_t> host_rows(const Tensor& rows) {
  return rows.to(Device::cpu()).to(DType::i64).contiguous().to_vector<int64_t>();
}

}  // namespace

LmExamples LmExamples::from_token_file(const std::string& path, int64_t seq_len, int64_t vocab_size,
                                       const DocumentBoundaries& documents) {
  check_boundary_ids(documents, vocab_size);
  if (seq_len < 2) throw std::invalid_argument("sequence length must be at least 2");
  LmExamples e;
  e.path_ = path;
  e.seq_len_ = seq_len;
  e.vocab_size_ = vocab_size;
  e.tokens_ = std::make_shared<TokenFile>(path);
  e.windows_ = e.tokens_->size() / seq_len;
  if (e.windows_ == 0)
    throw std::runtime_error(path + ": " + std::to_string(e.tokens_->size()) +
                             " tokens, fewer than one sequence of " + std::to_string(seq_len));
  e.split_windows(documents);
  return e;
}

LmExamples LmExamples::from_ids(std::vector<int64_t> ids, const std::string& source,
                                int64_t seq_len, int64_t vocab_size,
                                const DocumentBoundaries& documents) {
  if (seq_len < 2) throw std::invalid_argument("sequence length must be at least 2");
  check_boundary_ids(documents, vocab_size);
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || (vocab_size > 0 && ids[i] >= vocab_size))
      throw std::runtime_error(source + ": token " + std::to_string(i) + " is id " +
                               std::to_string(ids[i]) + ", outside the vocabulary of " +
                               std::to_string(vocab_size));
  LmExamples e;
  e.path_ = source;
  e.seq_len_ = seq_len;
  e.vocab_size_ = vocab_size;
  e.windows_ = static_cast<int64_t>(ids.size()) / seq_len;
  if (e.windows_ == 0)
    throw std::runtime_error(source + ": " + std::to_string(ids.size()) +
                             " tokens, fewer than one sequence of " + std::to_string(seq_len));
  e.ids_ = std::move(ids);
  e.split_windows(documents);
  return e;
}

void LmExamples::split_windows(const DocumentBoundaries& documents) {
  if (!documents.any()) return;
  documents_in_windows_ = documents;
  // Every window read once, in runs of windows: its scored predictions, and
  // the documents the marks make (each window's first token starts one
  // only where marked, or at the stream's start).
  const int64_t run = std::max<int64_t>(1, (int64_t(1) << 20) / seq_len_);
  int64_t before = -1, marked = 0;
  bool first_marked = false;
  for (int64_t w0 = 0; w0 < windows_; w0 += run) {
    const int64_t n = std::min(run, windows_ - w0);
    const std::vector<int64_t> ids = tokens_
                                         ? tokens_->read(w0 * seq_len_, n * seq_len_, vocab_size_)
                                         : std::vector<int64_t>(ids_.begin() + w0 * seq_len_,
                                                                ids_.begin() + (w0 + n) * seq_len_);
    for (int64_t w = 0; w < n; ++w) {
      const int64_t* at = ids.data() + w * seq_len_;
      const int64_t scored = split_documents(at, seq_len_, documents, nullptr, nullptr);
      scored_.push_back(scored);
      const bool head = starts_document(at, 0, before, documents);
      if (w0 + w == 0) first_marked = head;
      marked += seq_len_ - 1 - scored + head;
      before = at[seq_len_ - 1];
    }
  }
  // A stream that does not start with a mark starts a document all the same.
  documents_ = marked + !first_marked;
  if (marked == 0)
    throw std::runtime_error(path_ + ": no token in its " + std::to_string(windows_ * seq_len_) +
                             " windowed tokens marks a document boundary (start ids {" +
                             ids_text(documents.start_ids) + "}, end ids {" +
                             ids_text(documents.end_ids) +
                             "}): are these the ids the data was made with?");
}

LmExamples LmExamples::from_jsonl(const std::string& path, int64_t seq_len, int64_t vocab_size,
                                  const LmDataOptions& options) {
  if (seq_len < 2) throw std::invalid_argument("sequence length must be at least 2");
  LmExamples e;
  e.path_ = path;
  e.seq_len_ = seq_len;
  e.vocab_size_ = vocab_size;
  e.examples_ =
      read_token_jsonl(path, {.vocab_size = vocab_size, .max_length = 0}, options.prompts);
  e.documents_ = static_cast<int64_t>(e.examples_.size());
  for (std::size_t i = 0; i < e.examples_.size(); ++i) {
    TokenExample& x = e.examples_[i];
    if (static_cast<int64_t>(x.input_ids.size()) > seq_len)
      throw std::runtime_error(path + ": example " + std::to_string(i + 1) + " has " +
                               std::to_string(x.input_ids.size()) +
                               " tokens, more than the sequence length " + std::to_string(seq_len) +
                               " (raise --seq-len or split it)");
    if (x.labels.empty()) x.labels = x.input_ids;
  }
  if (options.pack) e.pack();
  int64_t total = 0;
  for (const TokenExample& x : e.examples_) {
    e.scored_.push_back(scored_in(x.labels));
    total += e.scored_.back();
  }
  if (total == 0)
    throw std::runtime_error(path +
                             ": no example has a scored token (every label is -100, or "
                             "every example is one token long)");
  return e;
}

void LmExamples::pack() {
  std::vector<TokenExample> rows;
  for (TokenExample& x : examples_) {
    const int64_t n = static_cast<int64_t>(x.input_ids.size());
    if (rows.empty() || int64_t(rows.back().input_ids.size()) + n > seq_len_) {
      rows.emplace_back();
      positions_.emplace_back();
    }
    TokenExample& row = rows.back();
    // The first token of an example is not predicted from the example before.
    x.labels[0] = kIgnoreIndex;
    row.input_ids.insert(row.input_ids.end(), x.input_ids.begin(), x.input_ids.end());
    row.labels.insert(row.labels.end(), x.labels.begin(), x.labels.end());
    for (int64_t p = 0; p < n; ++p) positions_.back().push_back(p);
  }
  examples_ = std::move(rows);
}

LmExamples LmExamples::from_file(const std::string& path, int64_t seq_len, int64_t vocab_size,
                                 const LmDataOptions& options) {
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".json") {
    if (options.documents.any())
      throw std::invalid_argument(path +
                                  " is JSONL, one example a line: document boundaries are for "
                                  "token streams");
    return from_jsonl(path, seq_len, vocab_size, options);
  }
  if (options.pack)
    throw std::invalid_argument(path +
                                " is a token file, cut into full windows already: packing is "
                                "for JSONL examples");
  if (options.prompts.completions_only)
    throw std::invalid_argument(path +
                                " is a token file: training on completions only needs JSONL "
                                "lines with a prompt and a completion");
  if (options.prompts.assistant_only)
    throw std::invalid_argument(path +
                                " is a token file: the assistant-only loss needs JSONL "
                                "conversations");
  return from_token_file(path, seq_len, vocab_size, options.documents);
}

bool LmExamples::windowed() const { return tokens_ || !ids_.empty(); }

int64_t LmExamples::size() const {
  return windowed() ? windows_ : static_cast<int64_t>(examples_.size());
}

LmBatch LmExamples::batch(const Tensor& rows, Device device) const {
  const std::vector<int64_t> r = host_rows(rows);
  const int64_t n = static_cast<int64_t>(r.size());
  int64_t length = 0;
  for (int64_t i : r) {
    if (i < 0 || i >= size())
      throw std::out_of_range(path_ + ": example " + std::to_string(i) + " of " +
                              std::to_string(size()));
    length =
        std::max<int64_t>(length, windowed() ? seq_len_ : int64_t(examples_[i].input_ids.size()));
  }
  std::vector<int64_t> ids(static_cast<std::size_t>(n * length), 0);
  std::vector<int64_t> labels(static_cast<std::size_t>(n * length), kIgnoreIndex);
  std::vector<int64_t> positions(has_position_ids() ? ids.size() : 0);
  LmBatch b;
  for (int64_t k = 0; k < n; ++k) {
    const std::size_t at = static_cast<std::size_t>(k * length);
    b.lengths.push_back(windowed() ? seq_len_
                                   : int64_t(examples_[std::size_t(r[k])].input_ids.size()));
    if (windowed()) {
      const std::vector<int64_t> w = window(r[k]);
      std::copy(w.begin(), w.end(), ids.begin() + at);
      std::copy(w.begin(), w.end(), labels.begin() + at);
      if (documents_in_windows_.any())
        b.scored_tokens += split_documents(w.data(), seq_len_, documents_in_windows_,
                                           labels.data() + at, positions.data() + at);
      else
        b.scored_tokens += seq_len_ - 1;
    } else {
      const TokenExample& x = examples_[static_cast<std::size_t>(r[k])];
      std::copy(x.input_ids.begin(), x.input_ids.end(), ids.begin() + at);
      std::copy(x.labels.begin(), x.labels.end(), labels.begin() + at);
      b.scored_tokens += scored_[static_cast<std::size_t>(r[k])];
      if (packed()) {
        const std::vector<int64_t>& p = positions_[static_cast<std::size_t>(r[k])];
        std::copy(p.begin(), p.end(), positions.begin() + at);
        for (int64_t j = int64_t(p.size()); j < length; ++j)
          positions[at + std::size_t(j)] = j - int64_t(p.size());
      }
    }
  }
  b.ids = from_vector(ids, {n, length}).to(device);
  b.labels = from_vector(labels, {n, length}).to(device);
  if (has_position_ids()) b.position_ids = from_vector(positions, {n, length}).to(device);
  return b;
}

std::vector<int64_t> LmExamples::window(int64_t i) const {
  return tokens_
             ? tokens_->read(i * seq_len_, seq_len_, vocab_size_)
             : std::vector<int64_t>(ids_.begin() + i * seq_len_, ids_.begin() + (i + 1) * seq_len_);
}

int64_t LmExamples::scored_tokens(const Tensor& rows) const {
  if (windowed() && scored_.empty()) return rows.numel() * (seq_len_ - 1);
  int64_t n = 0;
  for (int64_t i : host_rows(rows)) n += scored_.at(static_cast<std::size_t>(i));
  return n;
}

int64_t LmExamples::total_scored_tokens() const {
  if (windowed() && scored_.empty()) return windows_ * (seq_len_ - 1);
  int64_t n = 0;
  for (int64_t s : scored_) n += s;
  return n;
}

}  // namespace quanta::llm
