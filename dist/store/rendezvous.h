#pragma once
// How the ranks of a group meet before Gloo connects them: each claims its
// rank in the group's store, then waits until every rank has claimed one.
// So the store knows who registered: a rank claimed twice (two processes
// started with the same RANK) fails the ranks that see it with a message
// naming the rank and both processes, instead of hanging in Gloo's connect;
// and a rank that waits says on stderr what for (where, which ranks are
// missing) after 3 s, then every 30 s.
#include <string>

#include "dist/store/store.h"

namespace quanta::dist::detail {

/** Claims `rank` of `size` in `store` (the group's scoped store) and waits
 * until every rank has; `where` names the store and group in messages.
 * Throws std::runtime_error naming a rank started twice, or naming the
 * missing ranks after `timeout`. */
void join_group(Store& store, int rank, int size, Millis timeout, const std::string& where);

/** Throws std::runtime_error when a second process claimed a rank of this
 * group (one that came after join_group returned). */
void check_no_duplicate(Store& store);

}  // namespace quanta::dist::detail
