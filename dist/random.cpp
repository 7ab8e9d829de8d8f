#include "dist/random.h"

#include <string>

namespace quanta::dist {

Generator shared_generator(const ProcessGroup& group, std::string_view name) {
  return Generator::named(group.seed(), name);
}

Generator shared_generator(const ProcessGroup& group, std::string_view name, uint64_t step) {
  // The step takes the high 64 bits of the counter: draws within a step
  // use the low half, so steps never overlap.
  Generator g = Generator::named(group.seed(), name);
  g.set_offset({0, step});
  return g;
}

Generator rank_generator(const ProcessGroup& group, std::string_view name) {
  // The rank is folded in explicitly, as its own nested stream.
  return Generator::named(group.seed(), name).fork("rank/" + std::to_string(group.rank()));
}

}  // namespace quanta::dist
