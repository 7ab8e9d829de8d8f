#include "dist/fingerprint.h"

#include <cstring>
#include <sstream>

#include "engine/random/generator.h"

namespace quanta::dist::detail {
namespace {

const char* const kOps[] = {"all_reduce",     "broadcast",  "all_gather", "all_gather_v",
                            "reduce_scatter", "all_to_all", "barrier",    "clone",
                            "reduce",         "other"};

uint64_t mix(uint64_t h, uint64_t v) { return quanta::detail::splitmix64(h ^ v); }

std::string shape_text(const Fingerprint& f) {
  if (f.shape_rule == kNoTensor) return "";
  std::ostringstream s;
  s << dtype_name(static_cast<DType>(f.dtype)) << " [";
  for (int i = 0; i < f.ndim; ++i) {
    if (i) s << ", ";
    if (i >= 8) {
      s << "...";
      break;
    }
    if (i == 0 && f.shape_rule == kAnyFirstDim)
      s << "*";
    else
      s << f.shape[i];
  }
  return s.str() + "]";
}

std::string site_text(const Fingerprint& f) {
  return std::string(f.file) + ":" + std::to_string(f.line);
}

}  // namespace

int32_t op_index(const char* op) {
  for (int32_t i = 0; i < int32_t(std::size(kOps)); ++i)
    if (std::strcmp(kOps[i], op) == 0) return i;
  return int32_t(std::size(kOps)) - 1;
}

Fingerprint make_fingerprint(const char* op, uint64_t seq, const Tensor* t, int32_t shape_rule,
                             int32_t reduce, int32_t root, const std::source_location& site) {
  Fingerprint f;
  f.seq = seq;
  f.op = op_index(op);
  f.shape_rule = t ? shape_rule : kNoTensor;
  f.reduce = reduce;
  f.root = root;
  if (t) {
    f.dtype = static_cast<int32_t>(t->dtype());
    f.ndim = static_cast<int32_t>(t->dim());
    uint64_t h = 0;
    for (int64_t i = 0; i < t->dim(); ++i) {
      const int64_t d = (i == 0 && shape_rule == kAnyFirstDim) ? -1 : t->size(i);
      if (i < 8) f.shape[i] = d;
      h = mix(h, static_cast<uint64_t>(d));
    }
    f.shape_hash = h;
  }
  f.line = site.line();
  const char* file = site.file_name();
  const std::size_t len = std::strlen(file);
  const std::size_t keep = std::min(len, sizeof f.file - 1);
  std::memcpy(f.file, file + (len - keep), keep);
  return f;
}

std::string describe(const Fingerprint& f) {
  std::ostringstream s;
  s << kOps[f.op] << " #" << f.seq;
  std::string args = shape_text(f);
  if (f.reduce >= 0)
    args +=
        (args.empty() ? "" : ", ") + std::string(reduce_op_name(static_cast<ReduceOp>(f.reduce)));
  if (f.root >= 0)
    args += (args.empty() ? "" : ", ") + std::string("root ") + std::to_string(f.root);
  if (!args.empty()) s << " (" << args << ")";
  if (f.line) s << " at " << site_text(f);
  return s.str();
}

uint32_t tag_of(const Fingerprint& f) {
  uint64_t h = mix(0x7175616e7461ull, f.seq);
  for (uint64_t v : {uint64_t(f.op), uint64_t(uint32_t(f.dtype)), uint64_t(f.ndim),
                     uint64_t(uint32_t(f.reduce)), uint64_t(uint32_t(f.root)), f.shape_hash})
    h = mix(h, v);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

uint32_t check_word(const Fingerprint& f) {
  uint64_t h = mix(uint64_t(tag_of(f)), f.line);
  for (const char* c = f.file; *c; ++c) h = mix(h, uint64_t(uint8_t(*c)));
  return static_cast<uint32_t>(h ^ (h >> 32));
}

namespace {
// What differs between two calls, in compare()'s words (empty: the same call).
std::vector<std::string> differences(const Fingerprint& ref, const Fingerprint& f) {
  std::vector<std::string> diffs;
  if (f.seq != ref.seq)
    diffs.push_back("sequence number " + std::to_string(ref.seq) + " vs " + std::to_string(f.seq));
  if (f.op != ref.op) diffs.push_back(std::string("op ") + kOps[ref.op] + " vs " + kOps[f.op]);
  if (f.dtype != ref.dtype && f.shape_rule != kNoTensor && ref.shape_rule != kNoTensor)
    diffs.push_back(std::string("dtype ") + dtype_name(static_cast<DType>(ref.dtype)) + " vs " +
                    dtype_name(static_cast<DType>(f.dtype)));
  if (f.op == ref.op && f.dtype == ref.dtype &&
      (f.ndim != ref.ndim || f.shape_hash != ref.shape_hash))
    diffs.push_back("shape " + shape_text(ref) + " vs " + shape_text(f));
  if (f.reduce != ref.reduce && f.op == ref.op)
    diffs.push_back(std::string("reduce op ") +
                    (ref.reduce >= 0 ? reduce_op_name(static_cast<ReduceOp>(ref.reduce)) : "-") +
                    " vs " +
                    (f.reduce >= 0 ? reduce_op_name(static_cast<ReduceOp>(f.reduce)) : "-"));
  if (f.root != ref.root && f.op == ref.op)
    diffs.push_back("root " + std::to_string(ref.root) + " vs " + std::to_string(f.root));
  if (f.line != ref.line || std::strcmp(f.file, ref.file) != 0)
    diffs.push_back("call site " + site_text(ref) + " vs " + site_text(f));
  return diffs;
}
}  // namespace

std::string compare(const std::vector<Fingerprint>& all, const std::vector<int>& ranks) {
  auto rank_of = [&](std::size_t i) { return ranks.empty() ? int(i) : ranks[i]; };
  const Fingerprint& ref = all[0];
  std::ostringstream out;
  for (std::size_t r = 1; r < all.size(); ++r) {
    const std::vector<std::string> diffs = differences(ref, all[r]);
    if (diffs.empty()) continue;
    out << "\n  rank " << rank_of(0) << " and rank " << rank_of(r) << " differ in ";
    for (std::size_t i = 0; i < diffs.size(); ++i) out << (i ? "; " : "") << diffs[i];
  }
  const std::string body = out.str();
  if (body.empty()) return "";
  std::ostringstream msg;
  msg << "ranks called different collectives:";
  for (std::size_t r = 0; r < all.size(); ++r)
    msg << "\n  rank " << rank_of(r) << ": " << describe(all[r]);
  return msg.str() + body;
}

}  // namespace quanta::dist::detail
