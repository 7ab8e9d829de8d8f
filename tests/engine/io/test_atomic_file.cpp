// Atomic outputs: a file written whole or not at all, and a folder swapped
// for another in one step (its files belong together).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/io/atomic_file.h"
#include "support/temp_dir.h"

using namespace quanta;
namespace fs = std::filesystem;
using testing::TempDir;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A folder `dir` holding one file per (name, text).
void make_folder(const std::string& dir,
                 const std::vector<std::pair<std::string, std::string>>& files) {
  fs::create_directories(dir);
  for (const auto& [name, text] : files) io::write_text_atomic(dir + "/" + name, text, "test");
}

}  // namespace

TEST_CASE("write_text_atomic replaces a file and leaves no temporary file") {
  TempDir t("atomic_file");
  io::write_text_atomic(t.file("a.json"), "old", "test");
  io::write_text_atomic(t.file("a.json"), "new", "test");
  CHECK(read_text(t.file("a.json")) == "new");
  CHECK(std::distance(fs::directory_iterator(t.path()), fs::directory_iterator()) == 1);
  CHECK_THROWS_WITH_AS(io::write_text_atomic(t.file("no/such/folder/x"), "x", "op"),
                       doctest::Contains("[op] cannot create"), std::runtime_error);
}

TEST_CASE("AtomicFileWriter puts its file in place at commit, and nothing when dropped") {
  TempDir t("atomic_writer");
  const std::string path = t.file("big.bin");
  io::write_text_atomic(path, "old", "test");
  {
    io::AtomicFileWriter file(path, "test");
    file.write({"ab", 2});
    file.write({"cd", 2});
    CHECK(read_text(path) == "old");  // nothing shows before commit
  }                                   // dropped uncommitted: an error while making the next piece
  CHECK(read_text(path) == "old");
  CHECK(std::distance(fs::directory_iterator(t.path()), fs::directory_iterator()) == 1);
  io::AtomicFileWriter file(path, "test");
  file.write({"ab", 2});
  file.write({"", 0});
  file.write({"cd", 2});
  file.commit();
  CHECK(read_text(path) == "abcd");
  CHECK(std::distance(fs::directory_iterator(t.path()), fs::directory_iterator()) == 1);
  CHECK_THROWS_WITH_AS(file.write({"e", 1}), doctest::Contains("is committed"), std::logic_error);
}

TEST_CASE("a killed writer's temporary file is removed by the next writer, a live one's kept") {
  TempDir t("atomic_stale");
  const std::string path = t.file("ckpt.bin");
  const auto put = [](const std::string& p, const char* text) { std::ofstream(p) << text; };
  // What writers killed mid-file left: their temporary files, unlocked.
  put(path + ".tmp.999999999", "torn");
  put(path + ".tmp.12", "torn");
  // A writer still at work (here this process, through its own descriptor)
  // holds the lock on its file.
  put(path + ".tmp.34", "busy");
  const int live = ::open((path + ".tmp.34").c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(live >= 0);
  REQUIRE(::flock(live, LOCK_EX | LOCK_NB) == 0);
  // Names that are not this file's temporaries.
  put(t.file("other.bin.tmp.5"), "x");
  put(path + ".tmp.5x", "x");
  put(path + ".tmp.", "x");
  put(t.file("ckpt.tmp.7"), "x");

  io::write_text_atomic(path, "whole", "test");
  CHECK(read_text(path) == "whole");
  CHECK_FALSE(fs::exists(path + ".tmp.999999999"));
  CHECK_FALSE(fs::exists(path + ".tmp.12"));
  CHECK(read_text(path + ".tmp.34") == "busy");
  CHECK(fs::exists(t.file("other.bin.tmp.5")));
  CHECK(fs::exists(path + ".tmp.5x"));
  CHECK(fs::exists(path + ".tmp."));
  CHECK(fs::exists(t.file("ckpt.tmp.7")));
  ::close(live);  // the writer is gone: the next write takes its file too
  io::write_text_atomic(path, "again", "test");
  CHECK_FALSE(fs::exists(path + ".tmp.34"));
  CHECK(read_text(path) == "again");
  // other.bin's own writer removes its stale one (the folder listed once).
  io::write_text_atomic(t.file("other.bin"), "y", "test");
  CHECK_FALSE(fs::exists(t.file("other.bin.tmp.5")));
}

TEST_CASE("AtomicFileWriter keeps its own temporary file locked while it writes") {
  TempDir t("atomic_locked");
  const std::string path = t.file("w.bin");
  io::AtomicFileWriter file(path, "test");
  file.write({"ab", 2});
  const std::string own = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(own.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  CHECK(::flock(fd, LOCK_EX | LOCK_NB) != 0);  // a sweep by another writer would leave it
  ::close(fd);
  io::write_text_atomic(t.file("w.bin.tmp.1"), "stale", "test");
  {
    io::AtomicFileWriter other(t.file("x.bin"), "test");  // another file's writer: not its to sweep
  }
  CHECK(fs::exists(t.file("w.bin.tmp.1")));
  file.commit();
  CHECK(read_text(path) == "ab");
}

TEST_CASE("replace_folder moves a staged folder in, or swaps it for the old one whole") {
  TempDir t("atomic_folder");
  const std::string dir = t.file("adapters"), staged = t.file("adapters.staged");
  make_folder(staged, {{"config.json", "c1"}, {"weights", "w1"}});
  io::replace_folder(staged, dir, "test");
  CHECK_FALSE(fs::exists(staged));
  CHECK(read_text(dir + "/config.json") == "c1");
  CHECK(read_text(dir + "/weights") == "w1");

  // An existing folder is replaced whole: a file the new one lacks is gone
  // with the old folder, and the trailing slash of the target is ignored.
  fs::remove_all(staged);
  make_folder(dir, {{"config.json", "c1"}, {"weights", "w1"}, {"old_only", "x"}});
  make_folder(staged, {{"config.json", "c2"}, {"weights", "w2"}});
  io::replace_folder(staged, dir + "/", "test");
  CHECK_FALSE(fs::exists(staged));
  CHECK(read_text(dir + "/config.json") == "c2");
  CHECK(read_text(dir + "/weights") == "w2");
  CHECK_FALSE(fs::exists(dir + "/old_only"));

  CHECK_THROWS_WITH_AS(io::replace_folder(t.file("missing"), t.file("elsewhere"), "op"),
                       doctest::Contains("[op] cannot rename"), std::runtime_error);
}
