// ShardedUnits on real ranks: a gathered unit holds the unsharded bytes for
// any byte pattern (NaN payloads, signalling NaNs, denormals, infinities, a
// zero scale, an nf4 tensor with a partial block), with uneven last shards on
// 2, 3 and 4 ranks and on sim; the module's buffers are empty between
// forwards; prefetching follows forward and recomputing-backward orders;
// ranks with other bytes are named before anything is sharded; DataParallel
// shards through shard_units; units sharded one at a time (as a loader makes
// them) are the list form's shards, and DataParallel takes them as they are.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "dist/data_parallel.h"
#include "dist/sharded_units.h"
#include "quant/nf4/nf4_format.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.raw_data());
  return p ? std::vector<uint8_t>(p, p + h.nbytes()) : std::vector<uint8_t>{};
}

template <class T>
Tensor bits(const std::vector<T>& raw, DType dtype, Device dev) {
  return from_blob(raw.data(), {int64_t(raw.size())}, dtype, {.dtype = dtype, .device = dev});
}

// A unit whose buffers hold hostile bit patterns; `salt` changes one byte
// (a rank that holds another base). forward() records what it sees.
class Unit : public Module {
 public:
  Unit(int index, Device dev, int salt) : Module("Unit") {
    std::vector<uint8_t> codes(97 + 31 * index);
    for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i * 37 + index);
    codes[0] = uint8_t(codes[0] + salt);
    // f32: quiet NaN with a payload, signalling NaN, negative NaN, inf,
    // -0, the smallest denormal, a zero scale.
    const std::vector<uint32_t> f32 = {0x7FC00123u, 0x7F800001u, 0xFFFFFFFFu, 0x7F800000u,
                                       0x80000000u, 0x00000001u, 0x00000000u};
    // bf16 and f16 signalling NaNs and denormals.
    const std::vector<uint16_t> b16 = {0x7F81, 0xFF81, 0x0001, 0x8001, 0x7FFF, 0x7D01, 0xFC01};
    register_buffer("codes", bits(codes, DType::u8, dev));
    register_buffer("absmax", bits(f32, DType::f32, dev));
    register_buffer("scale_bf16", bits(b16, DType::bf16, dev));
    register_buffer("scale_f16", bits(b16, DType::f16, dev), false);  // non-persistent too
    register_buffer("nf4", quant::quantize_nf4(sin(arange(0.0, 30.0 + index, 1.0))).to(dev));
  }
  Tensor forward(const Tensor& x) override {
    ++calls;
    seen.clear();
    for (const Tensor& b : buffers()) seen.push_back(bytes_of(b));
    return x;
  }
  int calls = 0;
  std::vector<std::vector<uint8_t>> seen;
};

class Model : public Module {
 public:
  Model(int units, Device dev, int salt = 0) : Module("Model") {
    register_parameter("w", ones({1}, {.device = dev}));
    for (int i = 0; i < units; ++i)
      layers.push_back(register_module("u" + std::to_string(i),
                                       std::make_shared<Unit>(i, dev, i == 1 ? salt : 0)));
  }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (std::size_t i = 0; i < layers.size(); ++i) n.push_back("u" + std::to_string(i));
    return n;
  }
  std::vector<std::shared_ptr<Unit>> layers;
};

std::vector<std::vector<uint8_t>> reference(int index, Device dev) {
  Unit u(index, dev, 0);
  std::vector<std::vector<uint8_t>> out;
  for (const Tensor& b : u.buffers()) out.push_back(bytes_of(b));
  return out;
}

}  // namespace

TEST_CASE("a gathered unit is the unsharded bytes, whatever they are, on 2, 3 and 4 ranks") {
  // On a GPU, a world of one (two ranks cannot share one device under NCCL):
  // the copies into fresh device storage.
  std::vector<std::pair<Device, std::vector<int>>> cases = {{Device::cpu(), {2, 3, 4}},
                                                            {Device::sim(0), {2, 3, 4}}};
  if (cuda_device_count() > 0)
    cases.push_back({Device::cuda(0), {1}});
  else
    MESSAGE("no GPU: the cuda:0 case is skipped");
  for (const auto& [dev, worlds] : cases) {
    for (const int n : worlds) {
      CAPTURE(dev.str());
      CAPTURE(n);
      auto errors = run_ranks(n, [&](ProcessGroup& g) {
        Model m(3, dev);
        const std::vector<std::vector<uint8_t>> want[] = {reference(0, dev), reference(1, dev),
                                                          reference(2, dev)};
        // The patterns survived their making (the test's own premise).
        for (int i = 0; i < 3; ++i) {
          std::vector<std::vector<uint8_t>> now;
          for (const Tensor& b : m.layers[i]->buffers()) now.push_back(bytes_of(b));
          REQUIRE(now == want[i]);
        }
        ShardedUnits s(m, g, m.names(), {.granule_bytes = 64});
        CHECK(s.tensor_names().size() == 15);
        CHECK(s.tensor_names()[0] == "u0.codes");
        // Uneven: the units' bytes do not divide by n, each rank keeps a
        // granule-rounded n-th.
        CHECK(s.shard_bytes() * n >= s.full_bytes());
        CHECK(s.shard_bytes() * n < s.full_bytes() + 3 * n * 64);
        if (n == 1) CHECK(s.shard_bytes() == s.full_bytes());
        for (const Tensor& b : m.buffers()) CHECK(b.storage()->nbytes() == 0);
        const Tensor x = zeros({2});
        for (int i = 0; i < 3; ++i) (*m.layers[i])(x);
        for (int i = 2; i >= 0; --i) (*m.layers[i])(x);
        for (int i = 0; i < 3; ++i) {
          CHECK(m.layers[i]->calls == 2);
          CHECK(m.layers[i]->seen == want[i]);
        }
        for (const Tensor& b : m.buffers()) CHECK(b.storage()->nbytes() == 0);
        CHECK(s.gathers() >= 6);
        s.unshard();
        CHECK_FALSE(s.sharded());
        for (int i = 0; i < 3; ++i) {
          std::vector<std::vector<uint8_t>> now;
          for (const Tensor& b : m.layers[i]->buffers()) now.push_back(bytes_of(b));
          CHECK(now == want[i]);
        }
      });
      REQUIRE(all_ok(errors));
    }
  }
}

TEST_CASE("prefetch: forward then a recomputing backward find the next unit already gathered") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Model m(4, Device::cpu());
    ShardedUnits s(m, g, m.names());
    const Tensor x = zeros({1});
    for (int step = 0; step < 2; ++step) {
      for (int i = 0; i < 4; ++i) (*m.layers[i])(x);   // forward
      for (int i = 3; i >= 0; --i) (*m.layers[i])(x);  // backward's recomputation
    }
    // 16 forwards: the guesses miss only at each step's first unit and
    // where the backward turns at the last one; one more gather (unit 1,
    // for a next step) is under way at the end.
    CHECK(s.gathers() == 17);
    CHECK(s.prefetch_hits() == 12);
    CHECK(s.gathered_bytes() > 4 * s.full_bytes());
    CHECK(s.gathered_bytes() < 5 * s.full_bytes());
    // Without prefetching every gather happens when asked.
    Model m2(4, Device::cpu());
    ShardedUnits s2(m2, g, m2.names(), {.prefetch = false});
    for (int i = 0; i < 4; ++i) (*m2.layers[i])(x);
    CHECK(s2.gathers() == 4);
    CHECK(s2.prefetch_hits() == 0);
    CHECK(s2.gathered_bytes() == s2.full_bytes());
  });
  REQUIRE(all_ok(errors));
}

TEST_CASE("a rank that holds other bytes is named on every rank; bad unit lists are refused") {
  auto errors = run_ranks(3, [&](ProcessGroup& g) {
    Model m(2, Device::cpu(), g.rank() == 2 ? 1 : 0);
    ShardedUnits s(m, g, m.names());
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(errors[r].find("different bytes") != std::string::npos);
    CHECK(errors[r].find("'u1.codes': rank 2") != std::string::npos);
  }
  // Unit lists: every rank refuses them alike, naming the problem.
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"u0", "nope"}, "no module named 'nope'"},
      {{"u0", "u0"}, "'u0' is listed twice"},
      {{"", "u0"}, "no module named ''"},
      {{"u0", "u0.inner"}, "'u0.inner' is inside unit 'u0'"}};
  for (const auto& [units, why] : bad) {
    CAPTURE(why);
    errors = run_ranks(2, [&](ProcessGroup& g) {
      Model m(2, Device::cpu());
      ShardedUnits s(m, g, units);
    });
    for (int r = 0; r < 2; ++r) CHECK(errors[r].find(why) != std::string::npos);
  }
}

TEST_CASE("DataParallel with shard_units: sharded buffers are checked, not broadcast") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    auto m = std::make_shared<Model>(2, Device::cpu());
    DataParallel dp(m, g, {.broadcast_buffers = false, .shard_units = m->names()});
    REQUIRE(dp.sharded() != nullptr);
    CHECK(dp.sharded()->shard_bytes() < dp.sharded()->full_bytes());
    (*m->layers[0])(zeros({1}));
    CHECK(m->layers[0]->seen == reference(0, Device::cpu()));
    dp.finish_step();
    dp.unshard();
    CHECK(bytes_of(m->layers[1]->buffers()[0]) == reference(1, Device::cpu())[0]);
  });
  REQUIRE(all_ok(errors));
  // A buffer outside the units would be reloaded each step: refused.
  errors = run_ranks(2, [&](ProcessGroup& g) {
    auto m = std::make_shared<Model>(2, Device::cpu());
    DataParallel dp(m, g, {.shard_units = {"u0"}});
  });
  for (int r = 0; r < 2; ++r)
    CHECK(errors[r].find("buffer 'u1.codes' is outside the sharded units") != std::string::npos);
}

TEST_CASE("units sharded one at a time are the list's shards, and DataParallel takes them") {
  for (const Device dev : {Device::cpu(), Device::sim(0)}) {
    CAPTURE(dev.str());
    auto errors = run_ranks(3, [&](ProcessGroup& g) {
      auto m = std::make_shared<Model>(3, dev);
      Model whole(3, dev);
      ShardedUnits listed(whole, g, whole.names(), {.granule_bytes = 64});
      auto one_by_one = std::make_shared<ShardedUnits>(*m, g, ShardOptions{.granule_bytes = 64});
      CHECK(one_by_one->unit_names().empty());
      one_by_one->shard("u0");
      // Only the unit sharded is away; the others are still being made.
      for (const Tensor& b : m->layers[0]->buffers()) CHECK(b.storage()->nbytes() == 0);
      for (const Tensor& b : m->layers[1]->buffers()) CHECK(b.storage()->nbytes() == b.nbytes());
      one_by_one->shard("u1");
      one_by_one->shard("u2");
      CHECK(one_by_one->unit_names() == m->names());
      CHECK(one_by_one->tensor_names() == listed.tensor_names());
      CHECK(one_by_one->full_bytes() == listed.full_bytes());
      CHECK(one_by_one->shard_bytes() == listed.shard_bytes());
      CHECK_THROWS_WITH_AS(one_by_one->shard("u1"), doctest::Contains("'u1' is listed twice"),
                           std::invalid_argument);
      DataParallel dp(m, g, {.broadcast_buffers = false, .sharded_units = one_by_one});
      CHECK(dp.sharded() == one_by_one.get());
      for (int i = 0; i < 3; ++i) {
        (*m->layers[i])(zeros({1}));
        CHECK(m->layers[i]->seen == reference(i, dev));
      }
      dp.finish_step();
      dp.unshard();
      for (int i = 0; i < 3; ++i)
        CHECK(bytes_of(m->layers[i]->buffers()[0]) == reference(i, dev)[0]);
    });
    REQUIRE(all_ok(errors));
  }
  // A rank whose unit holds other bytes is named when that unit is sharded.
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Model m(2, Device::cpu(), g.rank() == 1 ? 1 : 0);
    ShardedUnits s(m, g);
    s.shard("u0");
    s.shard("u1");
  });
  for (int r = 0; r < 2; ++r) CHECK(errors[r].find("'u1.codes': rank 1") != std::string::npos);
  // DataParallel refuses shard_units that name other units than it is given.
  errors = run_ranks(2, [&](ProcessGroup& g) {
    auto m = std::make_shared<Model>(2, Device::cpu());
    auto s = std::make_shared<ShardedUnits>(*m, g);
    s->shard("u0");
    DataParallel dp(m, g,
                    {.broadcast_buffers = false, .shard_units = {"u0", "u1"}, .sharded_units = s});
  });
  for (int r = 0; r < 2; ++r)
    CHECK(errors[r].find("shard_units names other units than sharded_units holds") !=
          std::string::npos);
}
