#include "dist/random.h"

#include <string>

namespace quanta::dist {

// Every stream is a key (derived from the seed and names) plus a counter
// whose high half says which call or step the range belongs to.

Generator shared_generator(ProcessGroup& group, std::string_view name) {
  Generator g = Generator::named(group.seed(), name);
  g.set_offset({0, group.next_stream_call("shared/" + std::string(name))});
  return g;
}

Generator shared_generator(const ProcessGroup& group, std::string_view name, uint64_t step) {
  // A nested stream, so step s never repeats the s-th counted call's numbers.
  Generator g = Generator::named(group.seed(), name).fork("step");
  g.set_offset({0, step});
  return g;
}

Generator rank_generator(ProcessGroup& group, std::string_view name) {
  // The rank is folded in explicitly, as its own nested stream.
  Generator g = Generator::named(group.seed(), name).fork("rank/" + std::to_string(group.rank()));
  g.set_offset({0, group.next_stream_call("rank/" + std::string(name))});
  return g;
}

}  // namespace quanta::dist
