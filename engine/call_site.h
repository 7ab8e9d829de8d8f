#pragma once
// Where the program is: the callers above a point, for diagnostics that must
// name the code that asked (a stray host sync names the op and its caller).
#include <cstdint>
#include <string>
#include <vector>

namespace quanta::detail {

/** The return addresses of the calling thread's stack, innermost first,
 * without the `skip` innermost frames (this function's own is always left
 * out). At most `depth` frames. */
std::vector<void*> call_stack(int skip, int depth);

/** One line per frame: the function's demangled name (or its module and
 * offset when the symbol is not exported), innermost first. Frames inside
 * the engine's copy machinery (Storage, copy_bytes, Tensor::to and the
 * counters) are left out so the first line is the op or the caller. */
std::string describe_call_stack(const std::vector<void*>& frames, int lines);

}  // namespace quanta::detail
