// ProcessGroup's collectives: tensors are checked and staged here, the
// bytes move through the backend of their device (backend_for: Gloo for CPU
// tensors, NCCL for CUDA tensors), and each call carries the check that the
// ranks made the same call (dist/call_checks.h).
#include <cstring>
#include <string>
#include <vector>

#include "dist/backend/backend.h"
#include "dist/backend/gloo_backend.h"
#include "dist/backend/reduce_kernels.h"
#include "dist/call_checks.h"
#include "dist/fingerprint.h"
#include "dist/group_call.h"
#include "dist/process_group.h"
#include "dist/reduce_check.h"
#include "engine/autograd/grad_mode.h"
#include "engine/device_backend.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/storage.h"

namespace quanta::dist {

using detail::Fingerprint;

namespace {

// A block dtype's view (nf4) is a byte range only when it is contiguous and
// starts on a storage unit; anything else cannot be moved as bytes. (An
// empty view has no bytes to move, wherever it starts.)
void check_byte_range(const char* op, const Tensor& t) {
  const DTypeInfo& info = dtype_info(t.dtype());
  if (!t.is_contiguous() && !info.arithmetic)
    throw std::invalid_argument(std::string("[dist::") + op + "] a non-contiguous " + info.name +
                                " tensor cannot be moved as bytes");
  const int64_t unit = static_cast<int64_t>(info.block_elems);
  if (unit > 1 && t.numel() != 0 && t.offset() % unit != 0)
    throw std::invalid_argument(std::string("[dist::") + op + "] this " + info.name +
                                " view starts at element " + std::to_string(t.offset()) +
                                ", inside a " + std::to_string(unit) +
                                "-element block: it is not a byte range and cannot be moved");
}

// A contiguous tensor holding `t`'s values to operate on in place; write it
// back with finish_inplace when it is a copy.
Tensor inplace_buffer(const char* op, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string("[dist::") + op + "] undefined tensor");
  check_byte_range(op, t);
  if (t.numel() == 0) return quanta::detail::make_tensor(t.shape(), t.dtype(), t.device());
  if (t.is_contiguous()) return t;
  NoGradGuard g;
  return t.detach().contiguous();
}

void finish_inplace(const Tensor& t, const Tensor& buf) {
  if (buf.is_same(t) || t.numel() == 0) return;
  NoGradGuard g;
  copy_(t.detach(), buf);
}

Tensor contiguous_input(const char* op, const Tensor& t) {
  if (!t.defined()) throw std::invalid_argument(std::string("[dist::") + op + "] undefined tensor");
  check_byte_range(op, t);
  // Empty: a fresh tensor, so no address is taken inside someone's block.
  if (t.numel() == 0) return quanta::detail::make_tensor(t.shape(), t.dtype(), t.device());
  NoGradGuard g;
  if (t.is_contiguous()) return t.detach();
  return t.detach().contiguous();
}

// Bytes of `elems` elements of `dtype`: whole storage units for block dtypes
// (a partial last unit is stored in full), elems * size for the others.
std::size_t bytes_of(DType dtype, int64_t elems) {
  const DTypeInfo& info = dtype_info(dtype);
  const auto unit = static_cast<int64_t>(info.block_elems);
  return static_cast<std::size_t>((elems + unit - 1) / unit) * info.block_bytes;
}

// Gathers lay the ranks' pieces end to end as bytes. For a block dtype (nf4:
// 64 elements in 36 bytes) that is the result's layout only when every piece
// but the last non-empty one is whole units: otherwise the next piece would
// have to start inside a unit (and its bytes land in the wrong place, or past
// the end of the result). `pieces[r]` is rank r's piece in elements. Every
// rank passes the same pieces, so every rank raises the same error before
// moving a byte.
void check_whole_units(const char* op, DType dtype, const std::vector<int64_t>& pieces,
                       int64_t row_elems) {
  const DTypeInfo& info = dtype_info(dtype);
  const auto unit = static_cast<int64_t>(info.block_elems);
  if (unit == 1) return;
  int last = -1;
  for (int r = 0; r < static_cast<int>(pieces.size()); ++r)
    if (pieces[r] != 0) last = r;
  for (int r = 0; r < last; ++r) {
    if (pieces[r] % unit == 0) continue;
    std::ostringstream msg;
    msg << "[dist::" << op << "] " << info.name << " pieces must be whole " << unit
        << "-element blocks (" << info.block_bytes << " bytes each) to be moved as bytes: got "
        << pieces[r] << " elements from rank " << r;
    if (row_elems > 0) {
      const int64_t rows = pieces[r] / row_elems;
      msg << " (" << rows << (rows == 1 ? " row" : " rows") << " of " << row_elems << ")";
    }
    msg << ", so the next piece would start inside a block. Only the last piece may end in a "
           "partial block: shard whole blocks (rows of a multiple of "
        << unit << " elements, or row counts that make whole blocks)";
    throw std::invalid_argument(msg.str());
  }
}

// The elements in one dim-0 row of `t`.
int64_t row_elems_of(const Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 1; d < t.dim(); ++d) n *= t.size(d);
  return n;
}

}  // namespace

void ProcessGroup::all_reduce(const Tensor& t, ReduceOp op, CallOptions o, Site site) {
  if (t.defined()) detail::check_reducible("all_reduce", t.dtype(), op);
  // Debug mode's fingerprint exchange can carry a small payload read in
  // place: only memory the host reads directly, never a device's.
  const bool fuse = debug_ && size_ > 1 && t.defined() && device_caps(t.device()).host_readable &&
                    t.nbytes() <= Checks::kDebugPayload;
  Call c = begin("all_reduce", &t, detail::kSameShape, op, -1, o, site, !fuse);
  if (size_ == 1) return;
  Tensor buf = inplace_buffer("all_reduce", t);
  const std::size_t n = static_cast<std::size_t>(buf.numel());
  if (fuse) {
    checks_->fused_debug_all_reduce(c, buf, op);
    if (op == ReduceOp::avg) detail::divide(buf.raw_data(), buf.dtype(), n, size_);
    finish_inplace(t, buf);
    return;
  }
  if (!checked() || n == 0) {
    guarded(c, [&] {
      backend_for(buf, c.timeout).all_reduce(buf.raw_data(), n, buf.dtype(), op, c.tag, c.timeout);
    });
    finish_inplace(t, buf);
    return;
  }
  // The check region (reduce_check.h) is reduced in the same call, from host
  // memory; the transport decides how it travels (Gloo on two ranks: in the
  // same exchange as the data, without a copy; NCCL: in the same group, on
  // its own stream, so no copy waits on the default stream's kernels).
  std::vector<char> region = detail::check_region(c.word, buf.dtype());
  guarded(c, [&] {
    backend_for(buf, c.timeout)
        .all_reduce_checked(buf.raw_data(), n, region.data(), detail::kCheckElems, buf.dtype(), op,
                            c.tag, c.timeout);
  });
  if (!detail::check_region_holds(region.data(), c.word, buf.dtype(), op))
    checks_->reduction_mismatch(c);
  finish_inplace(t, buf);
}

void ProcessGroup::reduce(const Tensor& t, int root, ReduceOp op, CallOptions o, Site site) {
  if (root < 0 || root >= size_)
    throw std::invalid_argument("[dist::reduce] root " + std::to_string(root) +
                                " is outside a world of " + std::to_string(size_));
  if (t.defined()) detail::check_reducible("reduce", t.dtype(), op);
  Call c = begin("reduce", &t, detail::kSameShape, op, root, o, site);
  if (size_ == 1) return;
  Tensor buf = inplace_buffer("reduce", t);
  const std::size_t n = static_cast<std::size_t>(buf.numel());
  guarded(c, [&] {
    backend_for(buf, c.timeout).reduce(buf.raw_data(), n, buf.dtype(), op, root, c.tag, c.timeout);
  });
  // The check region in a small all_reduce after the data, not inside it:
  // only the root would see it reduced there, and every rank must learn of
  // a mismatch (and name the calls) from this call, not from a later one.
  if (checked() && n != 0) checks_->reduction_after(c, buf.dtype(), op);
  if (rank_ == root) finish_inplace(t, buf);
}

void ProcessGroup::broadcast(const Tensor& t, int root, CallOptions o, Site site) {
  if (root < 0 || root >= size_)
    throw std::invalid_argument("[dist::broadcast] root " + std::to_string(root) +
                                " is outside a world of " + std::to_string(size_));
  if (!t.defined()) throw std::invalid_argument("[dist::broadcast] undefined tensor");
  check_byte_range("broadcast", t);
  Call c = begin("broadcast", &t, detail::kSameShape, ReduceOp::sum, root, o, site);
  if (size_ == 1 || t.numel() == 0) return;  // every rank has the shape: nothing to move
  Tensor buf = inplace_buffer("broadcast", t);
  if (!checked() || !Checks::inline_ok(buf.nbytes())) {
    auto run = [&] {
      backend_for(buf, c.timeout).broadcast(buf.raw_data(), buf.nbytes(), root, c.tag, c.timeout);
    };
    // The chain from the root: the others compare, the root does not wait.
    if (checked())
      checks_->beside_ring(c, run, root);
    else
      guarded(c, run);
    finish_inplace(t, buf);
    return;
  }
  // Root's payload and fingerprint travel together; the other ranks compare
  // it with their own. (The root learns nothing from a broadcast: when its
  // peers raise, its next collective fails.)
  const Device dev = buf.device(), cpu = Device::cpu();
  const std::size_t bytes = buf.nbytes();
  const Tensor stage = checks_->staging(bytes + sizeof(Fingerprint), dev);
  char* s = static_cast<char*>(stage.raw_data());
  if (rank_ == root) {
    copy_bytes(s, dev, buf.raw_data(), dev, bytes);
    copy_bytes(s + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  }
  guarded(c, [&] {
    backend_for(buf, c.timeout).broadcast(s, bytes + sizeof(Fingerprint), root, c.tag, c.timeout);
  });
  if (rank_ == root) return;
  Fingerprint theirs;
  copy_bytes(&theirs, cpu, s + bytes, dev, sizeof theirs);
  if (const std::string diff = detail::compare({theirs, c.fp}, {root, rank_}); !diff.empty())
    checks_->mismatch(c, diff);
  copy_bytes(buf.raw_data(), dev, s, dev, bytes);
  finish_inplace(t, buf);
}

Tensor ProcessGroup::all_gather(const Tensor& t, CallOptions o, Site site) {
  Tensor in = contiguous_input("all_gather", t);
  if (in.dim() == 0) in = in.reshape({1});
  check_whole_units("all_gather", in.dtype(), std::vector<int64_t>(size_, in.numel()),
                    row_elems_of(in));
  Call c = begin("all_gather", &in, detail::kSameShape, ReduceOp::sum, -1, o, site);
  Shape shape = in.shape();
  shape[0] *= size_;
  if (size_ == 1) {
    NoGradGuard g;
    return in.clone();
  }
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  const std::size_t bytes = in.nbytes();
  if (!checked() || bytes == 0 || !Checks::inline_ok(bytes)) {
    auto run = [&] {
      backend_for(in, c.timeout).all_gather(in.raw_data(), out.raw_data(), bytes, c.tag, c.timeout);
    };
    if (checked() && bytes != 0)
      checks_->beside_ring(c, run);
    else
      guarded(c, run);
    return out;
  }
  // Every rank's block is its payload and its fingerprint: [N blocks | mine].
  const Device dev = in.device(), cpu = Device::cpu();
  const std::size_t block = bytes + sizeof(Fingerprint);
  const auto n = static_cast<std::size_t>(size_);
  const Tensor stage = checks_->staging(block * (n + 1), dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* mine = s + block * n;
  copy_bytes(mine, dev, in.raw_data(), dev, bytes);
  copy_bytes(mine + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  guarded(c, [&] { backend_for(in, c.timeout).all_gather(mine, s, block, c.tag, c.timeout); });
  std::vector<Fingerprint> fps(n);
  for (std::size_t r = 0; r < n; ++r)
    copy_bytes(&fps[r], cpu, s + r * block + bytes, dev, sizeof(Fingerprint));
  if (const std::string diff = detail::compare(fps); !diff.empty()) checks_->mismatch(c, diff);
  char* result = static_cast<char*>(out.raw_data());
  for (std::size_t r = 0; r < n; ++r)
    copy_bytes(result + r * bytes, dev, s + r * block, dev, bytes);
  return out;
}

Tensor ProcessGroup::all_gather_v(const Tensor& t, std::vector<int64_t>* sizes, CallOptions o,
                                  Site site) {
  Tensor in = contiguous_input("all_gather_v", t);
  if (in.dim() == 0)
    throw std::invalid_argument("[dist::all_gather_v] needs at least one dimension, got a scalar");
  Call c = begin("all_gather_v", &in, detail::kAnyFirstDim, ReduceOp::sum, -1, o, site);
  std::vector<int64_t> counts(size_, in.size(0));
  Shape shape = in.shape();
  if (size_ == 1) {
    if (sizes) *sizes = counts;
    NoGradGuard g;
    return in.clone();
  }
  // First the first dims (the tag already covers dtype and the other dims),
  // each with its rank's fingerprint: the always-on check, before any data.
  struct Piece {
    int64_t rows;
    Fingerprint fp;
  };
  const Piece mine{in.size(0), c.fp};
  std::vector<Piece> pieces_of(size_);
  guarded(c, [&] {
    gloo_->all_gather(&mine, pieces_of.data(), sizeof mine, detail::sub_tag(c.tag, 1), c.timeout);
  });
  std::vector<Fingerprint> fps(size_);
  for (int r = 0; r < size_; ++r) {
    counts[r] = pieces_of[r].rows;
    fps[r] = pieces_of[r].fp;
  }
  if (const std::string diff = detail::compare(fps); !diff.empty()) checks_->mismatch(c, diff);
  int64_t total = 0;
  for (auto n : counts) total += n;
  // Every rank has the same counts now: a block dtype whose pieces would
  // split a unit fails here on every rank alike, before any data moves.
  const int64_t row = row_elems_of(in);
  std::vector<int64_t> pieces(size_);
  for (int r = 0; r < size_; ++r) pieces[r] = counts[r] * row;
  check_whole_units("all_gather_v", in.dtype(), pieces, row);
  shape[0] = total;
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  std::vector<std::size_t> bytes(size_);
  for (int r = 0; r < size_; ++r) bytes[r] = bytes_of(in.dtype(), pieces[r]);
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .all_gather_v(in.raw_data(), out.raw_data(), bytes,
                      detail::sub_tag(c.tag, 2 + uint32_t(total)), c.timeout);
  });
  if (sizes) *sizes = counts;
  return out;
}

Tensor ProcessGroup::reduce_scatter(const Tensor& t, ReduceOp op, CallOptions o, Site site) {
  if (t.defined()) detail::check_reducible("reduce_scatter", t.dtype(), op);
  Tensor in = contiguous_input("reduce_scatter", t);
  if (in.dim() == 0 || in.size(0) % size_ != 0)
    throw std::invalid_argument(
        "[dist::reduce_scatter] dim 0 must be a multiple of the world size " +
        std::to_string(size_) + ", got shape " + shape_str(in.shape()));
  Call c = begin("reduce_scatter", &in, detail::kSameShape, op, -1, o, site);
  const int64_t m = in.size(0) / size_;
  if (size_ == 1) {
    NoGradGuard g;
    return in.clone();
  }
  Shape shape = in.shape();
  shape[0] = m;
  Tensor out = quanta::detail::make_tensor(shape, in.dtype(), in.device());
  const auto n_out = static_cast<std::size_t>(out.numel());
  if (!checked() || n_out == 0 || !Checks::inline_ok(in.nbytes())) {
    guarded(c, [&] {
      backend_for(in, c.timeout)
          .reduce_scatter(in.raw_data(), out.raw_data(), n_out, in.dtype(), op, c.tag, c.timeout);
    });
    if (checked() && n_out != 0) checks_->reduction_after(c, in.dtype(), op);
    return out;
  }
  // Each rank's block r is followed by its check region, so the block this
  // rank receives reduced carries every rank's region reduced too.
  const Device dev = in.device(), cpu = Device::cpu();
  const std::vector<char> region = detail::check_region(c.word, in.dtype());
  const std::size_t bytes = out.nbytes(), block = bytes + region.size();
  const auto n = static_cast<std::size_t>(size_);
  const Tensor stage = checks_->staging(block * (n + 1), dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* reduced = s + block * n;
  const char* from = static_cast<const char*>(in.raw_data());
  for (std::size_t r = 0; r < n; ++r) {
    copy_bytes(s + r * block, dev, from + r * bytes, dev, bytes);
    copy_bytes(s + r * block + bytes, dev, region.data(), cpu, region.size());
  }
  guarded(c, [&] {
    backend_for(in, c.timeout)
        .reduce_scatter(s, reduced, n_out + detail::kCheckElems, in.dtype(), op, c.tag, c.timeout);
  });
  std::vector<char> check(region.size());
  copy_bytes(check.data(), cpu, reduced + bytes, dev, check.size());
  if (!detail::check_region_holds(check.data(), c.word, in.dtype(), op))
    checks_->reduction_mismatch(c);
  copy_bytes(out.raw_data(), dev, reduced, dev, bytes);
  return out;
}

Tensor ProcessGroup::all_to_all(const Tensor& t, CallOptions o, Site site) {
  Tensor in = contiguous_input("all_to_all", t);
  if (in.dim() == 0 || in.size(0) % size_ != 0)
    throw std::invalid_argument("[dist::all_to_all] dim 0 must be a multiple of the world size " +
                                std::to_string(size_) + ", got shape " + shape_str(in.shape()));
  // Gloo cuts the bytes into N equal blocks: each must be whole units.
  check_whole_units("all_to_all", in.dtype(), std::vector<int64_t>(size_, in.numel() / size_),
                    row_elems_of(in));
  Call c = begin("all_to_all", &in, detail::kSameShape, ReduceOp::sum, -1, o, site);
  NoGradGuard g;
  if (size_ == 1) return in.clone();
  Tensor out = quanta::detail::make_tensor(in.shape(), in.dtype(), in.device());
  if (!checked() || in.nbytes() == 0 || !Checks::inline_ok(in.nbytes())) {
    auto run = [&] {
      backend_for(in, c.timeout)
          .all_to_all(in.raw_data(), out.raw_data(), in.nbytes(), c.tag, c.timeout);
    };
    if (checked() && in.nbytes() != 0)
      checks_->beside_ring(c, run);
    else
      guarded(c, run);
    return out;
  }
  // Every block travels with the sender's fingerprint: [N blocks in | N out].
  const Device dev = in.device(), cpu = Device::cpu();
  const auto n = static_cast<std::size_t>(size_);
  const std::size_t bytes = in.nbytes() / n, block = bytes + sizeof(Fingerprint);
  const Tensor stage = checks_->staging(2 * n * block, dev);
  char* s = static_cast<char*>(stage.raw_data());
  char* got = s + n * block;
  const char* from = static_cast<const char*>(in.raw_data());
  for (std::size_t j = 0; j < n; ++j) {
    copy_bytes(s + j * block, dev, from + j * bytes, dev, bytes);
    copy_bytes(s + j * block + bytes, dev, &c.fp, cpu, sizeof(Fingerprint));
  }
  guarded(c, [&] { backend_for(in, c.timeout).all_to_all(s, got, n * block, c.tag, c.timeout); });
  std::vector<Fingerprint> fps(n);
  for (std::size_t j = 0; j < n; ++j)
    copy_bytes(&fps[j], cpu, got + j * block + bytes, dev, sizeof(Fingerprint));
  if (const std::string diff = detail::compare(fps); !diff.empty()) checks_->mismatch(c, diff);
  char* result = static_cast<char*>(out.raw_data());
  for (std::size_t j = 0; j < n; ++j)
    copy_bytes(result + j * bytes, dev, got + j * block, dev, bytes);
  return out;
}

void ProcessGroup::barrier(CallOptions o, Site site) {
  Call c = begin("barrier", nullptr, detail::kNoTensor, ReduceOp::sum, -1, o, site);
  if (size_ == 1) return;
  if (!checked()) {
    guarded(c, [&] { gloo_->barrier(c.tag, c.timeout); });
    return;
  }
  // An all-to-all of fingerprints is a barrier (no rank hears from all the
  // others before all have arrived) that also compares the calls.
  std::vector<Fingerprint> mine(size_, c.fp), fps(size_);
  guarded(c, [&] {
    gloo_->all_to_all(mine.data(), fps.data(), sizeof(Fingerprint) * mine.size(), c.tag, c.timeout);
  });
  if (const std::string diff = detail::compare(fps); !diff.empty()) checks_->mismatch(c, diff);
}

}  // namespace quanta::dist
