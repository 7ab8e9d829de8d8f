// The IDX reader and the Fashion-MNIST loader on hand-made files: valid,
// corrupt, truncated, wrong type, wrong sizes.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <new>

#include "cli_runner.h"
#include "data/fashion_mnist.h"
#include "data/idx.h"

using namespace quanta;
using quanta::test::contains;
using quanta::test::ScratchDir;

namespace {

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const std::string& path, const std::vector<uint8_t>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

data::IdxArray make_array(std::vector<int64_t> dims) {
  data::IdxArray a;
  a.dims = std::move(dims);
  int64_t n = 1;
  for (int64_t d : a.dims) n *= d;
  for (int64_t i = 0; i < n; ++i) a.data.push_back(static_cast<uint8_t>(i * 7 + 3));
  return a;
}

std::string error_of(const std::string& path) {
  try {
    data::read_idx(path);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "no error";
}

// read_idx's error for `path`, read in a child process whose address space
// is capped at what the test uses now plus 512 MiB: a reader that allocates
// what a header claims before finding the data missing fails there with
// std::bad_alloc ("bad_alloc: ..."), not with its message.
std::string error_with_memory_cap(const std::string& path, int64_t max_rows = -1) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::ifstream statm("/proc/self/statm");
    uint64_t pages = 0;
    statm >> pages;
    const rlim_t cap = pages * uint64_t(::sysconf(_SC_PAGESIZE)) + (uint64_t{512} << 20);
    const rlimit lim{cap, cap};
    std::string what = "no error";
    if (::setrlimit(RLIMIT_AS, &lim) != 0)
      what = "setrlimit failed";
    else
      try {
        data::read_idx(path, max_rows);
      } catch (const std::bad_alloc& e) {
        what = std::string("bad_alloc: ") + e.what();
      } catch (const std::exception& e) {
        what = e.what();
      }
    [[maybe_unused]] const ssize_t w = ::write(fds[1], what.data(), what.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string what;
  char buf[512];
  for (ssize_t k; (k = ::read(fds[0], buf, sizeof buf)) > 0;) what.append(buf, std::size_t(k));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return what;
}

}  // namespace

TEST_CASE("read_idx checks the file's size against its header before allocating") {
  ScratchDir dir("idx_claims");
  // 16 bytes: a header claiming 2,000,000 images of 28 x 28 (1.5 GiB), no data.
  write_bytes(dir.file("claims.idx"),
              {0, 0, 8, 3, 0x00, 0x1e, 0x84, 0x80, 0, 0, 0, 28, 0, 0, 0, 28});
  const std::string plain = error_with_memory_cap(dir.file("claims.idx"));
  CAPTURE(plain);
  CHECK(contains(plain,
                 "claims.idx: truncated: the IDX header declares 1568000000 bytes of "
                 "data, the file holds 0 after the header"));
  // Gzipped, a header claiming 2^34 bytes (16 GiB), no data: more than the
  // few bytes of the file can inflate to.
  write_gz(dir.file("claims.gz"), {0, 0, 8, 3, 0, 0, 0x40, 0, 0, 0, 4, 0, 0, 0, 4, 0});
  const std::string gz = error_with_memory_cap(dir.file("claims.gz"));
  CAPTURE(gz);
  CHECK(contains(gz,
                 "claims.gz: truncated: the IDX header declares 17179869184 bytes of data, "
                 "more than a gzip file of"));
  // Within what the compressed size allows, but still short: the reader
  // fails at the end of the data it has, naming the file.
  std::vector<uint8_t> noise = {0, 0, 8, 1, 0, 0x20, 0, 0};  // 2 MiB declared
  for (uint32_t i = 0; i < (1u << 20); ++i)                  // 1 MiB present, incompressible
    noise.push_back(static_cast<uint8_t>((i * 2654435761u) >> 24));
  write_gz(dir.file("short.gz"), noise);
  const std::string part = error_with_memory_cap(dir.file("short.gz"));
  CAPTURE(part);
  CHECK(contains(part,
                 "short.gz: truncated: the IDX data needs 2097152 bytes, the file "
                 "holds 1048576"));
}

TEST_CASE("read_idx with max_rows inflates only those rows: a large file's head in little memory") {
  ScratchDir dir("idx_rows");
  const data::IdxArray a = make_array({6, 2, 3});
  write_gz(dir.file("a.gz"), data::idx_bytes(a));
  const data::IdxArray head = data::read_idx(dir.file("a.gz"), 2);
  CHECK(head.dims == a.dims);  // the header's
  CHECK(head.data == std::vector<uint8_t>(a.data.begin(), a.data.begin() + 12));
  CHECK(data::read_idx(dir.file("a.gz"), 6).data == a.data);
  CHECK(data::read_idx(dir.file("a.gz"), 100).data == a.data);
  CHECK(data::read_idx(dir.file("a.gz"), 0).data.empty());
  // 800,000 images of 28 x 28 (627 MB inflated, zeros, a small gzip file):
  // more than the child's 512 MiB when read whole, nothing to it for 64.
  {
    gzFile f = gzopen(dir.file("big.gz").c_str(), "wb1");
    REQUIRE(f != nullptr);
    const std::vector<uint8_t> header = {0, 0, 8, 3,  0x00, 0x0c, 0x35, 0x00,
                                         0, 0, 0, 28, 0,    0,    0,    28};
    REQUIRE(gzwrite(f, header.data(), unsigned(header.size())) == int(header.size()));
    const std::vector<uint8_t> zeros(1 << 20, 0);
    for (uint64_t left = uint64_t{800000} * 784; left > 0;) {
      const auto n = static_cast<unsigned>(std::min<uint64_t>(left, zeros.size()));
      REQUIRE(gzwrite(f, zeros.data(), n) == int(n));
      left -= n;
    }
    REQUIRE(gzclose(f) == Z_OK);
  }
  CHECK(error_with_memory_cap(dir.file("big.gz"), 64) == "no error");
  const std::string whole = error_with_memory_cap(dir.file("big.gz"));
  CAPTURE(whole);
  CHECK(whole != "no error");  // the cap holds: a whole read does not fit
}

TEST_CASE("read_idx reads gzipped and plain IDX files") {
  ScratchDir dir("idx");
  const data::IdxArray a = make_array({4, 3, 5});
  write_gz(dir.file("a.gz"), data::idx_bytes(a));
  write_bytes(dir.file("a.idx"), data::idx_bytes(a));
  for (const char* name : {"a.gz", "a.idx"}) {
    const data::IdxArray b = data::read_idx(dir.file(name));
    CHECK(b.dims == a.dims);
    CHECK(b.data == a.data);
  }
  // Big-endian dims: 256 + 2 = 0x00000102.
  const std::vector<uint8_t> bytes = data::idx_bytes(make_array({258}));
  CHECK(bytes[4] == 0);
  CHECK(bytes[6] == 1);
  CHECK(bytes[7] == 2);
  // A zero-size dimension is a valid empty array.
  write_gz(dir.file("empty.gz"), data::idx_bytes(make_array({0, 28, 28})));
  CHECK(data::read_idx(dir.file("empty.gz")).data.empty());
}

TEST_CASE("read_idx names the file and the problem") {
  ScratchDir dir("idx_bad");
  const std::vector<uint8_t> good = data::idx_bytes(make_array({2, 3, 3}));

  CHECK(contains(error_of(dir.file("missing.gz")), "missing.gz: cannot open: no such file"));
  CHECK(contains(error_of(dir.path().string()), "is a directory"));

  std::vector<uint8_t> magic = good;
  magic[0] = 0x1f;
  write_gz(dir.file("magic.gz"), magic);
  CHECK(contains(error_of(dir.file("magic.gz")), "magic.gz: not an IDX file"));

  std::vector<uint8_t> type = good;
  type[2] = 0x0D;  // float
  write_gz(dir.file("type.gz"), type);
  CHECK(contains(error_of(dir.file("type.gz")), "unsupported IDX element type 0x0d"));

  std::vector<uint8_t> nodims = {0, 0, 8, 0};
  write_gz(dir.file("nodims.gz"), nodims);
  CHECK(contains(error_of(dir.file("nodims.gz")), "0 dimensions"));

  write_gz(dir.file("short.gz"), std::vector<uint8_t>(good.begin(), good.end() - 5));
  CHECK(contains(error_of(dir.file("short.gz")), "short.gz: truncated: the IDX data needs 18"));

  write_gz(dir.file("header.gz"), std::vector<uint8_t>(good.begin(), good.begin() + 6));
  CHECK(contains(error_of(dir.file("header.gz")), "truncated: the IDX dimension sizes"));

  std::vector<uint8_t> extra = good;
  extra.push_back(9);
  write_gz(dir.file("extra.gz"), extra);
  CHECK(contains(error_of(dir.file("extra.gz")), "trailing bytes after the 18 elements"));

  std::vector<uint8_t> huge = {0,    0,    8,    3,    0xff, 0xff, 0xff, 0xff,
                               0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  write_gz(dir.file("huge.gz"), huge);
  CHECK(contains(error_of(dir.file("huge.gz")), "more than 2^34 elements"));
}

TEST_CASE("read_idx rejects cut and damaged gzip streams") {
  ScratchDir dir("idx_gz");
  const data::IdxArray a = make_array({50, 28, 28});
  write_gz(dir.file("full.gz"), data::idx_bytes(a));
  const std::string bytes = quanta::test::slurp(dir.file("full.gz"));
  REQUIRE(bytes.size() > 100);

  // Cut in the middle of the deflate stream.
  write_bytes(dir.file("cut.gz"),
              std::vector<uint8_t>(bytes.begin(), bytes.begin() + bytes.size() / 2));
  const std::string cut = error_of(dir.file("cut.gz"));
  CAPTURE(cut);
  CHECK(contains(cut, "cut.gz: "));
  CHECK((contains(cut, "truncated") || contains(cut, "corrupt gzip")));

  // Damaged CRC in the trailer: the data decompresses, the check fails.
  std::vector<uint8_t> crc(bytes.begin(), bytes.end());
  crc[crc.size() - 6] ^= 0xff;
  write_bytes(dir.file("crc.gz"), crc);
  CHECK(contains(error_of(dir.file("crc.gz")), "corrupt gzip"));

  // Garbage after a gzip header.
  std::vector<uint8_t> junk(bytes.begin(), bytes.begin() + 10);
  for (int i = 0; i < 200; ++i) junk.push_back(static_cast<uint8_t>(i * 37 + 11));
  write_bytes(dir.file("junk.gz"), junk);
  const std::string j = error_of(dir.file("junk.gz"));
  CAPTURE(j);
  CHECK(contains(j, "junk.gz: "));
  CHECK((contains(j, "corrupt gzip") || contains(j, "truncated")));
}

TEST_CASE("load_fashion_mnist reads the four files and checks them") {
  ScratchDir dir("fmnist");
  const data::IdxArray images = make_array({5, 28, 28});
  data::IdxArray labels;
  labels.dims = {5};
  labels.data = {9, 0, 3, 1, 7};
  for (const char* split : {"train", "t10k"}) {
    write_gz(dir.file(std::string(split) + "-images-idx3-ubyte.gz"), data::idx_bytes(images));
    write_gz(dir.file(std::string(split) + "-labels-idx1-ubyte.gz"), data::idx_bytes(labels));
  }
  const data::ImageDataset ds = data::load_fashion_mnist(dir.path().string(), data::Split::train);
  REQUIRE(ds.images.shape() == Shape{5, 1, 28, 28});
  CHECK(ds.labels.to_vector<int64_t>() == std::vector<int64_t>{9, 0, 3, 1, 7});
  const std::vector<float> px = ds.images.to_vector<float>();
  for (size_t i : {size_t{0}, size_t{1}, size_t{784}, size_t{3919}})
    CHECK(px[i] == doctest::Approx(images.data[i] / 255.0));

  const data::ImageDataset few =
      data::load_fashion_mnist(dir.path().string(), data::Split::test, 2);
  CHECK(few.size() == 2);
  CHECK(few.labels.to_vector<int64_t>() == std::vector<int64_t>{9, 0});

  SUBCASE("missing files say how to install them") {
    ScratchDir empty("fmnist_empty");
    try {
      data::load_fashion_mnist(empty.path().string(), data::Split::train);
      FAIL("expected an error");
    } catch (const std::runtime_error& e) {
      CHECK(contains(e.what(), "train-images-idx3-ubyte.gz is missing"));
      CHECK(contains(e.what(), "apt-get install dataset-fashion-mnist"));
      CHECK(contains(e.what(), "--data DIR"));
    }
  }
  SUBCASE("label count must match") {
    data::IdxArray four = labels;
    four.dims = {4};
    four.data.pop_back();
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), data::idx_bytes(four));
    CHECK_THROWS_WITH_AS(data::load_fashion_mnist(dir.path().string(), data::Split::train),
                         doctest::Contains("4 labels for 5 images"), std::runtime_error);
  }
  SUBCASE("a split of 0 images is an error") {
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), data::idx_bytes(make_array({0, 28, 28})));
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), data::idx_bytes(make_array({0})));
    CHECK_THROWS_WITH_AS(data::load_fashion_mnist(dir.path().string(), data::Split::test),
                         doctest::Contains("t10k-images-idx3-ubyte.gz: holds no images"),
                         std::runtime_error);
  }
  SUBCASE("a label outside 0..9 names its file and image") {
    data::IdxArray bad = labels;
    bad.data[3] = 255;
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), data::idx_bytes(bad));
    CHECK_THROWS_WITH_AS(
        data::load_fashion_mnist(dir.path().string(), data::Split::train),
        doctest::Contains("train-labels-idx1-ubyte.gz: label 255 of image 3 is not a class 0..9"),
        std::runtime_error);
    // Outside the images a limit reads, it is not read, so not checked.
    CHECK(data::load_fashion_mnist(dir.path().string(), data::Split::train, 3).size() == 3);
  }
  SUBCASE("images must be 28 x 28") {
    write_gz(dir.file("train-images-idx3-ubyte.gz"), data::idx_bytes(make_array({5, 27, 28})));
    CHECK_THROWS_WITH_AS(data::load_fashion_mnist(dir.path().string(), data::Split::train),
                         doctest::Contains("expected images of shape [N, 28, 28]"),
                         std::runtime_error);
  }
}
