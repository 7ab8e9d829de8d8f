#pragma once
// Python's character classes and case mappings for the scripts chat
// templates meet (ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic): other
// code points have no case here.
#include <string>

namespace quanta::llm::jinja {

char32_t to_upper(char32_t c);
char32_t to_lower(char32_t c);
/** A letter with case (upper or lower differs from it). */
inline bool cased(char32_t c) { return to_upper(c) != c || to_lower(c) != c; }
/** Python's str.isspace of one character. */
bool is_space(char32_t c);

std::string upper(const std::string& s);
std::string lower(const std::string& s);
/** Python's str.capitalize: the first character upper, the rest lower. */
std::string capitalize(const std::string& s);
/** Python's str.title: upper after a character without case, else lower. */
std::string python_title(const std::string& s);

}  // namespace quanta::llm::jinja
