#pragma once
// Small helpers the op implementations (engine/ops/*.cpp) share; not part of
// the API.
#include <string>
#include <utility>
#include <vector>

#include "engine/dispatch.h"
#include "engine/tensor.h"

namespace quanta::detail {

/** The gradient list of an op with one differentiable input. */
inline std::vector<Tensor> one(Tensor g) { return {std::move(g)}; }

/** Decimal text of an index or size, for messages. */
inline std::string str(int64_t v) { return std::to_string(v); }

/** Throws naming `op` when `t` is a byte-only format (nf4): ops that move or
 * pick elements need a dtype with arithmetic. */
inline void check_plain(const char* op, const Tensor& t) {
  if (!dtype_info(t.dtype()).arithmetic)
    bad_dtype(op, t.dtype(), "a byte-only format: dequantize it first");
}

}  // namespace quanta::detail
