// `quanta bench nf4 --device cuda`: the NF4 kernels on a GPU against their
// floors, each timed in turns with its floor (gpu.h). The weight is
// 8192 x 8192 (--size small: 256 x 256; row names stay the same).
//   nf4_dequantize[_bf16]: the nf4 weight into a reused f32 (bf16) buffer,
//     against a device-to-device copy with the same memory traffic (a copy
//     of n bytes reads n and writes n; dequantize reads 0.5625 bytes per
//     weight and writes 4 or 2, so its floor copies half their sum). Issue
//     18's goal: at least 85% of copy bandwidth, ratio <= 1.18.
//   nf4_gemv_8192_b1: nf4_linear of one f32 row (the fused GEMV), against
//     cuBLAS's bf16 product of one row with the bf16 weight (a GEMV through
//     cublasGemmEx) of the same shape. It reads 3.6x fewer bytes; the goal
//     is at least 3x faster, ratio <= 0.33. The GEMV has three kernels
//     (quant/cuda/plans.h: NF4GemvKind): this row runs the default one
//     (QUANTA_NF4_GEMV; unstaged at one row when unset), nf4_gemv_8192_b1_staged,
//     _unstaged and _fixed each kernel, named, against the same floor.
//     These time what a caller waits for, the host's work on each call
//     included, which a GEMV of tens of microseconds may not hide.
//   nf4_gemv_8192_b1_bf16_unstaged, _bf16_fixed: the same with the weight
//     dequantized to bf16 (QLoRA's compute dtype: each value times its scale
//     rounded to bf16 before its product), against the same floor.
//   nf4_gemv_8192_b1_staged_graph, _unstaged_graph, _fixed_graph: each kernel's call and the
//     floor's product captured once (DeviceGraph) and replayed in turns, so
//     the host queues one graph a call: the GPU's time alone, what the GEMV
//     costs inside a captured decoding step. The gap to the row above is
//     the host's share.
//   nf4_gemv_8192_b4_staged, _unstaged: each kernel at 4 rows of x, against
//     cuBLAS's bf16 product of the same 4 rows: which kernel a batch of a few
//     rows should take (staged by default past one row until timed).
//   nf4_linear_8192_b512: nf4_linear of 512 f32 rows (dequantized tiles and
//     cuBLAS), against the f32 GEMM with the f32 weight: what dequantizing
//     on the fly costs at a training batch (QLoRA's forward).
// The floors' transposed weights are made once beforehand; every op and
// floor allocates its output from the caching allocator.
#include <cstdlib>
#include <string>

#include "bench.h"
#include "gpu.h"
#include "quant/nf4/nf4_format.h"
#include "quant/nf4/nf4_linear.h"
#include "quanta.h"

namespace quanta::cli {

std::vector<BenchRow> bench_nf4_cuda(const BenchOptions& o) {
  NoGradGuard no_grad;
  const GpuTimer gpu{o.device, o.repeat};
  const Device dev = gpu.device;
  Generator gen(4343);
  const int64_t n = o.small ? 256 : 8192;  // out = in = n
  const Tensor w = randn({n, n}, gen).to(dev);
  const Tensor q = quant::quantize_nf4(w);
  std::vector<BenchRow> rows;

  for (DType dt : {DType::f32, DType::bf16}) {
    const std::string name = dt == DType::f32 ? "nf4_dequantize" : "nf4_dequantize_bf16";
    rows.push_back(row_or_error(name, [&] {
      const Tensor out = zeros({n, n}, {.dtype = dt, .device = dev});
      return gpu.against_copy([&] { quant::dequantize_into(q, out); }, q.nbytes() + out.nbytes());
    }));
  }

  {
    const Tensor x = randn({1, n}, gen).to(dev);
    const Tensor xb = x.to(DType::bf16);
    const Tensor wt = transpose(w.to(DType::bf16), 0, 1).contiguous();  // [in, out]
    const char* chosen = std::getenv("QUANTA_NF4_GEMV");
    const std::string keep = chosen ? chosen : "";
    // nf4_linear of the f32 rows xf against cuBLAS's product of their bf16 copy.
    const auto gemv_row = [&](const std::string& name, const Tensor& xf) {
      const Tensor xh = xf.to(DType::bf16);
      return row_or_error(name, [&] {
        const std::vector<double> ms = gpu.time(
            {[&] { Tensor y = quant::nf4_linear(xf, q); }, [&] { Tensor y = matmul(xh, wt); }});
        return timed_row(ms[0], ms[1]);
      });
    };
    for (const char* kind : {"", "staged", "unstaged", "fixed"}) {
      // The kernel is read from the environment on every call; the user's
      // choice comes back after the named rows.
      if (*kind) setenv("QUANTA_NF4_GEMV", kind, 1);
      rows.push_back(gemv_row(std::string("nf4_gemv_8192_b1") + (*kind ? "_" : "") + kind, x));
    }
    {
      const Tensor qb = quant::quantize_nf4(w, {.dequant_dtype = DType::bf16});
      for (const char* kind : {"unstaged", "fixed"}) {
        setenv("QUANTA_NF4_GEMV", kind, 1);
        rows.push_back(row_or_error(std::string("nf4_gemv_8192_b1_bf16_") + kind, [&] {
          const std::vector<double> ms = gpu.time(
              {[&] { Tensor y = quant::nf4_linear(x, qb); }, [&] { Tensor y = matmul(xb, wt); }});
          return timed_row(ms[0], ms[1]);
        }));
      }
    }
    const Tensor x4 = randn({4, n}, gen).to(dev);
    for (const char* kind : {"staged", "unstaged"}) {
      setenv("QUANTA_NF4_GEMV", kind, 1);
      rows.push_back(gemv_row(std::string("nf4_gemv_8192_b4_") + kind, x4));
    }
    for (const char* kind : {"staged", "unstaged", "fixed"}) {
      setenv("QUANTA_NF4_GEMV", kind, 1);  // read while capturing
      rows.push_back(row_or_error(std::string("nf4_gemv_8192_b1_") + kind + "_graph", [&] {
        Tensor y, yb;  // the graphs' outputs, rewritten by each replay
        DeviceGraph gemv = DeviceGraph::capture(dev, [&] { y = quant::nf4_linear(x, q); });
        DeviceGraph floor = DeviceGraph::capture(dev, [&] { yb = matmul(xb, wt); });
        const std::vector<double> ms = gpu.time({[&] { gemv.replay(); }, [&] { floor.replay(); }});
        return timed_row(ms[0], ms[1]);
      }));
    }
    if (chosen)
      setenv("QUANTA_NF4_GEMV", keep.c_str(), 1);
    else
      unsetenv("QUANTA_NF4_GEMV");
  }

  rows.push_back(row_or_error("nf4_linear_8192_b512", [&] {
    const Tensor x = randn({o.small ? 64 : 512, n}, gen).to(dev);
    const Tensor wt = transpose(w, 0, 1).contiguous();
    const std::vector<double> ms =
        gpu.time({[&] { Tensor y = quant::nf4_linear(x, q); }, [&] { Tensor y = matmul(x, wt); }});
    return timed_row(ms[0], ms[1]);
  }));
  return rows;
}

}  // namespace quanta::cli
