// Token data: llm.c token files and JSONL examples, read back exactly, and
// every malformed file refused with one error naming the file and the place
// (a bounded, deterministic fuzz of both formats included).
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "engine/factory.h"
#include "llm/data/lm_examples.h"
#include "llm/data/token_file.h"
#include "llm/data/token_jsonl.h"

using namespace quanta::llm;
namespace fs = std::filesystem;

namespace {

struct Scratch {
  fs::path dir;
  Scratch() {
    dir = fs::temp_directory_path() / ("quanta_tokens_" + std::to_string(::getpid()));
    fs::create_directories(dir);
  }
  ~Scratch() { fs::remove_all(dir); }
  std::string file(const std::string& name) const { return (dir / name).string(); }
};

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}
// The error `f` throws (std::exception), or "no error".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}
bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("token files: both of llm.c's layouts round-trip, in windows") {
  Scratch s;
  const std::vector<int64_t> small = {0, 1, 50256, 65535, 7, 7};
  write_token_file(s.file("gpt2.bin"), small, TokenWidth::u16);
  const TokenFile a(s.file("gpt2.bin"));
  CHECK(a.size() == 6);
  CHECK(a.width() == TokenWidth::u16);
  CHECK(a.read(0, 6) == small);
  CHECK(a.read(2, 3) == std::vector<int64_t>{50256, 65535, 7});
  CHECK(a.read(6, 0).empty());
  CHECK(fs::file_size(s.file("gpt2.bin")) == 1024 + 12);

  const std::vector<int64_t> wide = {128000, 4294967295LL, 0, 128255};
  write_token_file(s.file("llama3.bin"), wide, TokenWidth::u32);
  const TokenFile b(s.file("llama3.bin"));
  CHECK(b.width() == TokenWidth::u32);
  CHECK(b.read(0, 4) == wide);
  // The header is llm.c's: magic, version, count, then zeros.
  const std::string raw = bytes_of(s.file("llama3.bin"));
  CHECK(raw.substr(0, 4) == std::string("\xa1\xd9\x34\x01", 4));  // 20240801
  CHECK(raw[4] == 7);
  CHECK(raw[8] == 4);
  CHECK(raw.substr(12, 1012) == std::string(1012, '\0'));

  // Ids checked against a vocabulary name the position.
  CHECK(has(error_of([&] { (void)a.read(0, 6, 50257); }),
            "gpt2.bin: token 3 is id 65535, outside the model's vocabulary of 50257"));
  CHECK_THROWS_AS((void)a.read(4, 3), std::out_of_range);
  CHECK_THROWS_AS((void)a.read(-1, 1), std::out_of_range);
  CHECK_THROWS_AS(write_token_file(s.file("x.bin"), {70000}, TokenWidth::u16),
                  std::invalid_argument);
  CHECK_FALSE(fs::exists(s.file("x.bin")));
}

TEST_CASE("token files: a bad header, size or file is one error naming the file") {
  Scratch s;
  write_token_file(s.file("ok.bin"), {1, 2, 3}, TokenWidth::u16);
  const std::string ok = bytes_of(s.file("ok.bin"));
  auto with_word = [&](int i, int32_t v) {
    std::string b = ok;
    for (int k = 0; k < 4; ++k) b[std::size_t(4 * i + k)] = char((uint32_t(v) >> (8 * k)) & 0xFF);
    return b;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {with_word(0, 12345), "not an llm.c token file: magic 12345"},
      {with_word(1, 7), "magic 20240520 (uint16 ids) needs version 1, the header says 7"},
      {with_word(2, 4), "truncated: the header says 4 tokens (8 bytes), the file holds 6 bytes"},
      {with_word(2, 2), "2 bytes after the 2 tokens the header declares"},
      {with_word(2, -5), "the header's token count is negative (-5)"},
      {ok.substr(0, 100), "is 100 bytes, shorter than a token file's 1024-byte header"},
      {ok.substr(0, ok.size() - 1), "truncated"},
  };
  for (const auto& [bytes, want] : cases) {
    CAPTURE(want);
    write_bytes(s.file("bad.bin"), bytes);
    const std::string e = error_of([&] { TokenFile f(s.file("bad.bin")); });
    CHECK(e.rfind(s.file("bad.bin") + ": ", 0) == 0);
    CHECK(has(e, want));
  }
  CHECK(has(error_of([&] { TokenFile f(s.file("absent.bin")); }), "absent.bin: cannot open"));
  CHECK(has(error_of([&] { TokenFile f(s.dir.string()); }), "is not a regular file"));
  REQUIRE(::mkfifo(s.file("fifo").c_str(), 0600) == 0);
  CHECK(has(error_of([&] { TokenFile f(s.file("fifo")); }), "is not a regular file"));

  // Cut while open: a read error naming the file, not a crash.
  write_token_file(s.file("cut.bin"), std::vector<int64_t>(1000, 5), TokenWidth::u16);
  const TokenFile cut(s.file("cut.bin"));
  fs::resize_file(s.file("cut.bin"), 1024 + 100);
  CHECK(has(error_of([&] { (void)cut.read(0, 1000); }), "cut.bin: ends inside the token ids"));
}

TEST_CASE("token JSONL: input_ids and labels, -100 ignored, errors name file, line and field") {
  Scratch s;
  const std::string path = s.file("data.jsonl");
  std::ofstream(path) << R"({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})"
                      << "\n\n"
                      << R"({"input_ids": [4, 5], "text": "kept aside"})"
                      << "\n";
  const std::vector<TokenExample> ex = read_token_jsonl(path, {.vocab_size = 10});
  REQUIRE(ex.size() == 2);
  CHECK(ex[0].input_ids == std::vector<int64_t>{1, 2, 3});
  CHECK(ex[0].labels == std::vector<int64_t>{-100, 2, 3});
  CHECK(ex[1].labels == ex[1].input_ids);  // no labels: every position scored

  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"input_ids": [1, 2)", "line 1: not valid JSON"},
      {R"([1, 2, 3])", "line 1: not a JSON object"},
      {R"({"labels": [1]})", "line 1: no input_ids"},
      {R"({"input_ids": []})", "line 1: input_ids is empty"},
      {R"({"input_ids": "1 2"})", "line 1: input_ids is not an array"},
      {R"({"input_ids": [1, 2.5]})", "line 1: input_ids[1] is 2.5, not a whole number"},
      {R"({"input_ids": [1, 10]})",
       "line 1: input_ids[1] is 10: outside the model's vocabulary of 10"},
      {R"({"input_ids": [-100, 1]})", "line 1: input_ids[0] is -100: ids are >= 0"},
      {R"({"input_ids": [1, 2], "labels": [1]})", "line 1: labels has 1 entries, input_ids 2"},
      {R"({"input_ids": [1, 2], "labels": [1, -7]})", "line 1: labels[1] is -7: ids are >= 0"},
      {R"({"input_ids": [1, 2, 3, 4, 5]})",
       "line 1: 5 tokens, longer than the model's 4 positions"},
      {"\n  \n", "holds no example"},
  };
  for (const auto& [text, want] : cases) {
    CAPTURE(text);
    std::ofstream(path, std::ios::trunc) << text << "\n";
    const std::string e =
        error_of([&] { (void)read_token_jsonl(path, {.vocab_size = 10, .max_length = 4}); });
    CHECK(e.rfind(path + ": ", 0) == 0);
    CHECK(has(e, want));
  }
  CHECK(has(error_of([&] { (void)read_token_jsonl(s.file("absent.jsonl")); }), "cannot open"));
}

TEST_CASE("token JSONL: prompt and completion, as text or ids; completions only; refusals") {
  Scratch s;
  const std::string path = s.file("pairs.jsonl");
  std::ofstream(path) << R"({"prompt": "ab", "completion": "cde"})"
                      << "\n"
                      << R"({"prompt": [7, 8], "completion": [9]})"
                      << "\n";
  // A stand-in tokenizer: one id per letter, BOS 1 when asked.
  PromptCompletion p;
  p.encode = [](const std::string& text, bool bos) {
    std::vector<int64_t> ids;
    if (bos) ids.push_back(1);
    for (char c : text) ids.push_back(10 + (c - 'a'));
    return ids;
  };
  p.eos_id = 2;
  std::vector<TokenExample> ex = read_token_jsonl(path, {.vocab_size = 20}, p);
  REQUIRE(ex.size() == 2);
  CHECK(ex[0].input_ids == std::vector<int64_t>{1, 10, 11, 12, 13, 14, 2});
  CHECK(ex[0].labels == ex[0].input_ids);  // the prompt is trained on too by default
  CHECK(ex[1].input_ids == std::vector<int64_t>{7, 8, 9});  // ids as given, no EOS added
  p.completions_only = true;
  ex = read_token_jsonl(path, {.vocab_size = 20}, p);
  CHECK(ex[0].labels == std::vector<int64_t>{-100, -100, -100, 12, 13, 14, 2});
  CHECK(ex[1].labels == std::vector<int64_t>{-100, -100, 9});

  const std::vector<std::tuple<std::string, std::string, bool>> cases = {
      {R"({"input_ids": [1, 2]})", "line 1: no prompt and completion", true},
      {R"({"prompt": [1]})", "line 1: no completion", false},
      {R"({"prompt": [1], "completion": [2], "input_ids": [1, 2]})",
       "line 1: has both input_ids and a prompt", false},
      {R"({"prompt": [1], "completion": [2], "labels": [1, 2]})", "line 1: has labels beside",
       false},
      {R"({"prompt": [1], "completion": []})", "line 1: completion is empty", false},
      {R"({"prompt": "zz", "completion": [2]})",
       "line 1: prompt encodes to id 35: outside the model's vocabulary of 20", false},
      {R"({"prompt": [1], "completion": 3})", "line 1: completion is not an array", false},
  };
  for (const auto& [text, want, only] : cases) {
    CAPTURE(text);
    std::ofstream(path, std::ios::trunc) << text << "\n";
    PromptCompletion q = p;
    q.completions_only = only;
    const std::string e = error_of([&] { (void)read_token_jsonl(path, {.vocab_size = 20}, q); });
    CHECK(e.rfind(path + ": ", 0) == 0);
    CHECK(has(e, want));
  }
  std::ofstream(path, std::ios::trunc) << R"({"prompt": "a", "completion": "b"})"
                                       << "\n";
  CHECK(has(error_of([&] { (void)read_token_jsonl(path, {.vocab_size = 20}); }),
            "line 1: prompt is text, and there is no tokenizer"));
}

TEST_CASE("token JSONL: TRL's text lines, a BOS before and the EOS after, every token scored") {
  Scratch s;
  const std::string path = s.file("text.jsonl");
  std::ofstream(path) << R"({"text": "abc"})"
                      << "\n"
                      << R"({"input_ids": [5, 6]})"
                      << "\n";
  PromptCompletion p;
  p.encode = [](const std::string& text, bool bos) {
    std::vector<int64_t> ids;
    if (bos) ids.push_back(1);
    for (char c : text) ids.push_back(10 + (c - 'a'));
    return ids;
  };
  p.eos_id = 2;
  const std::vector<TokenExample> ex = read_token_jsonl(path, {.vocab_size = 20}, p);
  REQUIRE(ex.size() == 2);
  CHECK(ex[0].input_ids == std::vector<int64_t>{1, 10, 11, 12, 2});
  CHECK(ex[0].labels == ex[0].input_ids);
  CHECK(ex[1].input_ids == std::vector<int64_t>{5, 6});
  // Beside ids or a prompt and completion, a text is left aside.
  std::ofstream(s.file("both.jsonl")) << R"({"text": "abc", "input_ids": [7]})"
                                      << "\n"
                                      << R"({"text": "abc", "prompt": [3], "completion": [4]})"
                                      << "\n";
  const std::vector<TokenExample> both =
      read_token_jsonl(s.file("both.jsonl"), {.vocab_size = 20}, p);
  CHECK(both[0].input_ids == std::vector<int64_t>{7});
  CHECK(both[1].input_ids == std::vector<int64_t>{3, 4});
  const std::vector<std::tuple<std::string, std::string, bool>> cases = {
      {R"({"text": 3})", "line 1: text is not a string", false},
      {R"({"text": "a", "labels": [1, 2, 3]})", "line 1: has labels beside a text", false},
      {R"({"text": "zz"})", "line 1: text encodes to id 35: outside", false},
      {R"({"text": "a"})", "line 1: no prompt and completion", true},
      {R"({"other": "a"})", "line 1: no input_ids (nor a text, messages, or a prompt", false},
      {R"({"messages": [{"role": "user", "content": "a"}]})",
       "line 1: a conversation needs the model folder's chat template", false},
      {R"({"messages": [], "tools": 1})", "line 1: a conversation needs", false},
  };
  for (const auto& [text, want, only] : cases) {
    CAPTURE(text);
    std::ofstream(path, std::ios::trunc) << text << "\n";
    PromptCompletion q = p;
    q.completions_only = only;
    const std::string e = error_of([&] { (void)read_token_jsonl(path, {.vocab_size = 20}, q); });
    CHECK(has(e, want));
  }
  std::ofstream(path, std::ios::trunc) << R"({"text": "a"})"
                                       << "\n";
  CHECK(has(error_of([&] { (void)read_token_jsonl(path, {.vocab_size = 20}); }),
            "line 1: text is text, and there is no tokenizer"));
}

TEST_CASE("LmExamples: packed rows keep each example's positions and scored tokens") {
  Scratch s;
  const std::string path = s.file("docs.jsonl");
  std::ofstream(path) << R"({"input_ids": [1, 2, 3]})"
                      << "\n"
                      << R"({"input_ids": [4, 5], "labels": [-100, 5]})"
                      << "\n"
                      << R"({"input_ids": [6, 7, 8, 9]})"
                      << "\n"
                      << R"({"input_ids": [3]})"
                      << "\n"
                      << R"({"input_ids": [5, 5, 5]})"
                      << "\n";
  const LmExamples plain = LmExamples::from_jsonl(path, 6, 10);
  const LmExamples packed = LmExamples::from_jsonl(path, 6, 10, {.pack = true});
  CHECK_FALSE(plain.packed());
  CHECK(packed.packed());
  CHECK(packed.documents() == 5);
  REQUIRE(packed.size() == 3);  // [3 + 2], [4 + 1], [3]
  CHECK(packed.total_scored_tokens() == plain.total_scored_tokens());
  const LmBatch b = packed.batch(quanta::from_vector<int64_t>({1, 2}, {2}));
  CHECK(b.ids.to_vector<int64_t>() == std::vector<int64_t>{6, 7, 8, 9, 3, 5, 5, 5, 0, 0});
  CHECK(b.labels.to_vector<int64_t>() ==
        std::vector<int64_t>{-100, 7, 8, 9, -100, -100, 5, 5, -100, -100});
  // Padding is a run of positions of its own, so no real token sees it.
  CHECK(b.position_ids.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 0, 0, 1, 2, 0, 1});
  CHECK(b.scored_tokens == 5);
  // Each row's tokens before its padding.
  CHECK(b.lengths == std::vector<int64_t>{5, 3});
  CHECK(plain.batch(quanta::from_vector<int64_t>({0, 2}, {2})).lengths ==
        std::vector<int64_t>{3, 4});
  CHECK(packed.batch(quanta::from_vector<int64_t>({0}, {1})).labels.to_vector<int64_t>() ==
        std::vector<int64_t>{-100, 2, 3, -100, 5});
  CHECK_FALSE(plain.batch(quanta::from_vector<int64_t>({0}, {1})).position_ids.defined());

  const std::string tokens = s.file("stream.bin");
  CHECK(has(error_of([&] { (void)LmExamples::from_file(tokens, 4, 10, {.pack = true}); }),
            "packing is for JSONL examples"));
}

TEST_CASE("LmExamples: windows split into the documents their BOS and EOS ids mark") {
  Scratch s;
  // Four documents, each a BOS (1) first and an EOS (2) last, cut into two
  // windows of 8: the second document runs from the first window's
  // fifth token to the second window's first.
  const std::vector<int64_t> stream = {1, 5, 6, 2, 1, 7, 8, 9, 2, 1, 4, 4, 2, 1, 5, 5};
  write_token_file(s.file("docs.bin"), stream, TokenWidth::u16);
  const auto rows = [](std::vector<int64_t> r) {
    const int64_t n = static_cast<int64_t>(r.size());
    return quanta::from_vector<int64_t>(r, {n});
  };
  const DocumentBoundaries both{.start_ids = {1}, .end_ids = {2}};
  for (const bool from_file : {true, false}) {
    CAPTURE(from_file);
    const LmExamples e = from_file ? LmExamples::from_token_file(s.file("docs.bin"), 8, 10, both)
                                   : LmExamples::from_ids(stream, "ids", 8, 10, both);
    CHECK(e.has_position_ids());
    CHECK_FALSE(e.packed());
    CHECK(e.size() == 2);
    CHECK(e.documents() == 4);
    const LmBatch b = e.batch(rows({0, 1}));
    CHECK(b.ids.to_vector<int64_t>() == stream);
    // Positions restart where a document starts (and at a window's first
    // token); a document's first token is not predicted from the one before.
    CHECK(b.position_ids.to_vector<int64_t>() ==
          std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2});
    CHECK(b.labels.to_vector<int64_t>() ==
          std::vector<int64_t>{1, 5, 6, 2, -100, 7, 8, 9, 2, -100, 4, 4, 2, -100, 5, 5});
    CHECK(b.scored_tokens == 6 + 5);
    CHECK(b.lengths == std::vector<int64_t>{8, 8});
    CHECK(e.scored_tokens(rows({1})) == 5);
    CHECK(e.scored_tokens(rows({0, 1, 1})) == 6 + 5 + 5);
    CHECK(e.total_scored_tokens() == 11);
  }
  // The EOS alone marks the same documents here (each BOS follows an EOS);
  // the BOS alone too, but the first window's first token is then marked.
  const LmExamples by_end = LmExamples::from_ids(stream, "ids", 8, 10, {.end_ids = {2}});
  CHECK(by_end.batch(rows({0, 1})).position_ids.to_vector<int64_t>() ==
        std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2});
  CHECK(by_end.documents() == 4);
  // GPT-2's files: one <|endoftext|> (here 9) before each document, so it
  // starts them; a window starting inside a document starts at position 0.
  const std::vector<int64_t> gpt2 = {9, 3, 4, 9, 5, 6, 7, 8, 3};
  const LmExamples eot = LmExamples::from_ids(gpt2, "gpt2", 3, 10, {.start_ids = {9}});
  CHECK(eot.documents() == 2);
  const LmBatch g = eot.batch(rows({0, 1, 2}));
  CHECK(g.position_ids.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2});
  CHECK(g.labels.to_vector<int64_t>() == std::vector<int64_t>{9, 3, 4, 9, 5, 6, 7, 8, 3});
  CHECK(eot.batch(rows({1})).labels.to_vector<int64_t>() == std::vector<int64_t>{9, 5, 6});
  // Unsplit windows: no positions, every prediction scored, as before.
  const LmExamples plain = LmExamples::from_ids(stream, "ids", 8, 10);
  CHECK_FALSE(plain.has_position_ids());
  CHECK_FALSE(plain.batch(rows({0})).position_ids.defined());
  CHECK(plain.total_scored_tokens() == 14);

  // Refusals: a boundary id outside the vocabulary, a stream none of whose
  // tokens is a boundary (the wrong id), JSONL (its lines are examples).
  CHECK(has(error_of([&] {
              (void)LmExamples::from_token_file(s.file("docs.bin"), 8, 10, {.end_ids = {10}});
            }),
            "document end id 10 is outside the vocabulary of 10"));
  const std::string none = error_of(
      [&] { (void)LmExamples::from_token_file(s.file("docs.bin"), 8, 10, {.start_ids = {3}}); });
  CHECK(has(none, "docs.bin: no token in its 16 windowed tokens marks a document boundary"));
  CHECK(has(none, "start ids {3}, end ids {}"));
  std::ofstream(s.file("a.jsonl")) << R"({"input_ids": [1, 2, 3]})"
                                   << "\n";
  CHECK(has(
      error_of([&] { (void)LmExamples::from_file(s.file("a.jsonl"), 8, 10, {.documents = both}); }),
      "a.jsonl is JSONL, one example a line: document boundaries are for token streams"));
}

TEST_CASE("token data fuzz: mutated files load or fail cleanly, never crash or accept garbage") {
  Scratch s;
  std::mt19937 rng(20261128);  // deterministic
  std::vector<int64_t> ids(300);
  for (auto& v : ids) v = int64_t(rng() % 1000);
  write_token_file(s.file("seed.bin"), ids, TokenWidth::u16);
  const std::string seed = bytes_of(s.file("seed.bin"));
  std::ofstream(s.file("seed.jsonl")) << R"({"input_ids": [5, 6, 7], "labels": [-100, 6, 7]})"
                                      << "\n"
                                      << R"({"input_ids": [1]})"
                                      << "\n";
  const std::string seed_jsonl = bytes_of(s.file("seed.jsonl"));
  int loaded = 0, refused = 0;
  for (int it = 0; it < 1500; ++it) {
    const bool jsonl = it % 3 == 2;
    std::string b = jsonl ? seed_jsonl : seed;
    switch (rng() % 3) {
      case 0:  // flip a few bytes (mostly in the header for token files)
        for (int k = 0; k < 1 + int(rng() % 4); ++k) {
          const std::size_t at =
              jsonl ? rng() % b.size() : rng() % std::min<std::size_t>(b.size(), 16);
          b[at] = char(rng() & 0xFF);
        }
        break;
      case 1:  // cut
        b.resize(rng() % (b.size() + 1));
        break;
      default:  // append
        b += std::string(1 + rng() % 9, char(rng() & 0xFF));
    }
    const std::string path = s.file(jsonl ? "m.jsonl" : "m.bin");
    write_bytes(path, b);
    try {
      if (jsonl) {
        for (const TokenExample& e : read_token_jsonl(path, {.vocab_size = 1000}))
          REQUIRE(e.labels.size() == e.input_ids.size());
      } else {
        const TokenFile f(path);
        // Accepted only when the size is exactly what the header says.
        const int64_t w = f.width() == TokenWidth::u16 ? 2 : 4;
        REQUIRE(int64_t(b.size()) == 1024 + f.size() * w);
        (void)f.read(0, f.size());
      }
      ++loaded;
    } catch (const std::runtime_error& e) {
      REQUIRE(std::string(e.what()).rfind(path + ": ", 0) == 0);  // names the file
      ++refused;
    }
  }
  MESSAGE(loaded << " mutated files loaded, " << refused << " refused");
  CHECK(loaded + refused == 1500);
  CHECK(refused > 500);
}
