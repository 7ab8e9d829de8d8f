#pragma once
// quanta: the whole public API in one include.
#include "engine/autograd/function.h"
#include "engine/autograd/grad_mode.h"
#include "engine/autograd/node.h"
#include "engine/cpu/parallel.h"
#include "engine/device.h"
#include "engine/dtype.h"
#include "engine/factory.h"
#include "engine/ops/elementwise.h"
#include "engine/ops/reduce.h"
#include "engine/ops/view.h"
#include "engine/tensor.h"
