// `quanta bench engine --device cuda`: the engine's kernels on a GPU against
// their floors, each timed in turns with its floor (interleaved_ms), every
// batch of calls ended by cuda::synchronize so that it counts the device's
// work and not only the launches.
//   add, exp, sum, ... on 2^26 f32 values (256 MiB; 4096 x 16384 where a row
//     or column broadcasts or reduces) against a device-to-device copy with
//     the same memory traffic, as on the CPU: a copy of n bytes reads n and
//     writes n, so an op that moves k buffers is floored by a copy of k/2
//     buffers (add 3, exp and broadcasts 2, reductions 1). add_bf16 and
//     exp_bf16: the same on bf16 values (half the bytes), computed in f32
//     inside the kernel. permute_0213: the values as [64, 64, 64, 256] with
//     dims 1 and 2 swapped, made contiguous (attention's [B, T, H, D] to [B,
//     H, T, D]): a walk over four dims, the elementwise kernels' general case.
//   matmul_MxKxN[_dtype]: against the time an 8192^3 matmul of the same dtype
//     takes for the row's FLOPs (8192^3 is where cuBLAS reaches its peak); a
//     dtype the GEMM refuses prints its rows as unavailable with the error.
//   conv_*: bench_conv's layers on the GPU against the f32 8192^3 rate.
//   small_add_x256: 256 adds of 1024 f32 values, called one by one, against
//     the same 256 captured once as a DeviceGraph and replayed: the GPU's
//     work is the same, so the ratio is what calling them costs the host
//     (checks, the output's allocation, the launch) over a replay, and the
//     row's ms / 256 is one small op's cost in a step run as called.
// Op times include allocating their outputs (from the caching allocator).
#include <string>

#include "bench.h"
#include "gpu.h"
#include "quanta.h"

namespace quanta::cli {
namespace {

struct Memory {
  const char* name;
  int64_t buffers_moved;  // buffers of the input's size read and written
  std::function<void()> op;
};

void memory_rows(const GpuTimer& gpu, const BenchOptions& o, Generator& gen,
                 std::vector<BenchRow>& rows) {
  NoGradGuard no_grad;
  const int64_t r = o.small ? 64 : 4096, c = o.small ? 1024 : 16384;
  const Tensor x = rand({r, c}, gen).to(gpu.device);
  const Tensor y = rand({r, c}, gen).to(gpu.device);
  const Tensor row_vec = rand({c}, gen).to(gpu.device);
  const Tensor col_vec = rand({r, 1}, gen).to(gpu.device);
  const Tensor flat = x.reshape({r * c});
  const Tensor swapped = o.small ? x.reshape({4, 16, 16, 64}).permute({0, 2, 1, 3})
                                 : x.reshape({64, 64, 64, 256}).permute({0, 2, 1, 3});
  const Tensor xh = x.to(DType::bf16), yh = y.to(DType::bf16);
  // x's elements as channels-last maps of 64 channels, viewed [N, C, H, W].
  const int64_t side = o.small ? 16 : 64;
  const Tensor maps = x.reshape({r * c / (64 * side * side), side, side, 64}).permute({0, 3, 1, 2});
  const int64_t buffer = r * c * 4;
  // bf16 rows move half the bytes: buffers_moved counts f32-sized buffers.
  const Memory ops[] = {
      {"add_bf16", 3, [&] { Tensor z = add(xh, yh); }},
      {"exp_bf16", 2, [&] { Tensor z = exp(xh); }},
      {"add", 3, [&] { Tensor z = add(x, y); }},
      {"add_broadcast_row", 2, [&] { Tensor z = add(x, row_vec); }},
      {"mul_broadcast_col", 2, [&] { Tensor z = mul(x, col_vec); }},
      {"exp", 2, [&] { Tensor z = exp(x); }},
      {"permute_0213", 2, [&] { Tensor z = swapped.contiguous(); }},
      {"sum", 1, [&] { Tensor s = sum(flat); }},
      {"sum_dim1", 1, [&] { Tensor s = sum(x, {1}); }},
      {"sum_dim0", 1, [&] { Tensor s = sum(x, {0}); }},
      {"amax_dim1", 1, [&] { Tensor s = amax(x, {1}); }},
      {"layer_norm_dim1", 2, [&] { Tensor z = layer_norm(x, {c}); }},
      {"group_norm_channels_last", 2, [&] { Tensor z = group_norm(maps, 16); }},
  };
  for (const Memory& m : ops) {
    const bool half = std::string(m.name).ends_with("_bf16");
    const int64_t bytes = m.buffers_moved * (half ? buffer / 2 : buffer);
    rows.push_back(row_or_error(
        m.name, [&] { return gpu.against_copy(m.op, static_cast<std::size_t>(bytes)); }));
  }
}

void gemm_rows(const GpuTimer& gpu, const BenchOptions& o, Generator& gen,
               std::vector<BenchRow>& rows) {
  NoGradGuard no_grad;
  struct Shape3 {
    const char* name;
    int64_t m, k, n;
  };
  const Shape3 shapes[] = {
      {"matmul_1024", 1024, 1024, 1024},
      {"matmul_4096x4096x256", 4096, 4096, 256},
  };
  const int64_t peak = o.small ? 256 : 8192;
  const double peak_flops = 2.0 * double(peak) * double(peak) * double(peak);
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const std::string suffix = dtype == DType::f32 ? "" : std::string("_") + dtype_name(dtype);
    auto make = [&](int64_t rows_, int64_t cols) {
      return rand({rows_, cols}, gen).to(dtype).to(gpu.device);
    };
    // The peak shape's operands, once per dtype; a dtype that cannot even be
    // made or multiplied there gives every row of it that error.
    Tensor pa, pb;
    std::string why;
    try {
      pa = make(peak, peak);
      pb = make(peak, peak);
      Tensor c = matmul(pa, pb);
      gpu.sync();
    } catch (const std::exception& e) {
      why = e.what();
    }
    for (const Shape3& s : shapes) {
      const std::string name = s.name + suffix;
      if (!why.empty()) {
        rows.push_back(unavailable_row(name, why));
        continue;
      }
      const int64_t m = o.small ? s.m / 16 : s.m, k = o.small ? s.k / 16 : s.k,
                    n = o.small ? s.n / 16 : s.n;
      rows.push_back(row_or_error(name, [&] {
        const Tensor a = make(m, k), b = make(k, n);
        const std::vector<double> ms =
            gpu.time({[&] { Tensor c = matmul(a, b); }, [&] { Tensor c = matmul(pa, pb); }});
        const double flops = 2.0 * double(m) * double(k) * double(n);
        return timed_row(ms[0], ms[1] * flops / peak_flops);
      }));
    }
  }
}

void launch_rows(const GpuTimer& gpu, Generator& gen, std::vector<BenchRow>& rows) {
  NoGradGuard no_grad;
  constexpr int kCalls = 256;
  rows.push_back(row_or_error("small_add_x256", [&] {
    const Tensor a = rand({1024}, gen).to(gpu.device), b = rand({1024}, gen).to(gpu.device);
    Tensor kept;  // the graph's last output, rewritten by each replay
    DeviceGraph adds = DeviceGraph::capture(gpu.device, [&] {
      for (int i = 0; i < kCalls; ++i) kept = add(a, b);
    });
    const std::vector<double> ms = gpu.time({[&] {
                                               for (int i = 0; i < kCalls; ++i)
                                                 Tensor z = add(a, b);
                                             },
                                             [&] { adds.replay(); }});
    return timed_row(ms[0], ms[1]);
  }));
}

}  // namespace

std::vector<BenchRow> bench_engine_cuda(const BenchOptions& o) {
  const GpuTimer gpu{o.device, o.repeat};
  Generator gen(1234);
  std::vector<BenchRow> rows;
  memory_rows(gpu, o, gen, rows);
  gemm_rows(gpu, o, gen, rows);
  launch_rows(gpu, gen, rows);
  for (BenchRow& row : bench_conv(o, gen, [&] { gpu.sync(); })) rows.push_back(row);
  return rows;
}

}  // namespace quanta::cli
