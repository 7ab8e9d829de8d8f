// libpng reports errors by longjmp: every libpng call below sits between a
// setjmp and the cleanup, and nothing with a destructor is created after the
// setjmp inside the same frame.
#include "image/png.h"

#include <png.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace quanta::image {
namespace {

// libpng's error callback: keep the message, then longjmp back.
void on_png_error(png_structp png, png_const_charp msg) {
  auto* out = static_cast<std::string*>(png_get_error_ptr(png));
  if (out) *out = msg;
  png_longjmp(png, 1);
}
void on_png_warning(png_structp, png_const_charp) {}

// Returns an empty string on success, libpng's message otherwise.
std::string write_png_file(FILE* fp, const Image& img) {
  std::string err;
  png_structp png =
      png_create_write_struct(PNG_LIBPNG_VER_STRING, &err, on_png_error, on_png_warning);
  if (!png) return "cannot create a libpng writer";
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    return "cannot create a libpng info struct";
  }
  std::vector<png_bytep> rows(static_cast<size_t>(img.height));
  for (int64_t y = 0; y < img.height; ++y) rows[y] = const_cast<png_bytep>(img.at(0, y));
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return err.empty() ? "libpng error" : err;
  }
  png_init_io(png, fp);
  png_set_IHDR(png, info, static_cast<png_uint_32>(img.width), static_cast<png_uint_32>(img.height),
               8, img.channels == 1 ? PNG_COLOR_TYPE_GRAY : PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return "";
}

}  // namespace

Image::Image(int64_t w, int64_t h, int c, uint8_t fill)
    : width(w), height(h), channels(c), pixels(static_cast<size_t>(w * h * c), fill) {}

void write_png(const std::string& path, const Image& img) {
  if (img.channels != 1 && img.channels != 3)
    throw std::invalid_argument(path + ": PNG writer takes 1 or 3 channels, got " +
                                std::to_string(img.channels));
  if (img.width <= 0 || img.height <= 0 || img.width > (1 << 24) || img.height > (1 << 24))
    throw std::invalid_argument(path + ": cannot write a " + std::to_string(img.width) + " x " +
                                std::to_string(img.height) + " PNG");
  if (img.pixels.size() != static_cast<size_t>(img.width * img.height * img.channels))
    throw std::invalid_argument(path + ": pixel buffer does not match the image size");
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (!fp) throw std::runtime_error(path + ": cannot open for writing");
  std::string err = write_png_file(fp, img);
  if (std::fclose(fp) != 0 && err.empty()) err = "write failed";
  std::error_code ec;
  if (err.empty()) std::filesystem::rename(tmp, path, ec);
  if (!err.empty() || ec) {
    std::filesystem::remove(tmp, ec);
    throw std::runtime_error(path + ": cannot write PNG (" +
                             (err.empty() ? std::string("rename failed") : err) + ")");
  }
}

Image read_png(const std::string& path) {
  FILE* fp = std::fopen(path.c_str(), "rb");
  if (!fp) throw std::runtime_error(path + ": cannot open");
  uint8_t sig[8] = {};
  if (std::fread(sig, 1, 8, fp) != 8 || png_sig_cmp(sig, 0, 8) != 0) {
    std::fclose(fp);
    throw std::runtime_error(path + ": not a PNG file");
  }
  std::string err;
  png_structp png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, &err, on_png_error, on_png_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) {
    png_destroy_read_struct(&png, &info, nullptr);
    std::fclose(fp);
    throw std::runtime_error(path + ": cannot create a libpng reader");
  }
  Image img;
  std::vector<png_bytep> rows;
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    std::fclose(fp);
    throw std::runtime_error(path + ": cannot read PNG (" + err + ")");
  }
  png_init_io(png, fp);
  png_set_sig_bytes(png, 8);
  png_read_info(png, info);
  png_set_strip_16(png);
  png_set_strip_alpha(png);
  png_set_packing(png);
  png_set_palette_to_rgb(png);
  png_set_expand_gray_1_2_4_to_8(png);
  png_read_update_info(png, info);
  img.width = png_get_image_width(png, info);
  img.height = png_get_image_height(png, info);
  img.channels = png_get_channels(png, info);
  if (img.channels != 1 && img.channels != 3) png_error(png, "unsupported channel count");
  img.pixels.assign(static_cast<size_t>(img.width * img.height * img.channels), 0);
  rows.resize(static_cast<size_t>(img.height));
  for (int64_t y = 0; y < img.height; ++y) rows[y] = img.at(0, y);
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  std::fclose(fp);
  return img;
}

}  // namespace quanta::image
