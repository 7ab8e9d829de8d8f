#pragma once
// The always-on check of a reduction (all_reduce, reduce_scatter): a region
// of check elements reduced along with the payload, in the payload's dtype
// and with its reduce op, that says afterwards whether every rank made the
// same call. A reduction mixes the ranks' values, so the call's fingerprint
// cannot travel as bytes; instead each bit of the call's check word
// (fingerprint.h) becomes a pair of elements (bit, 1 - bit), values 0 and 1
// that every dtype holds exactly. Reduced over ranks that agree, the element
// where a rank put 0 stays exactly 0 under sum, avg and max, and the element
// where it put 1 stays exactly 1 under min and prod. A rank whose bit
// differs puts a 1 into the others' 0 (sum, avg, max: the result is not 0)
// or a 0 into their 1 (min, prod: the result is 0), and every rank sees the
// same reduced result, so every rank finds the mismatch. Internal to dist.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dist/process_group.h"
#include "engine/dtype.h"

namespace quanta::dist::detail {

/** Check elements after the payload: two per bit of the 32-bit check word. */
constexpr std::size_t kCheckElems = 64;

/** The check region this rank contributes for `word`: kCheckElems elements
 * of `dtype`, as bytes. */
std::vector<char> check_region(uint32_t word, DType dtype);
/** Whether `reduced` (the region after the reduction with `op`) says every
 * rank contributed `word`. */
bool check_region_holds(const char* reduced, uint32_t word, DType dtype, ReduceOp op);

}  // namespace quanta::dist::detail
