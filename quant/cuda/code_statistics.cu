// CUDA entry code_statistics (quant/kernels/table.h): a codebook's counts
// and sums of assigned rows, the same bits on every run. The row numbers are
// sorted by code with CUB's radix sort, which is stable, so each code's rows
// stay in row order; a code's count is the length of its run of sorted keys.
// The sums are added in fixed pieces of sorted rows (plans.h:
// code_stats_piece_rows), a block per piece and a thread per column: a code
// whose rows lie in one piece is summed there, in row order, and written; a
// code that spans pieces leaves its part of each (the tail of the piece it
// starts in, the head of every later one), and a second kernel adds those
// parts in piece order. No atomics: the order of every addition is fixed by
// the input alone. (The engine's index_add, which this replaces for the
// codebook, walks all n rows in one thread per column.)
#include <bit>
#include <cub/device/device_radix_sort.cuh>
#include <limits>
#include <stdexcept>
#include <string>

#include "quant/cuda/device.cuh"
#include "quant/cuda/kernels.h"
#include "quant/kernels/code_stats_pieces.h"

namespace quanta::quant::quant_cuda {
namespace {

// keys[i] = idx[i], or k (after every code) when outside [0, k); rows[i] = i.
__global__ void keys_kernel(const int64_t* idx, int64_t n, int64_t k, int32_t* keys,
                            int32_t* rows) {
  QUANTA_GRID_STRIDE(i, n) {
    const int64_t c = idx[i];
    keys[i] = static_cast<int32_t>(c >= 0 && c < k ? c : k);
    rows[i] = static_cast<int32_t>(i);
  }
}

// The first position of the sorted keys holding c or more.
__device__ inline int64_t lower_bound(const int32_t* keys, int64_t n, int64_t c) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < c)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// start[c] = where code c's sorted rows begin, for c in [0, k] (start[k]:
// where the uncounted ones begin); counts[c] = how many there are.
template <class T>
__global__ void runs_kernel(const int32_t* keys, int64_t n, int64_t k, int64_t* start, T* counts) {
  QUANTA_GRID_STRIDE(c, k + 1) {
    const int64_t s = lower_bound(keys, n, c);
    start[c] = s;
    if (c < k) counts[c] = static_cast<T>(lower_bound(keys, n, c + 1) - s);
  }
}

// Piece j = sorted positions [j P, min(n, (j + 1) P)): its keys and row
// numbers staged in shared memory, then each thread walks the piece for its
// columns (quant/kernels/code_stats_pieces.h says where each part goes).
template <class T>
__global__ void pieces_kernel(const int32_t* keys, const int32_t* rows, const T* x, int64_t n,
                              int64_t k, int64_t d, int64_t P, T* sums, T* head, T* tail) {
  extern __shared__ int32_t staged[];
  int32_t* piece_keys = staged;
  int32_t* piece_rows = staged + P;
  const int64_t pieces = (n + P - 1) / P;
  for (int64_t j = blockIdx.x; j < pieces; j += gridDim.x) {
    const int64_t p0 = j * P, len = P < n - p0 ? P : n - p0;
    __syncthreads();  // the last piece's walk is over
    for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
      piece_keys[t] = keys[p0 + t];
      piece_rows[t] = rows[p0 + t];
    }
    __syncthreads();
    const bool from_before = p0 > 0 && keys[p0 - 1] == piece_keys[0];
    const bool into_next = p0 + len < n && keys[p0 + len] == piece_keys[len - 1];
    for (int64_t e = threadIdx.x; e < d; e += blockDim.x)
      fn::walk_piece(piece_keys, piece_rows, len, from_before, into_next, x, d, e, k,
                     [&](fn::PiecePart part, int32_t c, T acc) {
                       T* out = part == fn::PiecePart::head   ? head + j * d
                                : part == fn::PiecePart::tail ? tail + j * d
                                                              : sums + c * d;
                       out[e] = acc;
                     });
  }
}

// Row c of sums for the codes the pieces did not finish: zeros for an
// unused code, its pieces' parts in order for one spanning pieces.
template <class T>
__global__ void combine_kernel(const int64_t* start, int64_t k, int64_t d, int64_t P, const T* head,
                               const T* tail, T* sums) {
  QUANTA_GRID_STRIDE(t, k * d) {
    const int64_t c = t / d, e = t % d;
    const int64_t s = start[c], end = start[c + 1];
    if (s == end)
      sums[t] = T(0);
    else if (fn::spans_pieces(s, end, P))
      sums[t] = fn::combine_code(s, end, P, head, tail, d, e);
  }
}

template <class T>
void statistics(const int64_t* idx, const T* x, int64_t n, int64_t k, int64_t d, T* counts,
                T* sums) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (n > kMax || k >= kMax)
    throw std::invalid_argument("[code_statistics] " + std::to_string(n) + " rows and " +
                                std::to_string(k) + " codes: the CUDA kernel takes fewer than " +
                                "2^31 of each");
  if (k == 0) return;
  if (n == 0) {
    QUANTA_CUDA_CHECK(cudaMemsetAsync(counts, 0, sizeof(T) * k, cuda::stream()));
    QUANTA_CUDA_CHECK(cudaMemsetAsync(sums, 0, sizeof(T) * k * d, cuda::stream()));
    return;
  }
  Scratch<int32_t> keys(2 * n), rows(2 * n);
  const cuda::LaunchConfig g = grid_for(n);
  keys_kernel<<<static_cast<unsigned>(g.blocks), g.threads, 0, cuda::stream()>>>(
      idx, n, k, keys.get(), rows.get());
  QUANTA_CUDA_CHECK_LAUNCH();
  // Keys lie in [0, k]: only their low bit_width(k) bits need sorting.
  const int end_bit = static_cast<int>(std::bit_width(static_cast<uint64_t>(k)));
  int32_t* sorted_keys = keys.get() + n;
  int32_t* sorted_rows = rows.get() + n;
  size_t temp_bytes = 0;
  QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.get(), sorted_keys,
                                                    rows.get(), sorted_rows, n, 0, end_bit,
                                                    cuda::stream()));
  Scratch<unsigned char> temp(std::max<int64_t>(1, static_cast<int64_t>(temp_bytes)));
  QUANTA_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys.get(), sorted_keys,
                                                    rows.get(), sorted_rows, n, 0, end_bit,
                                                    cuda::stream()));
  Scratch<int64_t> start(k + 1);
  const cuda::LaunchConfig gr = grid_for(k + 1);
  runs_kernel<T><<<static_cast<unsigned>(gr.blocks), gr.threads, 0, cuda::stream()>>>(
      sorted_keys, n, k, start.get(), counts);
  QUANTA_CUDA_CHECK_LAUNCH();
  if (d == 0) return;
  const int64_t P = code_stats_piece_rows(n), pieces = (n + P - 1) / P;
  Scratch<T> head(pieces * d), tail(pieces * d);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(pieces, int64_t{1} << 20));
  pieces_kernel<T><<<blocks, code_stats_threads(d), 2 * P * sizeof(int32_t), cuda::stream()>>>(
      sorted_keys, sorted_rows, x, n, k, d, P, sums, head.get(), tail.get());
  QUANTA_CUDA_CHECK_LAUNCH();
  const cuda::LaunchConfig gc = grid_for(k * d);
  combine_kernel<T><<<static_cast<unsigned>(gc.blocks), gc.threads, 0, cuda::stream()>>>(
      start.get(), k, d, P, head.get(), tail.get(), sums);
  QUANTA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void code_statistics(DType dtype, const int64_t* idx, const void* x, int64_t n, int64_t k,
                     int64_t d, void* counts, void* sums) {
  cuda::dispatch_float(dtype, "code_statistics", [&](auto tag) {
    using T = typename decltype(tag)::type;
    statistics<T>(idx, static_cast<const T*>(x), n, k, d, static_cast<T*>(counts),
                  static_cast<T*>(sums));
  });
}

}  // namespace quanta::quant::quant_cuda
