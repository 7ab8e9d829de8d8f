// nf4 tensors through dist on real ranks: broadcast, all_gather,
// all_gather_v and all_to_all move their bytes unchanged (row shards of an
// NF4 weight gather back to the weight, byte for byte), pieces that would
// split a 64-element block are refused on every rank before any data moves,
// reductions refuse nf4, and DataParallel broadcasts an nf4 buffer from
// rank 0.
//
// The nf4 tensors come from quant's quantize_nf4 (the format users move:
// real codes and scales). dist itself never includes quant; only this test
// does, to feed it the real thing.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "dist/data_parallel.h"
#include "dist/process_group.h"
#include "quant/nf4/nf4_format.h"
#include "quanta.h"
#include "ranks.h"

using namespace quanta;
using namespace quanta::dist;
using testing::all_ok;
using testing::run_ranks;

namespace {

constexpr int kRanks = 3;

// A float weight [rows, cols] whose values depend on `phase`.
Tensor weight(int64_t rows, int64_t cols, double phase) {
  return sin(arange(0.0, double(rows * cols), 1.0) * 0.731 + phase).reshape({rows, cols});
}

// The bytes an nf4 tensor holds (codes and scales, 36 per 64 elements).
std::vector<uint8_t> bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return p ? std::vector<uint8_t>(p, p + t.nbytes()) : std::vector<uint8_t>{};
}

}  // namespace

TEST_CASE("nf4 broadcast: every rank receives the root's bytes, a partial last block included") {
  for (const Shape& shape : {Shape{3, 10}, Shape{2, 64}, Shape{0, 64}, Shape{1}}) {
    CAPTURE(shape_str(shape));
    std::vector<std::vector<uint8_t>> got(kRanks);
    auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
      Tensor x = quant::quantize_nf4(weight(1, numel_of(shape), g.rank()).reshape(shape));
      g.broadcast(x, 1);
      CHECK(x.dtype() == DType::nf4);
      CHECK(x.shape() == shape);
      got[g.rank()] = bytes(x);
    });
    REQUIRE(all_ok(errors));
    const auto want = bytes(quant::quantize_nf4(weight(1, numel_of(shape), 1).reshape(shape)));
    for (int r = 0; r < kRanks; ++r) CHECK(got[r] == want);
  }
}

TEST_CASE("nf4 all_gather of row shards rebuilds the weight byte for byte") {
  // [6, 128]: two rows per rank; [6, 32]: two rows of 32 make one block;
  // bitsandbytes-style 128-element blocks with double quantization.
  struct Case {
    Shape shape;
    quant::NF4Options opts;
  };
  for (const Case& c :
       {Case{{6, 128}, {}}, Case{{6, 32}, {.block_size = 64, .double_quant = false}},
        Case{{6, 256}, {.block_size = 128, .double_quant = true}}}) {
    CAPTURE(shape_str(c.shape));
    const Tensor full = quant::quantize_nf4(weight(c.shape[0], c.shape[1], 0.25), c.opts);
    const int64_t rows = c.shape[0] / kRanks;
    std::vector<std::vector<uint8_t>> got(kRanks);
    auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
      // Every rank quantizes the same weight and keeps its rows (a view).
      Tensor mine = quant::quantize_nf4(weight(c.shape[0], c.shape[1], 0.25), c.opts)
                        .narrow(0, g.rank() * rows, rows);
      Tensor all = g.all_gather(mine);
      CHECK(all.dtype() == DType::nf4);
      CHECK(all.shape() == c.shape);
      got[g.rank()] = bytes(all);
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < kRanks; ++r) CHECK(got[r] == bytes(full));
  }
}

TEST_CASE("nf4 all_gather_v: uneven shards, empty ones, and a partial last block") {
  struct Case {
    Shape shape;                // the whole weight
    std::vector<int64_t> rows;  // rows per rank
  };
  // Whole 64-element rows, rank 0 empty; then rows of 16 where only the last
  // non-empty piece (rank 1's 3 rows, 48 elements) ends inside a block, and
  // rank 2's empty view starts inside that block (it has no bytes to move).
  for (const Case& c : {Case{{3, 64}, {0, 1, 2}}, Case{{7, 16}, {4, 3, 0}}}) {
    CAPTURE(shape_str(c.shape));
    const Tensor full = quant::quantize_nf4(weight(c.shape[0], c.shape[1], 0.5));
    std::vector<std::vector<uint8_t>> got(kRanks);
    std::vector<std::vector<int64_t>> sizes(kRanks);
    auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
      int64_t start = 0;
      for (int r = 0; r < g.rank(); ++r) start += c.rows[r];
      Tensor mine = quant::quantize_nf4(weight(c.shape[0], c.shape[1], 0.5))
                        .narrow(0, start, c.rows[g.rank()]);
      Tensor all = g.all_gather_v(mine, &sizes[g.rank()]);
      CHECK(all.shape() == c.shape);
      got[g.rank()] = bytes(all);
    });
    REQUIRE(all_ok(errors));
    for (int r = 0; r < kRanks; ++r) {
      CHECK(sizes[r] == c.rows);
      CHECK(got[r] == bytes(full));
    }
  }
}

TEST_CASE("nf4 all_to_all: whole-block pieces go to their ranks unchanged") {
  // Rank r holds [kRanks, 64]: row j (one block) goes to rank j.
  std::vector<std::vector<uint8_t>> got(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    Tensor t = g.all_to_all(quant::quantize_nf4(weight(kRanks, 64, g.rank())));
    CHECK(t.shape() == Shape{kRanks, 64});
    got[g.rank()] = bytes(t);
  });
  REQUIRE(all_ok(errors));
  for (int r = 0; r < kRanks; ++r) {
    // Block j of rank r's result is row r of rank j's tensor: 36 bytes each.
    std::vector<uint8_t> want;
    for (int j = 0; j < kRanks; ++j) {
      const auto row = bytes(quant::quantize_nf4(weight(kRanks, 64, j)).narrow(0, r, 1));
      want.insert(want.end(), row.begin(), row.end());
    }
    CHECK(got[r] == want);
  }
}

TEST_CASE("nf4 pieces that would split a 64-element block fail on every rank before moving data") {
  std::vector<uint64_t> seq(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    // Every rank: [1, 10] would put rank 1's piece inside block 0.
    Tensor small = quant::quantize_nf4(weight(1, 10, g.rank()));
    CHECK_THROWS_WITH_AS(
        g.all_gather(small),
        "[dist::all_gather] nf4 pieces must be whole 64-element blocks (36 bytes each) to be moved "
        "as bytes: got 10 elements from rank 0 (1 row of 10), so the next piece would start inside "
        "a block. Only the last piece may end in a partial block: shard whole blocks (rows of a "
        "multiple of 64 elements, or row counts that make whole blocks)",
        std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        g.all_to_all(quant::quantize_nf4(weight(kRanks, 10, 0))),
        doctest::Contains("[dist::all_to_all] nf4 pieces must be whole 64-element blocks (36 bytes "
                          "each) to be moved as bytes: got 10 elements from rank 0 (1 row of 10)"),
        std::invalid_argument);
    // Uneven: rank 1's 3 rows of 16 (48 elements) are followed by rank 2's.
    const int64_t rows = g.rank() == 1 ? 3 : 4;
    CHECK_THROWS_WITH_AS(
        g.all_gather_v(quant::quantize_nf4(weight(rows, 16, 0))),
        doctest::Contains(
            "[dist::all_gather_v] nf4 pieces must be whole 64-element blocks (36 bytes each) to be "
            "moved as bytes: got 48 elements from rank 1 (3 rows of 16)"),
        std::invalid_argument);
    // The group is not broken and the ranks are still in step.
    Tensor one = full({1}, 1.0);
    g.all_reduce(one);
    CHECK(one.item() == kRanks);
    seq[g.rank()] = g.sequence();
  });
  REQUIRE(all_ok(errors));
  for (int r = 1; r < kRanks; ++r) CHECK(seq[r] == seq[0]);

  // A view that starts inside a block has no bytes of its own.
  auto single = ProcessGroup::single();
  Tensor x = quant::quantize_nf4(weight(3, 10, 0));
  CHECK_THROWS_WITH_AS(
      single->broadcast(x.narrow(0, 1, 1), 0),
      doctest::Contains(
          "[dist::broadcast] this nf4 view starts at element 10, inside a 64-element block"),
      std::invalid_argument);
  CHECK_THROWS_WITH_AS(single->all_gather(x.narrow(0, 2, 1)),
                       doctest::Contains("[dist::all_gather] this nf4 view starts at element 20"),
                       std::invalid_argument);
  // A world of one has a single (last) piece: any nf4 tensor is fine.
  CHECK(bytes(single->all_gather(x)) == bytes(x));
  CHECK(bytes(single->all_gather_v(x)) == bytes(x));
  CHECK(single->sequence() == 2);
}

TEST_CASE("reductions refuse nf4 with an error naming the dtype, on every rank") {
  auto errors = run_ranks(2, [&](ProcessGroup& g) {
    Tensor x = quant::quantize_nf4(weight(2, 64, 0));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      CAPTURE(reduce_op_name(op));
      CHECK_THROWS_WITH_AS(
          g.all_reduce(x, op),
          "[dist::all_reduce] cannot reduce dtype nf4: it is a byte-only format (broadcast, "
          "all_gather and all_gather_v move it; dequantize it to reduce)",
          std::invalid_argument);
      CHECK_THROWS_WITH_AS(g.reduce_scatter(x, op),
                           doctest::Contains("[dist::reduce_scatter] cannot reduce dtype nf4"),
                           std::invalid_argument);
    }
    CHECK(g.sequence() == 0);  // refused before any communication
  });
  CHECK(all_ok(errors));
}

namespace {

// A frozen nf4 weight (a buffer: parameters are floating) and a trainable
// bias, as in NF4Linear.
struct FrozenNF4 : Module {
  Tensor w, bias;
  explicit FrozenNF4(double phase) : Module("FrozenNF4") {
    w = register_buffer("w", quant::quantize_nf4(weight(4, 40, phase)));  // 160: partial block
    bias = register_parameter("bias", weight(1, 4, phase).reshape({4}));
  }
  Tensor forward(const Tensor& x) override { return matmul(x, quant::dequantize(w).t()) + bias; }
};

}  // namespace

TEST_CASE("DataParallel broadcasts an nf4 buffer from rank 0 byte for byte, every step") {
  std::vector<std::vector<uint8_t>> at_start(kRanks), after_step(kRanks);
  auto errors = run_ranks(kRanks, [&](ProcessGroup& g) {
    auto model = std::make_shared<FrozenNF4>(g.rank());  // each rank its own weight
    DataParallel dp(model, g);
    at_start[g.rank()] = bytes(model->w);
    // A rank that changes its copy gets rank 0's back at the step.
    if (g.rank() == 2) copy_(model->w, quant::quantize_nf4(weight(4, 40, 9.0)));
    sum(dp(ones({2, 40}))).backward();
    dp.finish_step();
    after_step[g.rank()] = bytes(model->w);
    CHECK(model->bias.grad().to_vector<float>() == std::vector<float>{2, 2, 2, 2});
  });
  REQUIRE(all_ok(errors));
  const auto want = bytes(quant::quantize_nf4(weight(4, 40, 0)));
  for (int r = 0; r < kRanks; ++r) {
    CHECK(at_start[r] == want);
    CHECK(after_step[r] == want);
  }
}
