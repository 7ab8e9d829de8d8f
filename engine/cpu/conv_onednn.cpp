#include "engine/cpu/conv_onednn.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "engine/cpu/block_cache.h"
#include "engine/cpu/gemm_bf16.h"
#include "engine/cpu/image_transpose.h"
#include "engine/cpu/onednn.h"
#include "engine/cpu/parallel.h"

namespace quanta::cpu {
namespace {

bool enabled_at_start() {
  const char* v = std::getenv("QUANTA_CPU_ONEDNN_CONV");
  return !(v && std::strcmp(v, "0") == 0);
}

std::atomic<bool>& enabled() {
  static std::atomic<bool> on(enabled_at_start());
  return on;
}

#ifdef QUANTA_GEMM_ONEDNN
using dnnl::memory;
using dt = memory::data_type;
using tag = memory::format_tag;

// What makes two calls share a primitive: the geometry, the kind, whether
// the products are bf16 and whether the forward adds a bias.
struct ConvKey {
  ConvKind kind;
  int64_t N, C, H, W, O, kh, kw, OH, OW;
  ConvGeom::Pair stride, padding, dilation;
  int64_t groups;
  bool channels_last, bf16, bias;
  auto tie() const {
    return std::tie(kind, N, C, H, W, O, kh, kw, OH, OW, stride, padding, dilation, groups,
                    channels_last, bf16, bias);
  }
  bool operator<(const ConvKey& o) const { return tie() < o.tie(); }
};

// One geometry's primitive, the layouts it reads and writes, and the
// reorder between our plain weight [O, C / groups, kh, kw] and its own.
struct ConvPrimitive {
  std::string kernel;  // oneDNN's implementation; empty: not served
  dnnl::primitive primitive;
  memory::desc act_in, act_in2, act_out;  // a, then b (weight gradient), out
  memory::desc plain_weight, weight;      // ours, and the primitive's
  dnnl::reorder weight_reorder;           // plain -> its own (or back, weight gradient)
  bool reorders_weight = false;
  memory::desc scratchpad;  // its size: 0 when it needs none
};

// Where MixedPrecision asks for bf16 products and they pay on this CPU,
// the forward and the input gradient take them from this many
// multiply-adds; below it, and for every weight gradient, the products stay
// f32. Measured on 2 threads of a Xeon with AMX, each kind in turns with
// oneDNN's f32 kernel, batch 64: the main job's 32-channel layers (29-51M
// multiply-adds) ran 2-4x faster forward and 1.6-2.2x for the input
// gradient; its 1x1 layer (1.6M) and its one-channel layers (6.4M) no
// faster or slower; and every bf16 weight gradient slower than the f32 one
// (enc2's 0.58 against 0.40 ms).
constexpr int64_t kBf16MinMultiplyAdds = int64_t{1} << 23;

bool bf16_for(ConvKind kind, const ConvGeom& g) {
  const int64_t multiply_adds = g.N * g.O * g.L() * g.ckk();
  return g.bf16_products && kind != ConvKind::weight_grad &&
         multiply_adds >= kBf16MinMultiplyAdds && bf16_gemm_native();
}

// oneDNN's kernel for an input gradient down to one channel ran at half the
// speed of ours (the main job's last transposed convolution: 0.64 against
// 0.34 ms); every other kind and layer of the main job at or above ours.
bool ours_are_faster(ConvKind kind, const ConvGeom& g) {
  return kind == ConvKind::input_grad && g.C == 1;
}

ConvKey key_of(ConvKind kind, const ConvGeom& g, bool bias) {
  return {kind,
          g.N,
          g.C,
          g.H,
          g.W,
          g.O,
          g.kh,
          g.kw,
          g.OH,
          g.OW,
          g.stride,
          g.padding,
          g.dilation,
          g.groups,
          g.channels_last,
          bf16_for(kind, g),
          bias};
}

// The primitive for k, or one with no kernel where oneDNN has only its
// reference loops; throws dnnl::error where it has none at all.
ConvPrimitive describe_primitive(const ConvKey& k) {
  ConvPrimitive p;
  // oneDNN's right padding: what makes its output size ours (negative where
  // our output drops input rows; oneDNN's kernels do not all take that).
  const int64_t dkh = (k.kh - 1) * k.dilation[0] + 1, dkw = (k.kw - 1) * k.dilation[1] + 1;
  const memory::dims pad_r{(k.OH - 1) * k.stride[0] + dkh - k.H - k.padding[0],
                           (k.OW - 1) * k.stride[1] + dkw - k.W - k.padding[1]};
  if (pad_r[0] < 0 || pad_r[1] < 0) return p;
  const memory::dims strides{k.stride[0], k.stride[1]};
  const memory::dims dilates{k.dilation[0] - 1, k.dilation[1] - 1};
  const memory::dims pad_l{k.padding[0], k.padding[1]};
  const memory::dims src_dims{k.N, k.C, k.H, k.W}, dst_dims{k.N, k.O, k.OH, k.OW};
  const memory::dims w_dims =
      k.groups == 1 ? memory::dims{k.O, k.C, k.kh, k.kw}
                    : memory::dims{k.groups, k.O / k.groups, k.C / k.groups, k.kh, k.kw};
  const tag act = k.channels_last ? tag::nhwc : tag::nchw;
  const tag w_plain = k.groups == 1 ? tag::oihw : tag::goihw;
  const dt lo = k.bf16 ? dt::bf16 : dt::f32;
  const auto act_desc = [&](const memory::dims& d, dt t) { return memory::desc(d, t, act); };
  const memory::desc w_any(w_dims, lo, tag::any);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::engine& eng = onednn_engine();
  using fwd = dnnl::convolution_forward;
  const auto forward_desc = [&](bool with_bias) {
    return fwd::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
                     act_desc(src_dims, lo), w_any,
                     with_bias ? memory::desc({k.O}, dt::f32, tag::x) : memory::desc(),
                     act_desc(dst_dims, dt::f32), strides, dilates, pad_l, pad_r);
  };
  if (k.kind == ConvKind::forward) {
    const fwd::primitive_desc pd(forward_desc(k.bias), attr, eng);
    p.kernel = pd.impl_info_str();
    p.primitive = fwd(pd);
    p.act_in = pd.src_desc(), p.act_out = pd.dst_desc(), p.weight = pd.weights_desc();
    p.scratchpad = pd.scratchpad_desc();
  } else {
    const fwd::primitive_desc hint(forward_desc(false), eng);
    if (k.kind == ConvKind::input_grad) {
      using bwd = dnnl::convolution_backward_data;
      const bwd::primitive_desc pd(
          bwd::desc(dnnl::algorithm::convolution_direct, act_desc(src_dims, dt::f32), w_any,
                    act_desc(dst_dims, lo), strides, dilates, pad_l, pad_r),
          attr, eng, hint);
      p.kernel = pd.impl_info_str();
      p.primitive = bwd(pd);
      p.act_in = pd.diff_dst_desc(), p.act_out = pd.diff_src_desc(), p.weight = pd.weights_desc();
      p.scratchpad = pd.scratchpad_desc();
    } else {
      using bwd = dnnl::convolution_backward_weights;
      const bwd::primitive_desc pd(
          bwd::desc(dnnl::algorithm::convolution_direct, act_desc(src_dims, lo),
                    memory::desc(w_dims, dt::f32, tag::any), act_desc(dst_dims, lo), strides,
                    dilates, pad_l, pad_r),
          attr, eng, hint);
      p.kernel = pd.impl_info_str();
      p.primitive = bwd(pd);
      p.act_in = pd.src_desc(), p.act_in2 = pd.diff_dst_desc();
      p.weight = pd.diff_weights_desc();
      p.scratchpad = pd.scratchpad_desc();
    }
  }
  // Its reference loops are far slower than our kernels (30-100x measured).
  if (p.kernel.rfind("ref", 0) == 0) return {};
  const bool grad = k.kind == ConvKind::weight_grad;
  p.plain_weight = memory::desc(w_dims, grad ? dt::f32 : lo, w_plain);
  p.reorders_weight = p.weight != p.plain_weight;
  if (p.reorders_weight) {
    const memory::desc& from = grad ? p.weight : p.plain_weight;
    const memory::desc& to = grad ? p.plain_weight : p.weight;
    p.weight_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(eng, from, eng, to));
  }
  return p;
}

ConvPrimitive make_primitive(const ConvKey& k) {
  try {
    return describe_primitive(k);
  } catch (const dnnl::error&) {
    return {};  // a geometry oneDNN does not implement
  }
}

const ConvPrimitive& primitive_for(const ConvKey& key) {
  return kept_primitive<ConvKey, ConvPrimitive>(key, make_primitive);
}

bool path_open() { return enabled().load(std::memory_order_relaxed) && onednn_on_openmp(); }

// n floats of src rounded to bf16 into scratch, in parallel.
const bf16* rounded(const float* src, int64_t n, const ScratchBuffer& scratch) {
  bf16* dst = scratch.as<bf16>();
  parallel_for(0, n, kGrainElements,
               [&](int64_t lo, int64_t hi) { round_to_bf16(src + lo, hi - lo, dst + lo); });
  return dst;
}

// out [N, channels, pixels] (or [N, pixels, channels] channels last) += bias.
void add_channel_bias(float* out, const ConvGeom& g, int64_t channels, int64_t pixels,
                      const float* bias) {
  parallel_for(0, g.N, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      float* img = out + n * channels * pixels;
      if (g.channels_last) {
        for (int64_t p = 0; p < pixels; ++p)
          for (int64_t c = 0; c < channels; ++c) img[p * channels + c] += bias[c];
      } else {
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t p = 0; p < pixels; ++p) img[c * pixels + p] += bias[c];
      }
    }
  });
}
#endif

}  // namespace

bool conv_onednn_enable(bool on) { return enabled().exchange(on, std::memory_order_relaxed); }

std::string conv_onednn_kernel(ConvKind kind, const ConvGeom& g) {
#ifdef QUANTA_GEMM_ONEDNN
  if (!path_open() || ours_are_faster(kind, g)) return "";
  ConvGeom as_run = g;
  if (g.groups == 1) as_run.channels_last = true;  // channels first runs it between transposes
  return primitive_for(key_of(kind, as_run, false)).kernel;
#else
  (void)kind, (void)g;
  return "";
#endif
}

#ifdef QUANTA_GEMM_ONEDNN
namespace {

// One kernel on operands in g's layout through its primitive; false when
// oneDNN does not serve it.
bool run_primitive(ConvKind kind, const ConvGeom& g, const float* a, const float* b,
                   const float* bias, float* out) {
  const bool forward_bias = kind == ConvKind::forward && bias;
  const ConvKey key = key_of(kind, g, forward_bias);
  const ConvPrimitive& p = primitive_for(key);
  if (p.kernel.empty()) return false;
  dnnl::engine& eng = onednn_engine();
  dnnl::stream& stream = onednn_stream();
  const int64_t in_size = kind == ConvKind::input_grad ? g.N * g.O * g.L() : g.N * g.C * g.H * g.W;
  const int64_t b_size = kind == ConvKind::weight_grad ? g.N * g.O * g.L() : g.O * g.ckk();
  // bf16 products: both operands rounded (the weight, or the weight
  // gradient's output gradient, as well as the activation).
  const ScratchBuffer a16(key.bf16 ? sizeof(bf16) * size_t(in_size) : 0);
  const ScratchBuffer b16(key.bf16 ? sizeof(bf16) * size_t(b_size) : 0);
  const void* in = key.bf16 ? static_cast<const void*>(rounded(a, in_size, a16)) : a;
  const void* second = key.bf16 ? static_cast<const void*>(rounded(b, b_size, b16)) : b;
  const ScratchBuffer pad(p.scratchpad.get_size());
  const ScratchBuffer w_own(p.reorders_weight ? p.weight.get_size() : 0);
  try {
    // oneDNN takes handles as void*; it only reads the inputs.
    const auto mem = [&](const memory::desc& d, const void* data) {
      return memory(d, eng, const_cast<void*>(data));
    };
    const memory scratchpad = mem(p.scratchpad, pad.as<void>());
    if (kind == ConvKind::weight_grad) {
      memory grad_w = mem(p.weight, p.reorders_weight ? w_own.as<void>() : out);
      p.primitive.execute(stream, {{DNNL_ARG_SRC, mem(p.act_in, in)},
                                   {DNNL_ARG_DIFF_DST, mem(p.act_in2, second)},
                                   {DNNL_ARG_DIFF_WEIGHTS, grad_w},
                                   {DNNL_ARG_SCRATCHPAD, scratchpad}});
      if (p.reorders_weight) {
        memory plain = mem(p.plain_weight, out);
        p.weight_reorder.execute(stream, grad_w, plain);
      }
    } else {
      memory weight = mem(p.plain_weight, second);
      if (p.reorders_weight) {
        memory own = mem(p.weight, w_own.as<void>());
        p.weight_reorder.execute(stream, weight, own);
        weight = own;
      }
      if (kind == ConvKind::forward) {
        std::unordered_map<int, memory> args{{DNNL_ARG_SRC, mem(p.act_in, in)},
                                             {DNNL_ARG_WEIGHTS, weight},
                                             {DNNL_ARG_DST, mem(p.act_out, out)},
                                             {DNNL_ARG_SCRATCHPAD, scratchpad}};
        if (forward_bias)
          args.emplace(DNNL_ARG_BIAS, mem(memory::desc({g.O}, dt::f32, tag::x), bias));
        p.primitive.execute(stream, args);
      } else {
        p.primitive.execute(stream, {{DNNL_ARG_DIFF_DST, mem(p.act_in, in)},
                                     {DNNL_ARG_WEIGHTS, weight},
                                     {DNNL_ARG_DIFF_SRC, mem(p.act_out, out)},
                                     {DNNL_ARG_SCRATCHPAD, scratchpad}});
      }
    }
    stream.wait();
  } catch (const dnnl::error& e) {
    throw std::runtime_error(std::string("[") + conv_op_name(kind) +
                             "] oneDNN's convolution failed: " + e.what());
  }
  if (kind == ConvKind::input_grad && bias) add_channel_bias(out, g, g.C, g.H * g.W, bias);
  return true;
}

// n images of `channels` x `pixels` each, from one layout to the other, in
// parallel (to_planar when `back`).
void transpose_images(const float* src, int64_t n, int64_t channels, int64_t pixels, bool back,
                      float* dst) {
  parallel_for(0, n, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t at = i * channels * pixels;
      if (back)
        to_planar(src + at, channels, pixels, static_cast<const float*>(nullptr), dst + at);
      else
        to_channels_last(src + at, channels, pixels, dst + at);
    }
  });
}

// A channels-first layer with one group runs the channels-last primitive
// between transposes, as our own kernels compute channels last inside: so
// both layouts give the same bits, as they do without oneDNN.
bool run_channels_first(ConvKind kind, const ConvGeom& g, const float* a, const float* b,
                        const float* bias, float* out) {
  ConvGeom last = g;
  last.channels_last = true;
  if (primitive_for(key_of(kind, last, kind == ConvKind::forward && bias)).kernel.empty())
    return false;
  const int64_t HW = g.H * g.W, L = g.L();
  const int64_t in_c = kind == ConvKind::input_grad ? g.O : g.C;
  const int64_t in_pixels = kind == ConvKind::input_grad ? L : HW;
  const int64_t out_c = kind == ConvKind::forward ? g.O : g.C;
  const int64_t out_pixels = kind == ConvKind::forward ? L : HW;
  const ScratchBuffer a_last(sizeof(float) * size_t(g.N * in_c * in_pixels));
  transpose_images(a, g.N, in_c, in_pixels, false, a_last.as<float>());
  // The weight gradient's second operand is the output gradient.
  const bool grad_w = kind == ConvKind::weight_grad;
  const ScratchBuffer b_last(grad_w ? sizeof(float) * size_t(g.N * g.O * L) : 0);
  if (grad_w) transpose_images(b, g.N, g.O, L, false, b_last.as<float>());
  const ScratchBuffer out_last(grad_w ? 0 : sizeof(float) * size_t(g.N * out_c * out_pixels));
  run_primitive(kind, last, a_last.as<float>(), grad_w ? b_last.as<float>() : b, bias,
                grad_w ? out : out_last.as<float>());
  if (!grad_w) transpose_images(out_last.as<float>(), g.N, out_c, out_pixels, true, out);
  return true;
}

}  // namespace
#endif

bool conv_onednn(ConvKind kind, const ConvGeom& g, const float* a, const float* b,
                 const float* bias, float* out) {
#ifdef QUANTA_GEMM_ONEDNN
  if (!path_open() || ours_are_faster(kind, g)) return false;
  if (!g.channels_last && g.groups == 1) return run_channels_first(kind, g, a, b, bias, out);
  return run_primitive(kind, g, a, b, bias, out);
#else
  (void)kind, (void)g, (void)a, (void)b, (void)bias, (void)out;
  return false;
#endif
}

}  // namespace quanta::cpu
