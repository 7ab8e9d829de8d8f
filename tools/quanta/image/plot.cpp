#include "image/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace quanta::image {
namespace {

constexpr Rgb kBlack{0, 0, 0};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kText{40, 40, 40};
// Margins around the plot area, sized for 6-character tick labels.
constexpr int64_t kLeft = 70, kRight = 24, kTop = 40, kBottom = 48;

std::string tick_label(double v) {
  char buf[32];
  if (v == 0) return "0";
  const double a = std::fabs(v);
  std::snprintf(buf, sizeof buf, (a >= 1e5 || a < 1e-3) ? "%.0e" : "%g", v);
  return buf;
}

// Maps data coordinates into the plot area.
struct Axes {
  int64_t x0, y0, x1, y1;  // plot area in pixels, y0 at the top
  double xlo, xhi, ylo, yhi;
  bool log_y;
  double fy(double y) const { return log_y ? std::log10(y) : y; }
  int64_t px(double x) const {
    return x0 + std::llround((x - xlo) / (xhi - xlo) * static_cast<double>(x1 - x0));
  }
  int64_t py(double y) const {
    const double lo = fy(ylo), hi = fy(yhi);
    return y1 - std::llround((fy(y) - lo) / (hi - lo) * static_cast<double>(y1 - y0));
  }
};

// Widens an empty or degenerate range so the axes can be drawn.
void widen(double& lo, double& hi) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (hi <= lo) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.5;
    lo -= pad, hi += pad;
  }
}

// Frame, grid lines, tick labels and titles.
void draw_frame(Canvas& c, const Axes& a, const PlotSpec& spec, const std::vector<double>& xticks,
                const std::vector<double>& yticks) {
  for (double t : yticks) {
    const int64_t y = a.py(t);
    c.line(a.x0, y, a.x1, y, kGrid);
    c.line(a.x0 - 4, y, a.x0, y, kBlack);
    const std::string s = tick_label(t);
    c.text(a.x0 - 7 - Canvas::text_width(s), y - 3, s, kText);
  }
  for (double t : xticks) {
    const int64_t x = a.px(t);
    c.line(x, a.y0, x, a.y1, kGrid);
    c.line(x, a.y1, x, a.y1 + 4, kBlack);
    const std::string s = tick_label(t);
    c.text(x - Canvas::text_width(s) / 2, a.y1 + 8, s, kText);
  }
  c.line(a.x0, a.y0, a.x0, a.y1, kBlack);
  c.line(a.x0, a.y1, a.x1, a.y1, kBlack);
  c.line(a.x1, a.y0, a.x1, a.y1, kBlack);
  c.line(a.x0, a.y0, a.x1, a.y0, kBlack);
  c.text((c.width() - Canvas::text_width(spec.title, 2)) / 2, 10, spec.title, kBlack, 2);
  c.text((a.x0 + a.x1 - Canvas::text_width(spec.x_label)) / 2, a.y1 + 24, spec.x_label, kText);
  c.text(4, a.y0 - 12, spec.y_label, kText);
}

// A line `width` pixels thick: the one-pixel line, repeated one row down.
void thick_line(Canvas& c, int64_t x0, int64_t y0, int64_t x1, int64_t y1, Rgb color, int width) {
  for (int d = 0; d < std::max(1, width); ++d) c.line(x0, y0 + d, x1, y1 + d, color);
}

}  // namespace

std::vector<double> log_ticks(double lo, double hi) {
  // Every integer mantissa within one decade, 1, 2 and 5 up to two decades,
  // whole decades beyond, where more would crowd the axis.
  const double decades = std::log10(hi) - std::log10(lo);
  const std::vector<double> mantissas = decades <= 1.0
                                            ? std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9}
                                        : decades <= 2.0 ? std::vector<double>{1, 2, 5}
                                                         : std::vector<double>{1};
  std::vector<double> all;
  for (double e = std::floor(std::log10(lo)) - 1; e <= std::ceil(std::log10(hi)) + 1; ++e)
    for (double m : mantissas) all.push_back(m * std::pow(10.0, e));
  // The ticks just below lo and just above hi bound the axis.
  std::vector<double> t;
  for (size_t i = 0; i < all.size(); ++i) {
    const bool below_next = i + 1 < all.size() && all[i + 1] <= lo * (1 + 1e-12);
    const bool above_prev = i > 0 && all[i - 1] >= hi * (1 - 1e-12);
    if (!below_next && !above_prev) t.push_back(all[i]);
  }
  if (t.size() == 1) t.push_back(t.front() * 10);  // lo == hi on a tick: one decade
  return t;
}

std::vector<double> nice_ticks(double lo, double hi, int max_ticks) {
  const double raw = (hi - lo) / std::max(1, max_ticks - 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  std::vector<double> ticks;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9; ++k)
    ticks.push_back(std::fabs(k) < 1e-12 ? 0.0 : k * step);
  return ticks;
}

Canvas line_plot(const std::vector<Series>& series, const PlotSpec& spec) {
  Canvas c(spec.width, spec.height);
  bool log_y = spec.log_y;
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo, ylo = xlo, yhi = -xlo;
  for (const Series& s : series)
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      xlo = std::min(xlo, s.x[i]), xhi = std::max(xhi, s.x[i]);
      ylo = std::min(ylo, s.y[i]), yhi = std::max(yhi, s.y[i]);
    }
  if (!(ylo > 0) || !std::isfinite(ylo) || !std::isfinite(yhi)) log_y = false;
  widen(xlo, xhi);
  std::vector<double> yticks;
  if (log_y) {
    // The axis runs from the tick at or below the data to the one at or
    // above it, so a curve between 0.006 and 0.01 fills the plot.
    if (yhi <= ylo) yhi = ylo * 10;
    yticks = log_ticks(ylo, yhi);
    ylo = yticks.front(), yhi = yticks.back();
  } else {
    widen(ylo, yhi);
    yticks = nice_ticks(ylo, yhi);
    ylo = std::min(ylo, yticks.front()), yhi = std::max(yhi, yticks.back());
  }
  std::vector<double> xticks = nice_ticks(xlo, xhi, 7);
  xlo = std::min(xlo, xticks.front()), xhi = std::max(xhi, xticks.back());
  Axes a{kLeft, kTop, spec.width - kRight, spec.height - kBottom, xlo, xhi, ylo, yhi, log_y};
  draw_frame(c, a, spec, xticks, yticks);

  for (const Series& s : series) {
    bool have_prev = false;
    int64_t prev_x = 0, prev_y = 0;
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i]) || (log_y && s.y[i] <= 0)) {
        have_prev = false;
        continue;
      }
      const int64_t x = a.px(s.x[i]), y = a.py(s.y[i]);
      if (have_prev) thick_line(c, prev_x, prev_y, x, y, s.color, s.width);
      if (s.markers) c.fill_rect(x - 3, y - 3, x + 3, y + 3, s.color);
      prev_x = x, prev_y = y, have_prev = true;
    }
  }
  if (series.size() > 1) {  // legend, top right inside the plot area
    int64_t y = a.y0 + 8;
    for (const Series& s : series) {
      const int64_t x = a.x1 - 10 - Canvas::text_width(s.name) - 22;
      c.fill_rect(x, y + 2, x + 16, y + 3 + std::max(1, s.width), s.color);
      c.text(x + 22, y, s.name, kText);
      y += 14;
    }
  }
  return c;
}

Canvas bar_chart(const std::vector<double>& values, const PlotSpec& spec, const std::string& note) {
  Canvas c(spec.width, spec.height);
  const double n = static_cast<double>(values.size());
  double ymax = 0;
  for (double v : values)
    if (std::isfinite(v)) ymax = std::max(ymax, v);
  if (ymax <= 0) ymax = 1;
  std::vector<double> yticks = nice_ticks(0, ymax);
  ymax = std::max(ymax, yticks.back());
  // Bars are centred on integers: x runs from -0.5 to n - 0.5.
  Axes a{kLeft, kTop, spec.width - kRight, spec.height - kBottom, -0.5, std::max(n, 1.0) - 0.5, 0,
         ymax,  false};
  std::vector<double> xticks;
  if (!values.empty())
    for (double t : nice_ticks(0, std::max(n - 1, 1.0), 7))
      if (t <= n - 1) xticks.push_back(t);
  draw_frame(c, a, spec, xticks, yticks);
  const Rgb bar{31, 119, 180};
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] <= 0) continue;
    const double xi = static_cast<double>(i);
    int64_t left = a.px(xi - 0.4), right = a.px(xi + 0.4);
    if (right < left) right = left;
    c.fill_rect(left, a.py(values[i]), right, a.y1 - 1, bar);
  }
  if (!note.empty())
    c.text((a.x0 + a.x1 - Canvas::text_width(note, 2)) / 2, (a.y0 + a.y1) / 2 - 7, note, kText, 2);
  return c;
}

Canvas stack_vertically(const std::vector<Canvas>& panels) {
  int64_t width = 1, height = 0;
  for (const Canvas& p : panels) {
    width = std::max(width, p.width());
    height += p.height();
  }
  Canvas out(width, std::max<int64_t>(height, 1));
  int64_t top = 0;
  for (const Canvas& p : panels) {
    for (int64_t y = 0; y < p.height(); ++y)
      for (int64_t x = 0; x < p.width(); ++x) out.set(x, top + y, p.get(x, y));
    top += p.height();
  }
  return out;
}

}  // namespace quanta::image
