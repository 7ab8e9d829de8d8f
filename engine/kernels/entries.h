#pragma once
// What every kernel seam (the engine's, the quantizers', the language
// models') makes from the X-macro list of its table's entries: the
// declarations of a device's functions, with each entry's type, and the
// designated initializers of a device's table. A list is
// QUANTA_<SEAM>_ENTRIES(X), X(entry) for each function member in order.
#include <type_traits>

/** Declares the function `entry` with the type of `Table`'s member of that
 * name (in the device's namespace). */
#define QUANTA_DECLARE_ENTRY(Table, entry) std::remove_pointer_t<decltype(Table::entry)> entry;

/** One designated initializer of a table: the function named as the entry. */
#define QUANTA_FILL_KERNEL(entry) .entry = entry,

/** Fails to compile unless `list` names every function member of `Table`:
 * a table is `leading` pointer-sized data members, then one pointer per
 * entry. */
#define QUANTA_CHECK_ENTRY_LIST(Table, list, leading)                                    \
  static_assert(sizeof(Table) == sizeof(void*) * (leading + 0 list(QUANTA_COUNT_ENTRY)), \
                #list " must list every entry of " #Table ", in order")
#define QUANTA_COUNT_ENTRY(entry) +1
