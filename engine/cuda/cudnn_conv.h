#pragma once
// Convolutions through cuDNN, inside the CUDA module. conv_kernels.cu asks
// here first and keeps its im2col + cuBLAS path for what cuDNN refuses (a
// dtype or geometry no algorithm takes, tensors past cuDNN's 32-bit sizes)
// and for builds without cuDNN (QUANTA_CUDNN unset).
#include <cstdint>

#include "engine/cuda/module.h"
#include "engine/dtype.h"
#include "engine/kernels/conv_geom.h"

namespace quanta::cuda {

/** Runs the table's conv entry (engine/kernels/table.h) through cuDNN and
 * returns true, or returns false having done nothing when cuDNN does not
 * take this kind, dtype and geometry. The algorithm is chosen once per
 * device, kind, dtype, geometry and determinism setting and cached: by
 * cuDNN's heuristics among the deterministic ones (not by timing, so the
 * choice, and with it the result, is the same run after run), or, where
 * nondeterminism is allowed, by timing every algorithm on this GPU. f32 runs
 * with FMA arithmetic, never TF32. */
bool cudnn_conv(ConvKind kind, DType dtype, const ConvGeom& g, const void* a, const void* b,
                const void* bias, void* out);

/** Makes the current device's cuDNN handle if it has none yet (a graph's
 * capture calls it before starting: making one allocates and waits). */
void prepare_cudnn();

/** A convolution with no element to compute (zero images, channels or
 * pixels): cudnn_conv leaves it to its caller, uncounted. */
inline bool no_work(const ConvGeom& g) { return g.N * g.C * g.H * g.W * g.O * g.OH * g.OW == 0; }

/** The convolutions (but those with no work) cudnn_conv has run (cudnn)
 * and refused (im2col: its caller runs those), on every device, since the
 * module was loaded. */
ConvPaths conv_paths_taken();

/** Whether cuDNN may choose algorithms whose results vary from run to run
 * (atomics in the data and filter gradients, and a choice made by timing):
 * off (deterministic) unless set, for every device of the process. */
void set_cudnn_nondeterministic(bool allowed);

}  // namespace quanta::cuda
