// Convolutions channels last: see conv_channels_last.h. In a chunk of nb
// images, P = nb * OH * OW output pixels; the columns are [P, kh kw C] with
// the kernel tap (i, j) outer and the channel inner, so a tap of one pixel is
// C contiguous floats in both the NHWC image and the columns.
#include "engine/cpu/conv_channels_last.h"

#include <algorithm>
#include <memory>
#include <type_traits>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/conv_chunks.h"
#include "engine/cpu/conv_direct.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/image_transpose.h"

namespace quanta::cpu {
namespace {

// Calls row(p0, t, base, lo, hi) for every output row oh (p0 = oh OW, its
// first pixel) and kernel tap t, in the order (oh, tap): tap t of output
// pixel (oh, ow) reads input pixel base + ow * stride[1] for ow in [lo, hi)
// and lands in the padding elsewhere (everywhere when the tap's input row is
// outside the image). The callers loop over ow themselves, so that their
// inner loops are plain strided loops the compiler unrolls.
template <class Row>
void for_each_tap_row(const ConvGeom& g, Row row) {
  for (int64_t oh = 0; oh < g.OH; ++oh)
    for (int64_t i = 0; i < g.kh; ++i) {
      const int64_t ih = oh * g.stride[0] - g.padding[0] + i * g.dilation[0];
      const bool row_inside = ih >= 0 && ih < g.H;
      for (int64_t j = 0; j < g.kw; ++j) {
        const int64_t dw = j * g.dilation[1] - g.padding[1];
        int64_t lo = 0, hi = 0;
        if (row_inside) valid_range(dw, g.stride[1], g.W, g.OW, lo, hi);
        row(oh * g.OW, i * g.kw + j, ih * g.W + dw, lo, hi);
      }
    }
}

// cols [L, kh kw C] of one NHWC image x [H W, C]; taps in the padding are 0.
// Every element of cols is written once (no fill first), by loops the
// compiler vectorises: C is a few dozen floats, too few for a memcpy call.
template <class T>
void im2col_nhwc(const T* x, T* cols, const ConvGeom& g) {
  const int64_t C = g.C, row = g.kh * g.kw * C, sw = g.stride[1];
  for_each_tap_row(g, [&](int64_t p0, int64_t t, int64_t base, int64_t lo, int64_t hi) {
    T* dst = cols + p0 * row + t * C;
    for (int64_t ow = 0; ow < lo; ++ow)
      for (int64_t c = 0; c < C; ++c) dst[ow * row + c] = T(0);
    for (int64_t ow = lo; ow < hi; ++ow) {
      const T* src = x + (base + ow * sw) * C;
      for (int64_t c = 0; c < C; ++c) dst[ow * row + c] = src[c];
    }
    for (int64_t ow = hi; ow < g.OW; ++ow)
      for (int64_t c = 0; c < C; ++c) dst[ow * row + c] = T(0);
  });
}

// x [H W, C] += col2im(cols): the adjoint of im2col_nhwc. Each pixel's
// terms add in (oh, tap, ow) order whatever C is.
template <class T>
void col2im_nhwc(const T* cols, T* x, const ConvGeom& g) {
  const int64_t C = g.C, row = g.kh * g.kw * C, sw = g.stride[1];
  for_each_tap_row(g, [&](int64_t p0, int64_t t, int64_t base, int64_t lo, int64_t hi) {
    const T* src = cols + p0 * row + t * C;
    if (C == 1) {  // the image down to one channel (a decoder's last layer)
      T* dst = x + base;
      for (int64_t ow = lo; ow < hi; ++ow) dst[ow * sw] += src[ow * row];
      return;
    }
    for (int64_t ow = lo; ow < hi; ++ow) {
      T* dst = x + (base + ow * sw) * C;
      for (int64_t c = 0; c < C; ++c) dst[c] += src[ow * row + c];
    }
  });
}

// The weight [O, C, kh, kw] reordered: element (o, c, tap t) goes to
// dst[o * so + t * st + c * sc]. The GEMM path takes [O, kh kw C] (taps
// outer, channel inner, the columns' order); the direct kernels take
// [kh kw, C, O] forward and [kh kw, O, C] for the input gradient.
struct WeightOrder {
  int64_t so, st, sc;
};
WeightOrder gemm_order(const ConvGeom& g) { return {g.kh * g.kw * g.C, g.C, 1}; }
WeightOrder taps_channels_outputs(const ConvGeom& g) { return {1, g.C * g.O, g.O}; }
WeightOrder taps_outputs_channels(const ConvGeom& g) { return {g.C, g.O * g.C, 1}; }

template <class T>
void reorder_weight(const T* w, const ConvGeom& g, WeightOrder d, T* dst) {
  const int64_t kk = g.kh * g.kw;
  for (int64_t o = 0; o < g.O; ++o)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t t = 0; t < kk; ++t)
        dst[o * d.so + t * d.st + c * d.sc] = w[(o * g.C + c) * kk + t];
}
// The inverse, for the weight gradient.
template <class T>
void weight_from_order(const T* src, const ConvGeom& g, WeightOrder s, T* w) {
  const int64_t kk = g.kh * g.kw;
  for (int64_t o = 0; o < g.O; ++o)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t t = 0; t < kk; ++t)
        w[(o * g.C + c) * kk + t] = src[o * s.so + t * s.st + c * s.sc];
}

// The direct kernels' tap table: the input pixel each tap of each output
// position reads, -1 in the padding.
std::unique_ptr<int32_t[]> tap_table(const ConvGeom& g) {
  const int64_t kk = g.kh * g.kw;
  std::unique_ptr<int32_t[]> table(new int32_t[g.L() * kk]);
  for_each_tap_row(g, [&](int64_t p0, int64_t t, int64_t base, int64_t lo, int64_t hi) {
    for (int64_t ow = 0; ow < g.OW; ++ow)
      table[(p0 + ow) * kk + t] =
          ow >= lo && ow < hi ? static_cast<int32_t>(base + ow * g.stride[1]) : -1;
  });
  return table;
}

}  // namespace

bool channels_last_pays(const ConvGeom& g) { return g.groups == 1 && g.C >= 4; }

template <class T>
void conv_channels_last(ConvKind kind, const T* a, const T* b, const T* bias, T* out,
                        const ConvGeom& g, bool direct) {
  const int64_t L = g.L(), HW = g.H * g.W, ckk = g.ckk(), O = g.O, C = g.C;
  // Activations stored channels last (g.channels_last) are read and written
  // in place; channels-first ones go through per-worker scratch.
  const bool nhwc = g.channels_last;
  // Per worker: the chunk's NHWC images, its columns (the GEMM path only)
  // and its [P, O] block of the output (forward) or of the output gradient
  // (both backwards). The chunks are planned the same way in both layouts,
  // so both give the same bits.
  const int64_t ckk_cols = direct ? 0 : ckk;
  const Chunks plan = plan_chunks(g, HW * C + L * (ckk_cols + O));
  const int64_t images_size = nhwc ? 0 : plan.images * HW * C,
                cols_size = plan.images * L * ckk_cols, rows_size = nhwc ? 0 : plan.images * L * O,
                per_worker = images_size + cols_size + rows_size;
  const ScratchBuffer scratch(sizeof(T) * plan.workers * per_worker);
  auto images_of = [&](int64_t w) { return scratch.as<T>() + w * per_worker; };
  auto cols_of = [&](int64_t w) { return images_of(w) + images_size; };
  auto rows_of = [&](int64_t w) { return cols_of(w) + cols_size; };
  // The weight in the order its kernel reads it; the direct kernels' tap
  // table and the zeros their padding taps read.
  const WeightOrder order = !direct                        ? gemm_order(g)
                            : kind == ConvKind::input_grad ? taps_outputs_channels(g)
                                                           : taps_channels_outputs(g);
  const bool reads_weight = kind != ConvKind::weight_grad;
  const std::unique_ptr<T[]> weight(reads_weight ? new T[O * ckk] : nullptr);
  if (reads_weight) reorder_weight(b, g, order, weight.get());
  const std::unique_ptr<int32_t[]> table = direct ? tap_table(g) : nullptr;
  const std::unique_ptr<T[]> zeros(direct ? new T[C]() : nullptr);

  // A chunk's output gradient gy as rows [nb L, O].
  auto chunk_rows = [&](const T* gy, int64_t n0, int64_t nb, int64_t worker) -> const T* {
    if (nhwc) return gy + n0 * L * O;
    T* rows = rows_of(worker);
    for (int64_t j = 0; j < nb; ++j)
      to_channels_last(gy + (n0 + j) * O * L, O, L, rows + j * L * O);
    return rows;
  };
  // A chunk of images channels last [nb, HW, C]: one channel is already
  // channels last, in place.
  auto chunk_images = [&](const T* x, int64_t n0, int64_t nb, int64_t worker) -> const T* {
    if (nhwc || C == 1) return x + n0 * HW * C;
    T* images = images_of(worker);
    for (int64_t j = 0; j < nb; ++j)
      to_channels_last(x + (n0 + j) * C * HW, C, HW, images + j * HW * C);
    return images;
  };
  // Columns [nb L, kh kw C] of a chunk of NHWC images.
  auto chunk_columns = [&](const T* images, int64_t nb, T* cols) {
    for (int64_t j = 0; j < nb; ++j) im2col_nhwc(images + j * HW * C, cols + j * L * ckk, g);
  };
  // nb images' rows [nb P, channels] into the output: in place (plus the
  // bias) channels last, transposed channels first.
  auto finish = [&](T* rows, int64_t n0, int64_t nb, int64_t channels, int64_t pixels) {
    if (nhwc) {
      if (bias)
        for (int64_t p = 0; p < nb * pixels; ++p)
          for (int64_t c = 0; c < channels; ++c) rows[p * channels + c] += bias[c];
      return;
    }
    for (int64_t j = 0; j < nb; ++j)
      to_planar(rows + j * pixels * channels, channels, pixels, bias,
                out + (n0 + j) * channels * pixels);
  };
  // The direct kernels take f32 only (conv() asks for them only then).
  constexpr bool kF32 = std::is_same_v<T, float>;

  if (kind == ConvKind::forward) {
    // y [nb L, O] = cols [nb L, ckk] . taps^T [ckk, O]
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* y = nhwc ? out + n0 * L * O : rows_of(worker);
      const T* images = chunk_images(a, n0, nb, worker);
      if (direct) {
        if constexpr (kF32)
          conv_direct_forward(images, nb, g, {table.get()}, weight.get(), zeros.get(), y);
      } else {
        T* cols = cols_of(worker);
        chunk_columns(images, nb, cols);
        gemm<T>(nb * L, O, ckk, {cols, ckk, 1}, {weight.get(), 1, ckk}, y, O, false,
                g.bf16_products);
      }
      finish(y, n0, nb, O, L);
    });
  } else if (kind == ConvKind::input_grad) {
    // cols [nb L, ckk] = gy [nb L, O] . taps [O, ckk], then col2im per image
    // (the direct kernel adds each tile's columns into the images itself).
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* images = nhwc ? out + n0 * HW * C : images_of(worker);
      const T* gy = chunk_rows(a, n0, nb, worker);
      std::fill(images, images + nb * HW * C, T(0));
      if (direct) {
        if constexpr (kF32) conv_direct_input_grad(gy, nb, g, {table.get()}, weight.get(), images);
      } else {
        T* cols = cols_of(worker);
        gemm<T>(nb * L, ckk, O, {gy, O, 1}, {weight.get(), ckk, 1}, cols, ckk, false,
                g.bf16_products);
        for (int64_t j = 0; j < nb; ++j) col2im_nhwc(cols + j * L * ckk, images + j * HW * C, g);
      }
      finish(images, n0, nb, C, HW);
    });
  } else {
    // gw [O, ckk] (taps order) += gy^T [O, nb L] . cols [nb L, ckk], or
    // [kh kw, C, O] from the direct kernel; one partial sum per worker, then
    // reordered to [O, C, kh, kw].
    const int64_t wsize = O * ckk;
    std::unique_ptr<T[]> partial(new T[plan.workers * wsize]);
    std::fill(partial.get(), partial.get() + plan.workers * wsize, T(0));
    run_chunks(g, plan, [&](int64_t n0, int64_t nb, int64_t worker) {
      T* acc = partial.get() + worker * wsize;
      const T* images = chunk_images(a, n0, nb, worker);
      const T* gy = chunk_rows(b, n0, nb, worker);
      if (direct) {
        if constexpr (kF32)
          conv_direct_weight_grad(images, gy, nb, g, {table.get()}, zeros.get(), acc);
      } else {
        T* cols = cols_of(worker);
        chunk_columns(images, nb, cols);
        gemm<T>(O, ckk, nb * L, {gy, 1, O}, {cols, ckk, 1}, acc, ckk, true, g.bf16_products);
      }
    });
    for (int64_t w = 1; w < plan.workers; ++w)
      for (int64_t i = 0; i < wsize; ++i) partial[i] += partial[w * wsize + i];
    weight_from_order(partial.get(), g, order, out);
  }
}

template void conv_channels_last<float>(ConvKind, const float*, const float*, const float*, float*,
                                        const ConvGeom&, bool);
template void conv_channels_last<double>(ConvKind, const double*, const double*, const double*,
                                         double*, const ConvGeom&, bool);

}  // namespace quanta::cpu
