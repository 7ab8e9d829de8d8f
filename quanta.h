#pragma once
// quanta: the engine's public API in one include (tensors, ops, autograd,
// nn, optim, random, io), plus the output and token-layout types every
// quantizer shares. The quantizers (quant/vq/, quant/scalar/), NF4
// (quant/nf4/), QuantizerSync (quant/sync/) and dist (dist/dist.h) have
// their own headers, included where they are used (README.md, "A tour of
// the API").
#include "engine/autograd/function.h"
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/factory.h"
#include "engine/io/safetensors.h"
#include "engine/nn/init.h"
#include "engine/nn/layers.h"
#include "engine/nn/module.h"
#include "engine/ops/conv.h"
#include "engine/ops/dropout.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/index.h"
#include "engine/ops/join.h"
#include "engine/ops/linalg.h"
#include "engine/ops/loss.h"
#include "engine/ops/norm.h"
#include "engine/ops/pool.h"
#include "engine/ops/reduce.h"
#include "engine/ops/reductions.h"
#include "engine/ops/softmax.h"
#include "engine/ops/view.h"
#include "engine/optim/optimizer.h"
#include "engine/optim/schedule.h"
#include "engine/random/generator.h"
#include "engine/random/philox.h"
#include "engine/random/sampling.h"
#include "engine/tensor.h"
#include "quant/quantize_output.h"
#include "quant/token_layout.h"
