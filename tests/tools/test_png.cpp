// PNG writing read back through libpng; the canvas, the plots and the image
// grids drawn to the sizes and places they promise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "cli_runner.h"
#include "engine/factory.h"
#include "image/canvas.h"
#include "image/grid.h"
#include "image/plot.h"
#include "image/png.h"

using namespace quanta;
using namespace quanta::image;
using quanta::test::contains;
using quanta::test::ScratchDir;

namespace {

bool same_rgb(Rgb a, Rgb b) { return a.r == b.r && a.g == b.g && a.b == b.b; }

int64_t count_color(const Canvas& c, Rgb color, int64_t x0, int64_t y0, int64_t x1, int64_t y1) {
  int64_t n = 0;
  for (int64_t y = y0; y <= y1; ++y)
    for (int64_t x = x0; x <= x1; ++x) n += same_rgb(c.get(x, y), color);
  return n;
}

}  // namespace

TEST_CASE("write_png round-trips gray and RGB images through libpng") {
  ScratchDir dir("png");
  for (int channels : {1, 3}) {
    Image img(37, 11, channels);
    for (size_t i = 0; i < img.pixels.size(); ++i)
      img.pixels[i] = static_cast<uint8_t>((i * 31 + 7) % 256);
    const std::string path = dir.file("img" + std::to_string(channels) + ".png");
    write_png(path, img);
    const Image back = read_png(path);
    CHECK(back.width == 37);
    CHECK(back.height == 11);
    CHECK(back.channels == channels);
    CHECK(back.pixels == img.pixels);
    // The PNG signature starts the file and no temporary file is left behind.
    CHECK(quanta::test::slurp(path).substr(1, 3) == "PNG");
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      files += !e.is_directory();
    CHECK(files == (channels == 1 ? 1 : 2));  // img1.png, then img1.png + img3.png
  }
}

TEST_CASE("write_png and read_png refuse bad input with the file's name") {
  ScratchDir dir("png_bad");
  CHECK_THROWS_WITH_AS(write_png(dir.file("a.png"), Image(4, 4, 2)),
                       doctest::Contains("a.png: PNG writer takes 1 or 3 channels"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(write_png(dir.file("b.png"), Image(0, 4, 1)),
                       doctest::Contains("cannot write a 0 x 4 PNG"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(write_png(dir.file("no/such/dir/c.png"), Image(2, 2, 1)),
                       doctest::Contains("c.png: cannot open for writing"), std::runtime_error);
  std::ofstream(dir.file("text.png")) << "not a png at all";
  CHECK_THROWS_WITH_AS(read_png(dir.file("text.png")), doctest::Contains("not a PNG file"),
                       std::runtime_error);
  write_png(dir.file("ok.png"), Image(64, 64, 3, 200));
  const std::string bytes = quanta::test::slurp(dir.file("ok.png"));
  std::ofstream(dir.file("cut.png"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  CHECK_THROWS_WITH_AS(read_png(dir.file("cut.png")), doctest::Contains("cut.png: cannot read PNG"),
                       std::runtime_error);
}

TEST_CASE("canvas draws clipped rectangles, lines and text") {
  Canvas c(20, 10);
  CHECK(same_rgb(c.get(0, 0), {255, 255, 255}));
  c.fill_rect(-5, -5, 2, 1, {1, 2, 3});  // clipped at the corner
  CHECK(count_color(c, {1, 2, 3}, 0, 0, 19, 9) == 3 * 2);
  c.line(0, 9, 19, 9, {9, 9, 9});
  CHECK(count_color(c, {9, 9, 9}, 0, 9, 19, 9) == 20);
  c.line(5, 2, 8, 5, {7, 7, 7});  // a diagonal: one pixel per column
  CHECK(count_color(c, {7, 7, 7}, 0, 0, 19, 9) == 4);
  CHECK(Canvas::text_width("ab", 1) == 11);
  CHECK(Canvas::text_width("ab", 2) == 22);
  CHECK(Canvas::text_width("", 1) == 0);
  Canvas t(12, 7);
  t.text(0, 0, "1", {0, 0, 0});
  // '1' of the 5x7 font: 1 + 2 + 1 * 4 + 3 pixels.
  CHECK(count_color(t, {0, 0, 0}, 0, 0, 11, 6) == 10);
}

TEST_CASE("nice_ticks cover the range with round steps") {
  const std::vector<double> unit = nice_ticks(0, 1);
  REQUIRE(unit.size() == 6);
  for (size_t i = 0; i < unit.size(); ++i) CHECK(unit[i] == doctest::Approx(0.2 * i));
  const std::vector<double> t = nice_ticks(3, 997, 6);
  REQUIRE(t.size() >= 2);
  CHECK(t.front() >= 3);
  CHECK(t.back() <= 997);
  CHECK(t[1] - t[0] == doctest::Approx(200));
  for (double lo : {-3.7, 0.001, 12.0})
    for (double hi : {lo + 0.01, lo + 5, lo + 12345}) {
      const std::vector<double> ticks = nice_ticks(lo, hi);
      CHECK(ticks.size() >= 2);
      CHECK(ticks.size() <= 11);
    }
}

TEST_CASE("line_plot and bar_chart make PNGs of the stated size with data in them") {
  ScratchDir dir("plots");
  const Rgb blue{31, 119, 180};
  Series s{"train", {}, {}, blue, false};
  for (int i = 1; i <= 100; ++i) {
    s.x.push_back(i);
    s.y.push_back(0.2 * std::exp(-i / 30.0) + 0.01);
  }
  const PlotSpec spec{"loss", "step", "loss", 640, 400, true};
  const Canvas plot = line_plot({s}, spec);
  CHECK(plot.width() == 640);
  CHECK(plot.height() == 400);
  const int64_t drawn = count_color(plot, blue, 0, 0, 639, 399);
  CHECK(drawn >= 300);  // a connected line across ~550 pixels of plot width
  write_png(dir.file("loss.png"), plot.image());
  const Image back = read_png(dir.file("loss.png"));
  CHECK(back.width == 640);
  CHECK(back.height == 400);
  CHECK(back.channels == 3);

  // Empty and degenerate series still draw axes, never crash.
  const Canvas empty = line_plot({}, spec);
  CHECK(count_color(empty, {0, 0, 0}, 0, 0, 639, 399) > 500);
  Series flat{"flat", {1, 2}, {0.5, 0.5}, blue, true};
  CHECK(line_plot({flat}, {"t", "x", "y", 300, 200, false}).width() == 300);

  // Bars: the tallest reaches the top of the y range, an empty bin draws nothing.
  std::vector<double> counts = {10, 0, 5, 20};
  const Canvas bars = bar_chart(counts, {"usage", "code", "count", 400, 300, false});
  CHECK(bars.width() == 400);
  CHECK(bars.height() == 300);
  // Plot area x from 70 to 376: bar i centred at 70 + (i + 0.5) / 4 * 306.
  auto column = [&](int i) {
    const int64_t x = 70 + std::llround((i + 0.5) / 4 * 306);
    return count_color(bars, blue, x, 0, x, 299);
  };
  CHECK(column(1) == 0);
  CHECK(column(3) > column(0));
  CHECK(column(0) > column(2));
  CHECK(column(3) == doctest::Approx(2 * column(0)).epsilon(0.05));
  // Thousands of codes: every used one still shows as at least one column.
  std::vector<double> many(4096, 0.0);
  many[0] = many[4095] = 1;
  const Canvas wide = bar_chart(many, {"usage", "code", "count", 720, 440, false});
  CHECK(count_color(wide, blue, 0, 0, 719, 439) > 0);
  write_png(dir.file("usage.png"), wide.image());
  CHECK(read_png(dir.file("usage.png")).width == 720);
}

TEST_CASE("stack_vertically puts panels one above the other, padding narrower ones white") {
  Canvas red(4, 2, {255, 0, 0}), green(6, 3, {0, 255, 0});
  const Canvas s = stack_vertically({red, green});
  CHECK(s.width() == 6);
  CHECK(s.height() == 5);
  CHECK(count_color(s, {255, 0, 0}, 0, 0, 5, 4) == 8);  // all of red, rows 0-1
  CHECK(count_color(s, {255, 0, 0}, 0, 0, 3, 1) == 8);
  CHECK(count_color(s, {0, 255, 0}, 0, 2, 5, 4) == 18);     // all of green, rows 2-4
  CHECK(count_color(s, {255, 255, 255}, 4, 0, 5, 1) == 4);  // beside the narrower panel
  const Canvas none = stack_vertically({});
  CHECK(none.width() == 1);
  CHECK(none.height() == 1);
}

TEST_CASE("image grids lay tiles out in rows, reconstructions under originals") {
  Tensor imgs = zeros({3, 1, 2, 2});
  imgs.data<float>()[0] = 1.0f;    // image 0, pixel (0, 0)
  imgs.data<float>()[11] = 0.25f;  // image 2, pixel (1, 1)
  imgs.data<float>()[5] = 2.0f;    // image 1: clamped to 1
  const Image g = image_grid(imgs, 2, 1, 1);
  CHECK(g.width == 2 * 2 + 3);
  CHECK(g.height == 2 * 2 + 3);
  CHECK(g.channels == 1);
  CHECK(*g.at(1, 1) == 255);
  CHECK(*g.at(0, 0) == 128);             // padding
  CHECK(*g.at(1 + 3 + 1, 1) == 255);     // image 1 pixel (1, 0), clamped
  CHECK(*g.at(1 + 1, 1 + 3 + 1) == 64);  // image 2 pixel (1, 1): 0.25
  CHECK(image_grid(zeros({0, 1, 28, 28}), 8).width == 1);

  const Tensor orig = full({3, 1, 2, 2}, 1.0), recon = zeros({3, 1, 2, 2});
  const Image r = reconstruction_grid(orig, recon, 2, 1);
  // Two column tiles; rows: originals, reconstructions, originals, reconstructions.
  CHECK(r.width == 2 * 2 + 3 * 2);
  CHECK(r.height == 4 * 2 + 5 * 2);
  CHECK(*r.at(2, 2) == 255);        // row 0: an original
  CHECK(*r.at(2, 2 + 4) == 0);      // row 1: its reconstruction
  CHECK(*r.at(2, 2 + 8) == 255);    // row 2: original 2
  CHECK(*r.at(2 + 4, 2 + 8) == 0);  // the missing 4th tile is blank
}

TEST_CASE("log axes tick within the data's decade instead of rounding out to whole decades") {
  // A loss curve between 0.006 and 0.01 used to sit in a thin band of an
  // axis from 0.001 to 0.1; now the axis is 0.006..0.01 with a tick at each.
  const std::vector<double> narrow = log_ticks(0.006, 0.01);
  REQUIRE(narrow.size() == 5);
  CHECK(narrow.front() == doctest::Approx(0.006));
  CHECK(narrow.back() == doctest::Approx(0.01));
  // Two decades: 1, 2, 5.
  const std::vector<double> mid = log_ticks(0.004, 0.3);
  const std::vector<double> want{0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5};
  REQUIRE(mid.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(mid[i] == doctest::Approx(want[i]));
  // Beyond that, whole decades.
  const std::vector<double> wide = log_ticks(3e-5, 2.0);
  CHECK(wide.size() == 7);
  CHECK(wide.front() == doctest::Approx(1e-5));
  CHECK(wide.back() == doctest::Approx(10.0));
  for (const auto& [lo, hi] : std::vector<std::pair<double, double>>{
           {0.006, 0.01}, {0.004, 0.3}, {3e-5, 2.0}, {1.0, 1.0}, {0.0123, 0.0124}}) {
    const std::vector<double> t = log_ticks(lo, hi);
    INFO(lo << ".." << hi);
    CHECK(t.front() <= lo);
    CHECK(t.back() >= hi);
    CHECK(t.size() >= 2);
  }
}

TEST_CASE("reconstruction figures label their rows and carry a caption") {
  const Tensor orig = full({3, 1, 4, 4}, 1.0), recon = zeros({3, 1, 4, 4});
  const std::string caption = "quantizer vq, step 10, test mse 0.01000";
  const Canvas c = reconstruction_figure(orig, recon, 2, caption, 1);
  const Image grid = reconstruction_grid(orig, recon, 2, 1);
  CHECK(c.width() == std::max(32 + grid.width, Canvas::text_width(caption) + 16));
  CHECK(c.height() == 22 + grid.height);
  const Rgb ink{40, 40, 40};
  CHECK(count_color(c, ink, 0, 0, c.width() - 1, 21) > 50);  // the caption
  // IN beside row 0 (originals), OUT beside row 1 (their reconstructions).
  const int64_t row0 = 22 + 2, row1 = 22 + 2 + 4 + 2;
  CHECK(count_color(c, ink, 0, row0 - 3, 31, row0 + 4 + 3) > 0);
  CHECK(count_color(c, ink, 0, row1 - 3, 31, row1 + 4 + 3) > 0);
  CHECK(same_rgb(c.get(32 + 2, row0), Rgb{255, 255, 255}));  // an original's pixel
  CHECK(same_rgb(c.get(32 + 2, row1), Rgb{0, 0, 0}));        // its reconstruction
  // A caption wider than the grid widens the figure.
  const std::string long_caption(200, 'x');
  CHECK(reconstruction_figure(orig, recon, 2, long_caption, 1).width() >
        Canvas::text_width(long_caption));
}
