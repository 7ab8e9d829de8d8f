#pragma once
// A small RGB drawing surface for the training plots: filled rectangles,
// lines and text in a built-in 5x7 pixel font.
//
// Why not cairo (Debian's libcairo2-dev): it would draw anti-aliased lines
// and real fonts, but it brings 20 more packages (X11, fontconfig, freetype,
// pixman) to CI and to every user who builds the tools, and the output would
// then depend on the fonts installed. Three fixed-layout figures need lines,
// rectangles and capital-letter labels; this file (and plot.cpp, grid.cpp)
// does that in ~400 tested lines, and libpng (already a dependency) writes
// the PNGs. Revisit if the figures need curves, transparency or real text.
#include <cstdint>
#include <string>

#include "image/png.h"

namespace quanta::image {

/** An RGB colour. */
struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};

/** Pixels drawn with clipping: anything outside the image is ignored. */
class Canvas {
 public:
  /** A `width` x `height` canvas filled with `background`. */
  Canvas(int64_t width, int64_t height, Rgb background = {255, 255, 255});

  int64_t width() const { return img_.width; }
  int64_t height() const { return img_.height; }
  /** Sets pixel (x, y) when it lies inside. */
  void set(int64_t x, int64_t y, Rgb c);
  /** The colour at (x, y) (inside only). */
  Rgb get(int64_t x, int64_t y) const;
  /** Fills the rectangle [x0, x1] x [y0, y1] (inclusive, any corner order). */
  void fill_rect(int64_t x0, int64_t y0, int64_t x1, int64_t y1, Rgb c);
  /** A one-pixel line from (x0, y0) to (x1, y1) inclusive (Bresenham). */
  void line(int64_t x0, int64_t y0, int64_t x1, int64_t y1, Rgb c);
  /** Draws `text` with its top-left corner at (x, y), each font pixel a
   * `scale` x `scale` block. Letters print as capitals; characters the font
   * lacks print as '?'. */
  void text(int64_t x, int64_t y, const std::string& text, Rgb c, int scale = 1);
  /** Width in pixels of `text` at `scale` (6 per character, less the last gap). */
  static int64_t text_width(const std::string& text, int scale = 1);
  /** Height in pixels of one line of text at `scale`. */
  static int64_t text_height(int scale = 1) { return 7 * scale; }

  /** The pixels as an RGB image. */
  const Image& image() const { return img_; }

 private:
  Image img_;
};

}  // namespace quanta::image
