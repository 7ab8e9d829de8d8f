#pragma once
// Placeholder: filled in by its owner.
#include "engine/tensor.h"
