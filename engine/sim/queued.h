#pragma once
// How a CPU table entry becomes one of sim's: the call's arguments are copied
// into a closure, with the host arrays some of them point to (an Operand's
// strides, GemmArgs' offsets, add_n's terms, adam_step's parameters), and the closure is queued on
// the current sim device's stream to run the CPU's kernel there. The device pointers are copied as
// they are: they stay valid because sim frees memory on the stream too, after every kernel queued
// before the free.
//
//   .fill = sim::Queued<&cpu::cpu_kernels, &KernelTable::fill>::call,
//
// serves the engine's table (engine/sim/sim_kernels.cpp) and the
// quantizers' (quant/sim/table.cpp) alike.
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/kernels/table.h"
#include "engine/sim/sim_stream.h"

namespace quanta::sim {

/** A copy of one argument that owns what it points to on the host. */
template <typename T>
class Held {
 public:
  Held(const T& v, std::size_t) : value_(v) {}
  const T& get() const { return value_; }

 private:
  T value_;
};

/** An Operand's strides (one per dim of the call's shape) are host memory. */
template <>
class Held<Operand> {
 public:
  Held(const Operand& o, std::size_t ndim)
      : op_(o),
        strides_(o.strides ? std::vector<int64_t>(o.strides, o.strides + ndim)
                           : std::vector<int64_t>{}) {}
  Operand get() const {
    Operand o = op_;
    if (o.strides) o.strides = strides_.data();
    return o;
  }

 private:
  Operand op_;
  std::vector<int64_t> strides_;
};

/** GemmArgs' per-product offsets (batch of each, or null) are host arrays. */
template <>
class Held<GemmArgs> {
 public:
  Held(const GemmArgs& g, std::size_t) : args_(g) {
    const auto n = static_cast<std::size_t>(g.batch);
    if (g.a_off) a_off_.assign(g.a_off, g.a_off + n);
    if (g.b_off) b_off_.assign(g.b_off, g.b_off + n);
  }
  GemmArgs get() const {
    GemmArgs g = args_;
    if (g.a_off) g.a_off = a_off_.data();
    if (g.b_off) g.b_off = b_off_.data();
    return g;
  }

 private:
  GemmArgs args_;
  std::vector<int64_t> a_off_, b_off_;
};

/** A list argument, {data, count} over a host array (add_n's TermList,
 * adam_step's AdamTensorList): the array is copied. */
template <typename T>
concept HostList = requires(const T& t) {
  t.data;
  { t.count } -> std::convertible_to<int64_t>;
};

template <HostList T>
class Held<T> {
 public:
  Held(const T& t, std::size_t) : data_(t.data, t.data + t.count) {}
  T get() const { return {data_.data(), static_cast<int64_t>(data_.size())}; }

 private:
  std::vector<std::remove_cvref_t<decltype(*T::data)>> data_;
};

/** The rank of the call's shape: how many strides each Operand brings. */
inline std::size_t rank_in(const Shape& s) { return s.size(); }
template <typename T>
std::size_t rank_in(const T&) {
  return 0;
}

template <auto Source, auto Member>
struct Queued;

/** Member: an entry of the table that Source() returns (the CPU's). call has
 * the entry's signature, so it fills the same slot of sim's table. */
template <typename Table, const Table& (*Source)(), typename... A, void (*Table::*Member)(A...)>
struct Queued<Source, Member> {
  static void call(A... a) {
    const std::size_t ndim = std::max({std::size_t(0), rank_in(a)...});
    enqueue(current_index(),
            [fn = Source().*Member, held = std::make_tuple(Held<std::decay_t<A>>(a, ndim)...)] {
              std::apply([fn](const auto&... h) { fn(h.get()...); }, held);
            });
  }
};

}  // namespace quanta::sim
