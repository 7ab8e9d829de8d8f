#pragma once
// Options as data: each family's options struct names its fields with the
// reference's keywords once (`for_each_option`, in quant/vq/vq_option_fields.h
// and quant/scalar/scalar_option_fields.h), and everything that reads or
// shows options by name goes through it: `quanta parity` building a layer
// from a reference case, `quanta train` building one from its config, and
// --print-config showing what a run resolved to (quant/option_json.h reads
// and writes the fields as JSON).
//
// for_each_option(opts, visit) calls visit(name, field, kind) for every field
// the reference has a keyword for, the stack's own fields first, then its
// layers' (those the stack sets per layer left out).

namespace quanta::quant {

/** What a field's value may be, besides its type. */
enum class OptionKind {
  /** Any value of the field's type. */
  value,
  /** A size or count: a given value is a whole number >= 1 (0 in the struct
   * means "derived", which no configuration can spell). */
  size,
};

}  // namespace quanta::quant
