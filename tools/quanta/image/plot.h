#pragma once
// The two training plots, drawn on a Canvas: a line plot with axes, ticks and
// a legend (the loss curve) and a bar chart (codebook usage).
#include <cstdint>
#include <string>
#include <vector>

#include "image/canvas.h"

namespace quanta::image {

/** One line of a line plot. Points with a non-finite coordinate (or a
 * non-positive y on a log axis) are skipped. */
struct Series {
  std::string name;
  std::vector<double> x, y;
  Rgb color{31, 119, 180};
  /** Draw a small square at each point as well as the line. */
  bool markers = false;
  /** Line thickness in pixels. */
  int width = 1;
};

/** Titles, size and axis kind of a plot. */
struct PlotSpec {
  std::string title;
  std::string x_label;
  std::string y_label;
  int64_t width = 720;
  int64_t height = 440;
  /** Logarithmic y axis (log_ticks); falls back to linear when a value is <= 0. */
  bool log_y = false;
};

/** "Nice" tick positions covering [lo, hi]: multiples of 1, 2 or 5 times a
 * power of ten, at most about `max_ticks` of them; lo < hi. */
std::vector<double> nice_ticks(double lo, double hi, int max_ticks = 6);

/** Ticks of a logarithmic axis covering [lo, hi] (0 < lo <= hi): 1..9 times
 * powers of ten within one decade, 1, 2 and 5 times up to two, whole decades
 * beyond; the first is at or below lo, the last at or above hi. */
std::vector<double> log_ticks(double lo, double hi);

/** A line plot of `series` with axes, tick labels, titles and a legend (when
 * there is more than one series). An empty plot still has its axes. */
Canvas line_plot(const std::vector<Series>& series, const PlotSpec& spec);

/** A bar chart of `values` (bar i at x = i), with axes and tick labels; each
 * bar at least one pixel wide, so thousands of bars still show. `note` (if
 * set) is printed in the plot area, e.g. to say why there are no bars. */
Canvas bar_chart(const std::vector<double>& values, const PlotSpec& spec,
                 const std::string& note = "");

/** `panels` one above the other, left-aligned, as wide as the widest (the
 * rest white); an empty list gives a 1x1 white canvas. */
Canvas stack_vertically(const std::vector<Canvas>& panels);

}  // namespace quanta::image
