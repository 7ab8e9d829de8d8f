#pragma once
// A kernel table the CUDA module exports by name (the quantizers' and the
// language models'; the engine's comes with the module's entry), chosen
// once: the module's table, or the seam's stand-in whose entries throw
// no_cuda_kernel() when the module or the symbol cannot be had.
#include <exception>
#include <string>

#include "engine/cuda/module.h"

namespace quanta::cuda {

/** The table exported as `symbol` (a function returning const Table*), or
 * `stand_in` with the reason it is used. */
template <class Table>
struct ModuleTable {
  const Table* table = nullptr;
  std::string reason;  // why `table` is the stand-in; empty: the module's

  ModuleTable(const char* what, const char* symbol, const Table& stand_in) {
    if (!module()) {
      table = &stand_in;
      reason = unavailable_reason();
      return;
    }
    try {
      using Entry = const Table* (*)();
      table = reinterpret_cast<Entry>(module_symbol(what, symbol))();
    } catch (const std::exception& e) {
      table = &stand_in;
      reason = e.what();
    }
  }
};

/** Throws std::runtime_error "[op] has no CUDA kernel here: <reason>; move
 * the tensors to cpu" (`kind` names the table when there is no reason: the
 * module's is loaded but another is in use). */
[[noreturn]] void no_cuda_kernel(const char* op, const std::string& reason, const char* kind);

}  // namespace quanta::cuda
