// Convolutions through cuDNN 9's convolution API (cudnnConvolutionForward,
// BackwardData, BackwardFilter). A plan (descriptors, algorithm, workspace
// size) is made once per device, kind, dtype, geometry and determinism
// setting and kept: making one costs cuDNN's heuristics, running one is a
// launch or two. Everything runs on stream 0, as every other quanta kernel.
#include "engine/cuda/cudnn_conv.h"

#ifdef QUANTA_CUDNN

#include <cudnn.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "engine/cuda/check.cuh"
#include "engine/cuda/kernels.h"
#include "engine/cuda/scratch.h"
#include "engine/cuda/stream.h"
#include "engine/kernels/copy_transposed.h"

#define QUANTA_CUDNN_CHECK(call)                                                          \
  do {                                                                                    \
    cudnnStatus_t quanta_st_ = (call);                                                    \
    if (quanta_st_ != CUDNN_STATUS_SUCCESS)                                               \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +   \
                               ": " #call " failed: " + cudnnGetErrorString(quanta_st_)); \
  } while (0)

namespace quanta::cuda {
namespace {

// The most workspace one algorithm may ask for; a faster one asking more is
// passed over (the im2col path's column budget, for the same reason).
constexpr std::size_t kWorkspaceLimit = std::size_t(256) << 20;

std::atomic<bool> nondeterministic_allowed{false};
std::atomic<int64_t> ran_cudnn{0}, ran_im2col{0};

// The current device's handle, made on first use; handles are never
// destroyed (at exit the CUDA runtime may already be gone). Calls through
// one handle are serialised by its mutex: cuDNN does not promise that two
// threads may share a handle.
struct Handle {
  int device = 0;
  cudnnHandle_t h = nullptr;
  std::mutex mu;
};

Handle& current_handle() {
  static std::mutex mu;
  static std::vector<std::unique_ptr<Handle>> handles;
  int dev = 0;
  QUANTA_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(handles.size()) <= dev) handles.resize(dev + 1);
  if (!handles[dev]) {
    auto h = std::make_unique<Handle>();
    h->device = dev;
    QUANTA_CUDNN_CHECK(cudnnCreate(&h->h));
    QUANTA_CUDNN_CHECK(cudnnSetStream(h->h, stream_of(dev)));
    handles[dev] = std::move(h);
  }
  return *handles[dev];
}

bool cudnn_type(DType dtype, cudnnDataType_t& t) {
  switch (dtype) {
    case DType::f32:
      t = CUDNN_DATA_FLOAT;
      return true;
    case DType::f64:
      t = CUDNN_DATA_DOUBLE;
      return true;
    default:
      return false;
  }
}

// How a plan's algorithm is chosen: among the deterministic ones by cuDNN's
// heuristics (the default); among all by timing them (nondeterminism
// allowed); or, nondeterminism allowed but the stream being captured into a
// graph, where timing would run and wait for work, among all by the
// heuristics (kept apart, so the plan made outside a capture is still timed).
enum class Choice { deterministic, timed, untimed };

// What a plan is found by.
using Key = std::tuple<int, int, int, Choice, std::array<int64_t, 18>>;

Key key_of(int device, ConvKind kind, DType dtype, const ConvGeom& g, Choice choice) {
  return {device,
          static_cast<int>(kind),
          static_cast<int>(dtype),
          choice,
          {g.N, g.C, g.H, g.W, g.O, g.kh, g.kw, g.OH, g.OW, g.stride[0], g.stride[1], g.padding[0],
           g.padding[1], g.dilation[0], g.dilation[1], g.groups, g.channels_last ? 1 : 0,
           g.bf16_products ? 1 : 0}};
}

// One convolution's descriptors and chosen algorithm; usable = false when
// cuDNN takes no algorithm for it (the caller then uses im2col), refused =
// true once the chosen one said "not supported" when it ran (its heuristics
// rank an algorithm before checking every layout and dtype it meets).
struct Plan {
  bool usable = false;
  mutable std::atomic<bool> refused{false};
  cudnnTensorDescriptor_t x = nullptr, y = nullptr, x_bias = nullptr, y_bias = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;
  int algo = 0;
  std::size_t workspace = 0;
  cudnnMathType_t math = CUDNN_FMA_MATH;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (x_bias) cudnnDestroyTensorDescriptor(x_bias);
    if (y_bias) cudnnDestroyTensorDescriptor(y_bias);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
  }
};

bool fits_int(std::initializer_list<int64_t> dims) {
  int64_t total = 1;
  for (int64_t d : dims) {
    if (d <= 0 || d > INT_MAX) return false;
    total *= d;
    if (total > INT_MAX) return false;  // cuDNN's legacy API indexes with int
  }
  return true;
}

bool set_activation(cudnnTensorDescriptor_t d, bool channels_last, cudnnDataType_t t, int64_t n,
                    int64_t c, int64_t h, int64_t w) {
  return cudnnSetTensor4dDescriptor(d, channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, t,
                                    static_cast<int>(n), static_cast<int>(c), static_cast<int>(h),
                                    static_cast<int>(w)) == CUDNN_STATUS_SUCCESS;
}

// The first of cuDNN's heuristic ranking (fastest first) that succeeds, uses
// FMA arithmetic (no TF32 down-conversion; with `tensor_ops`, MixedPrecision's
// convolutions, TF32 tensor cores too, never fp16 conversion), is
// deterministic unless allowed otherwise, and fits the workspace limit.
template <class Perf>
bool choose(const Perf* perf, int count, bool nondeterministic, bool tensor_ops, Plan& p) {
  for (int i = 0; i < count; ++i) {
    const Perf& r = perf[i];
    if (r.status != CUDNN_STATUS_SUCCESS) continue;
    if (r.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (r.mathType == CUDNN_TENSOR_OP_MATH && !tensor_ops) continue;
    if (!nondeterministic && r.determinism != CUDNN_DETERMINISTIC) continue;
    if (r.memory > kWorkspaceLimit) continue;
    p.algo = static_cast<int>(r.algo);
    p.workspace = r.memory;
    // CUDNN_DEFAULT_MATH lets Ampere and later GPUs round f32 operands to
    // TF32: without tensor_ops the descriptor stays FMA (an algorithm that
    // cannot run so answers "not supported", and im2col runs it).
    p.math = tensor_ops ? r.mathType : CUDNN_FMA_MATH;
    return true;
  }
  return false;
}

std::unique_ptr<Plan> make_plan(cudnnHandle_t h, ConvKind kind, DType dtype, const ConvGeom& g,
                                Choice choice) {
  const bool nondeterministic = choice != Choice::deterministic;
  const bool timed = choice == Choice::timed;
  auto p = std::make_unique<Plan>();
  cudnnDataType_t t{};
  if (!cudnn_type(dtype, t)) return p;
  if (g.N == 0 || !fits_int({g.N, g.C, g.H, g.W}) || !fits_int({g.N, g.O, g.OH, g.OW}) ||
      !fits_int({g.O, g.cg(), g.kh, g.kw}))
    return p;
  QUANTA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x));
  QUANTA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y));
  QUANTA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->x_bias));
  QUANTA_CUDNN_CHECK(cudnnCreateTensorDescriptor(&p->y_bias));
  QUANTA_CUDNN_CHECK(cudnnCreateFilterDescriptor(&p->w));
  QUANTA_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&p->conv));
  // A descriptor cuDNN will not take (a layout and dtype it has no
  // convolution for) leaves the plan unusable: im2col runs it, every call.
  const int64_t cg = g.cg();
  if (!set_activation(p->x, g.channels_last, t, g.N, g.C, g.H, g.W) ||
      !set_activation(p->y, g.channels_last, t, g.N, g.O, g.OH, g.OW) ||
      !set_activation(p->x_bias, false, t, 1, g.C, 1, 1) ||
      !set_activation(p->y_bias, false, t, 1, g.O, 1, 1))
    return p;
  // Channels-last algorithms read the filter channels last too, [O, kh, kw,
  // C / groups], as PyTorch hands it to them: run() transposes our
  // [O, C / groups, kh, kw] weight (and weight gradient) to and from that.
  const bool tensor_ops = g.bf16_products && dtype == DType::f32;
  if (cudnnSetFilter4dDescriptor(p->w, t, g.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                 static_cast<int>(g.O), static_cast<int>(cg),
                                 static_cast<int>(g.kh),
                                 static_cast<int>(g.kw)) != CUDNN_STATUS_SUCCESS ||
      cudnnSetConvolution2dDescriptor(
          p->conv, static_cast<int>(g.padding[0]), static_cast<int>(g.padding[1]),
          static_cast<int>(g.stride[0]), static_cast<int>(g.stride[1]),
          static_cast<int>(g.dilation[0]), static_cast<int>(g.dilation[1]), CUDNN_CROSS_CORRELATION,
          t) != CUDNN_STATUS_SUCCESS ||
      cudnnSetConvolutionGroupCount(p->conv, static_cast<int>(g.groups)) != CUDNN_STATUS_SUCCESS ||
      // cuDNN has no bf16 math for f32 data: MixedPrecision's convolutions
      // may take TF32 tensor cores instead (10 mantissa bits of the operands).
      cudnnSetConvolutionMathType(p->conv, tensor_ops ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH) !=
          CUDNN_STATUS_SUCCESS)
    return p;

  // cuDNN's own output size must be the geometry's (it is, for every
  // geometry the ops make; anything else is left to im2col).
  int n = 0, c = 0, oh = 0, ow = 0;
  if (cudnnGetConvolution2dForwardOutputDim(p->conv, p->x, p->w, &n, &c, &oh, &ow) !=
          CUDNN_STATUS_SUCCESS ||
      n != g.N || c != g.O || oh != g.OH || ow != g.OW)
    return p;

  // Deterministic plans rank cuDNN's algorithms by its heuristics, the same
  // ranking every run. Where nondeterminism is allowed anyway, cuDNN times
  // them on this GPU (the Find calls: once per plan, on scratch buffers of
  // their own) and the fastest that qualifies wins, as PyTorch's
  // cudnn.benchmark does.
  constexpr int kMaxAlgos = 16;
  int count = 0;
  bool chosen = false;
  cudnnStatus_t st{};
  if (kind == ConvKind::forward) {
    cudnnConvolutionFwdAlgoPerf_t perf[kMaxAlgos];
    st = timed ? cudnnFindConvolutionForwardAlgorithm(h, p->x, p->w, p->conv, p->y, kMaxAlgos,
                                                      &count, perf)
               : cudnnGetConvolutionForwardAlgorithm_v7(h, p->x, p->w, p->conv, p->y, kMaxAlgos,
                                                        &count, perf);
    chosen = st == CUDNN_STATUS_SUCCESS && choose(perf, count, nondeterministic, tensor_ops, *p);
  } else if (kind == ConvKind::input_grad) {
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMaxAlgos];
    st = timed ? cudnnFindConvolutionBackwardDataAlgorithm(h, p->w, p->y, p->conv, p->x, kMaxAlgos,
                                                           &count, perf)
               : cudnnGetConvolutionBackwardDataAlgorithm_v7(h, p->w, p->y, p->conv, p->x,
                                                             kMaxAlgos, &count, perf);
    chosen = st == CUDNN_STATUS_SUCCESS && choose(perf, count, nondeterministic, tensor_ops, *p);
  } else {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMaxAlgos];
    st = timed ? cudnnFindConvolutionBackwardFilterAlgorithm(h, p->x, p->y, p->conv, p->w,
                                                             kMaxAlgos, &count, perf)
               : cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, p->x, p->y, p->conv, p->w,
                                                               kMaxAlgos, &count, perf);
    chosen = st == CUDNN_STATUS_SUCCESS && choose(perf, count, nondeterministic, tensor_ops, *p);
  }
  // The descriptor runs in the math type the chosen algorithm was ranked in.
  if (chosen) QUANTA_CUDNN_CHECK(cudnnSetConvolutionMathType(p->conv, p->math));
  p->usable = chosen;
  return p;
}

// The plan for this convolution on the current device, made on first use.
// Plans live as long as the process: a training run meets a handful of
// geometries (the last, smaller batch and evaluation's add a few).
const Plan& plan_for(Handle& h, ConvKind kind, DType dtype, const ConvGeom& g) {
  static std::mutex mu;
  static std::map<Key, std::unique_ptr<Plan>> plans;
  Choice choice = Choice::deterministic;
  if (nondeterministic_allowed.load(std::memory_order_relaxed))
    choice = capturing(h.device) ? Choice::untimed : Choice::timed;
  const Key key = key_of(h.device, kind, dtype, g, choice);
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans.find(key);
  if (it == plans.end()) {
    std::lock_guard<std::mutex> handle_lock(h.mu);
    it = plans.emplace(key, make_plan(h.h, kind, dtype, g, choice)).first;
  }
  return *it->second;
}

// Whether a geometry's weight [O, C / groups, kh, kw] and the channels-last
// filter [O, kh, kw, C / groups] differ in memory (not when either of the
// two swapped runs has length 1).
bool filter_transposed(const ConvGeom& g) {
  return g.channels_last && g.cg() > 1 && g.kh * g.kw > 1;
}

// cuDNN's "not supported" answer (in cuDNN 9 a family, 3000-3999; in cuDNN 8
// one code, 9): the call did nothing, and the im2col path can run the
// convolution instead.
bool not_supported(cudnnStatus_t st) {
#if CUDNN_MAJOR >= 9
  return st >= CUDNN_STATUS_NOT_SUPPORTED && st < CUDNN_STATUS_INTERNAL_ERROR;
#else
  return st == CUDNN_STATUS_NOT_SUPPORTED;
#endif
}

// A refusal, said once per plan: the convolution is correct through im2col
// but slower, which a user tuning a model should know (and a GPU run's log
// says why).
void note_refusal(const Plan& p, ConvKind kind, DType dtype, const ConvGeom& g, cudnnStatus_t st) {
  if (p.refused.exchange(true)) return;
  static const char* const kinds[] = {"forward", "input gradient", "weight gradient"};
  std::fprintf(stderr,
               "quanta: cuDNN refused its algorithm %d for a %s %s %s convolution "
               "(N %lld, C %lld, O %lld, %lldx%lld, kernel %lldx%lld, groups %lld): %s; it runs "
               "through im2col\n",
               p.algo, dtype == DType::f64 ? "f64" : "f32", g.channels_last ? "NHWC" : "NCHW",
               kinds[static_cast<int>(kind)], static_cast<long long>(g.N),
               static_cast<long long>(g.C), static_cast<long long>(g.O),
               static_cast<long long>(g.H), static_cast<long long>(g.W),
               static_cast<long long>(g.kh), static_cast<long long>(g.kw),
               static_cast<long long>(g.groups), cudnnGetErrorString(st));
}

// Runs the plan; false, with `refusal` set, when cuDNN refuses the
// convolution or its bias (im2col then writes all of `out` again); any other
// failure throws.
template <class Scalar>
bool run(Handle& h, const Plan& p, ConvKind kind, const ConvGeom& g, const void* a, const void* b,
         const void* bias, void* out, cudnnStatus_t& refusal) {
  const Scalar one = 1, zero = 0;
  Scratch<unsigned char> workspace(static_cast<int64_t>(p.workspace));
  const bool transposed = filter_transposed(g);
  const int64_t taps = g.kh * g.kw;
  Scratch<Scalar> filter(transposed ? g.O * g.cg() * taps : 0);
  if (transposed && kind != ConvKind::weight_grad) {
    copy_transposed(copy, dtype_v<Scalar>, g.O, g.cg(), taps, b, filter.get());
    b = filter.get();
  }
  void* const weight_grad = transposed ? filter.get() : out;
  std::lock_guard<std::mutex> lock(h.mu);
  cudnnStatus_t st{};
  if (kind == ConvKind::forward) {
    st = cudnnConvolutionForward(h.h, &one, p.x, a, p.w, b, p.conv,
                                 static_cast<cudnnConvolutionFwdAlgo_t>(p.algo), workspace.get(),
                                 p.workspace, &zero, p.y, out);
  } else if (kind == ConvKind::input_grad) {
    st = cudnnConvolutionBackwardData(h.h, &one, p.w, b, p.y, a, p.conv,
                                      static_cast<cudnnConvolutionBwdDataAlgo_t>(p.algo),
                                      workspace.get(), p.workspace, &zero, p.x, out);
  } else {
    st = cudnnConvolutionBackwardFilter(h.h, &one, p.x, a, p.y, b, p.conv,
                                        static_cast<cudnnConvolutionBwdFilterAlgo_t>(p.algo),
                                        workspace.get(), p.workspace, &zero, p.w, weight_grad);
  }
  if (st == CUDNN_STATUS_SUCCESS && bias && kind != ConvKind::weight_grad)
    st = kind == ConvKind::forward ? cudnnAddTensor(h.h, &one, p.y_bias, bias, &one, p.y, out)
                                   : cudnnAddTensor(h.h, &one, p.x_bias, bias, &one, p.x, out);
  if (not_supported(st)) {
    // A refusal after a failed kernel launch (shared memory, launch
    // parameters) leaves the launch error set: the im2col path's own launch
    // check would report it.
    (void)cudaGetLastError();
    refusal = st;
    return false;
  }
  QUANTA_CUDNN_CHECK(st);
  if (kind == ConvKind::weight_grad && transposed)
    copy_transposed(copy, dtype_v<Scalar>, g.O, taps, g.cg(), weight_grad, out);
  return true;
}

}  // namespace

bool cudnn_conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
                const void* bias, void* out) {
  if (no_work(g)) return false;
  Handle& h = current_handle();
  const Plan& p = plan_for(h, kind, dtype, g);
  bool ran = p.usable && !p.refused.load(std::memory_order_relaxed);
  if (ran) {
    cudnnStatus_t refusal = CUDNN_STATUS_SUCCESS;
    ran = dtype == DType::f64 ? run<double>(h, p, kind, g, a, b, bias, out, refusal)
                              : run<float>(h, p, kind, g, a, b, bias, out, refusal);
    if (!ran) note_refusal(p, kind, dtype, g, refusal);
  }
  (ran ? ran_cudnn : ran_im2col).fetch_add(1, std::memory_order_relaxed);
  return ran;
}

void prepare_cudnn() { current_handle(); }

ConvPaths conv_paths_taken() {
  return {.cudnn_linked = true, .cudnn = ran_cudnn.load(), .im2col = ran_im2col.load()};
}

void set_cudnn_nondeterministic(bool allowed) { nondeterministic_allowed.store(allowed); }

}  // namespace quanta::cuda

#else  // a CUDA module built without cuDNN: im2col for everything

#include <atomic>

namespace quanta::cuda {
namespace {
std::atomic<int64_t> ran_im2col{0};
}

bool cudnn_conv(ConvKind, DType, const ConvGeom& g, const void*, const void*, const void*, void*) {
  if (no_work(g)) return false;
  ran_im2col.fetch_add(1, std::memory_order_relaxed);
  return false;
}

void prepare_cudnn() {}

ConvPaths conv_paths_taken() {
  return {.cudnn_linked = false, .cudnn = 0, .im2col = ran_im2col.load()};
}

void set_cudnn_nondeterministic(bool) {}

}  // namespace quanta::cuda

#endif
