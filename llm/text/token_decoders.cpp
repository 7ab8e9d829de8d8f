// tokenizers' decoders: ByteLevel, Replace, ByteFallback, Fuse, Strip,
// Metaspace.
#include "llm/text/token_decoders.h"

#include <unicode/unistr.h>

#include <cstdlib>

#include "llm/text/bpe_model.h"

namespace quanta::llm {
namespace {

// Ill-formed UTF-8 as U+FFFD, as Rust's from_utf8_lossy leaves it.
std::string lossy_utf8(const std::string& bytes) {
  std::string out;
  icu::UnicodeString::fromUTF8(bytes).toUTF8String(out);
  return out;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

// The byte of a "<0xXX>" token, or -1.
int byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  char* end = nullptr;
  const std::string hex = t.substr(3, 2);
  const long v = std::strtol(hex.c_str(), &end, 16);
  return end == hex.c_str() + 2 ? static_cast<int>(v) : -1;
}

}  // namespace

std::string decode_tokens(std::vector<std::string> tokens, const std::vector<TokenDecoder>& steps) {
  for (const TokenDecoder& d : steps) {
    switch (d.kind) {
      case TokenDecoder::Kind::byte_level: {
        std::string bytes;
        for (const std::string& t : tokens) bytes += bytes_of_byte_level(t);
        tokens = {lossy_utf8(bytes)};
        break;
      }
      case TokenDecoder::Kind::replace:
        for (std::string& t : tokens) t = replace_all(t, d.pattern, d.content);
        break;
      case TokenDecoder::Kind::byte_fallback: {
        std::vector<std::string> out;
        std::string run;
        const auto flush = [&] {
          if (run.empty()) return;
          // Not UTF-8: one U+FFFD per byte, as tokenizers gives.
          const std::string text = lossy_utf8(run);
          if (text == run) {
            out.push_back(run);
          } else {
            for (size_t i = 0; i < run.size(); ++i) out.push_back("\xEF\xBF\xBD");
          }
          run.clear();
        };
        for (const std::string& t : tokens) {
          const int b = byte_token(t);
          if (b >= 0) {
            run += static_cast<char>(b);
            continue;
          }
          flush();
          out.push_back(t);
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case TokenDecoder::Kind::fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens = {all};
        break;
      }
      case TokenDecoder::Kind::strip:
        for (std::string& t : tokens) {
          const std::string& c = d.content;
          for (int64_t n = 0; n < d.start && !c.empty() && t.compare(0, c.size(), c) == 0; ++n)
            t.erase(0, c.size());
          for (int64_t n = 0; n < d.stop && !c.empty() && t.size() >= c.size() &&
                              t.compare(t.size() - c.size(), c.size(), c) == 0;
               ++n)
            t.erase(t.size() - c.size());
        }
        break;
      case TokenDecoder::Kind::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = replace_all(tokens[i], d.pattern, i == 0 && d.prepend ? "" : " ");
        break;
    }
  }
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

}  // namespace quanta::llm
