#include "engine/precision.h"

namespace quanta {
namespace {
thread_local bool t_bf16_products = false;
}  // namespace

bool mixed_precision_enabled() { return t_bf16_products; }

MixedPrecision::MixedPrecision(bool enabled) : prev_(t_bf16_products) { t_bf16_products = enabled; }
MixedPrecision::~MixedPrecision() { t_bf16_products = prev_; }

}  // namespace quanta
