#pragma once
// The one oneDNN CPU engine the process uses (bf16 products, convolutions),
// for builds with oneDNN (QUANTA_GEMM_ONEDNN). oneDNN threads its primitives
// on OpenMP as quanta does when the build's oneDNN runs on OpenMP; one on
// another runtime would start threads of its own beside quanta's, so the
// callers take oneDNN's primitives only when onednn_on_openmp().
#ifdef QUANTA_GEMM_ONEDNN
#include <map>
#include <oneapi/dnnl/dnnl.hpp>

namespace quanta::cpu {

/** oneDNN's CPU engine, made on first use. */
dnnl::engine& onednn_engine();

/** A stream on onednn_engine() for the calling thread. */
dnnl::stream& onednn_stream();

/** True when the build's oneDNN threads on OpenMP. */
bool onednn_on_openmp();

/** The primitive for `key`, made by make(key) on this thread's first call
 * with it and kept (a primitive's creation runs oneDNN's JIT: far dearer
 * than a call). Bounded: past 256 kept, a workload with ever new shapes
 * rebuilds instead of growing. One cache per (Key, Primitive) pair. */
template <class Key, class Primitive, class Make>
const Primitive& kept_primitive(const Key& key, Make make) {
  constexpr size_t kMaxKept = 256;
  thread_local std::map<Key, Primitive> kept;
  auto it = kept.find(key);
  if (it != kept.end()) return it->second;
  if (kept.size() >= kMaxKept) kept.clear();
  return kept.emplace(key, make(key)).first->second;
}

}  // namespace quanta::cpu
#endif
