#include "llm/qlora/lora_targets.h"

#include <algorithm>
#include <set>
#include <stdexcept>

namespace quanta::llm {

bool ends_with_part(const std::string& name, const std::string& entry) {
  if (name == entry) return true;
  return name.size() > entry.size() &&
         name.compare(name.size() - entry.size(), entry.size(), entry) == 0 &&
         name[name.size() - entry.size() - 1] == '.';
}

namespace {

// std::regex's matching may give up (too complex, too deep): named, as a
// pattern that does not compile is.
[[noreturn]] void matching_failed(const std::string& pattern, const std::string& field,
                                  const std::string& name, const std::regex_error& e) {
  throw std::invalid_argument(field + ": \"" + pattern + "\" could not be matched against " + name +
                              " (" + e.what() + ")");
}

// Python's re.fullmatch.
bool full_match(const std::string& pattern, const std::string& field, const std::string& name) {
  try {
    return std::regex_match(name, lora_regex(pattern, field));
  } catch (const std::regex_error& e) {
    matching_failed(pattern, field, name, e);
  }
}

// Python's re.match (anchored at the start, not at the end), with the
// first group's text in `group` when it matches.
bool match_at_start(const std::string& pattern, const std::string& field, const std::string& name,
                    std::string* group = nullptr) {
  std::smatch m;
  try {
    if (!std::regex_search(name, m, lora_regex(pattern, field),
                           std::regex_constants::match_continuous))
      return false;
  } catch (const std::regex_error& e) {
    matching_failed(pattern, field, name, e);
  }
  if (group) *group = m[1].str();
  return true;
}

bool excluded(const LoraSettings& l, const std::string& name) {
  if (!l.exclude_modules_regex.empty())
    return full_match(l.exclude_modules_regex, "exclude_modules", name);
  for (const std::string& e : l.exclude_modules)
    if (ends_with_part(name, e)) return true;
  return false;
}

// A target_modules entry (or the regex) names the layer, before exclusion
// and layers_to_transform.
bool named_by(const LoraSettings& l, const std::string& entry, const std::string& name) {
  if (!l.target_modules_regex.empty())
    return full_match(l.target_modules_regex, "target_modules", name);
  // all-linear: every linear layer but the output one, which is never asked.
  return entry == kAllLinear || ends_with_part(name, entry);
}

bool named(const LoraSettings& l, const std::string& name) {
  if (!l.target_modules_regex.empty()) return named_by(l, "", name);
  for (const std::string& t : l.target_modules)
    if (named_by(l, t, name)) return true;
  return false;
}

// PEFT's layer index of `name`: the number after the first layers_pattern
// (inserted into the expression as PEFT inserts it), else after the first
// dotted component that follows another.
std::optional<int64_t> layer_index(const LoraSettings& l, const std::string& name) {
  std::string index;
  if (l.layers_pattern.empty()) {
    if (!match_at_start(R"(.*?\.[^.]*\.(\d+)\.)", "layers_to_transform", name, &index))
      return std::nullopt;
  } else {
    bool found = false;
    for (const std::string& p : l.layers_pattern)
      if (match_at_start(R"(^(?:|.*?\.))" + p + R"(\.(\d+)\.)", "layers_pattern", name, &index)) {
        found = true;
        break;
      }
    if (!found) return std::nullopt;
  }
  try {
    return std::stoll(index);
  } catch (const std::out_of_range&) {
    return std::nullopt;
  }
}

bool in_layers(const LoraSettings& l, const std::string& name) {
  if (l.layers_to_transform.empty()) return true;
  const std::optional<int64_t> i = layer_index(l, name);
  if (!i) return false;
  for (int64_t want : l.layers_to_transform)
    if (*i == want) return true;
  return false;
}

// get_pattern_key: the first key matching the end of `name` after a dot.
template <typename V>
const std::pair<std::string, V>* pattern_key(const std::vector<std::pair<std::string, V>>& keys,
                                             const std::string& field, const std::string& name) {
  for (const auto& kv : keys)
    if (match_at_start("(.*\\.)?(" + kv.first + ")$", field, name)) return &kv;
  return nullptr;
}

bool adapted(const LoraSettings& l, const std::string& name) {
  return !excluded(l, name) && named(l, name) && in_layers(l, name);
}

}  // namespace

std::regex lora_regex(const std::string& pattern, const std::string& field) {
  try {
    return std::regex(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw std::invalid_argument(field + ": \"" + pattern +
                                "\" is not a regular expression quanta reads (" + e.what() +
                                "; std::regex's ECMAScript syntax, which lacks Python's "
                                "lookbehind, named groups and inline flags)");
  }
}

std::optional<LoraLayerSettings> lora_layer_settings(const LoraSettings& l,
                                                     const std::string& name) {
  if (!adapted(l, name)) return std::nullopt;
  LoraLayerSettings s{l.r, l.lora_alpha};
  if (const auto* r = pattern_key(l.rank_pattern, "rank_pattern", name)) s.r = r->second;
  if (const auto* a = pattern_key(l.alpha_pattern, "alpha_pattern", name)) s.lora_alpha = a->second;
  return s;
}

bool saved_module(const std::vector<std::string>& modules_to_save, const std::string& name) {
  for (const std::string& m : modules_to_save)
    if (name.ends_with(m)) return true;
  return false;
}

UnusedLoraSettings unused_lora_settings(const LoraSettings& l,
                                        const std::vector<std::string>& layers) {
  UnusedLoraSettings out;
  const auto any = [&](auto&& pred) {
    for (const std::string& name : layers)
      if (pred(name)) return true;
    return false;
  };
  if (!l.target_modules_regex.empty()) {
    if (!any([&](const std::string& n) { return named(l, n); }))
      out.targets.push_back("target_modules regex \"" + l.target_modules_regex +
                            "\" matches no linear layer's full name");
  } else {
    for (const std::string& t : l.target_modules)
      if (!any([&](const std::string& n) { return named_by(l, t, n); }))
        out.targets.push_back("target_modules entry \"" + t + "\" matches no linear layer");
  }
  const auto named_not_excluded = [&](const std::string& n) {
    return named(l, n) && !excluded(l, n);
  };
  if (!l.exclude_modules_regex.empty() &&
      !any([&](const std::string& n) { return named(l, n) && excluded(l, n); }))
    out.others.push_back("exclude_modules regex \"" + l.exclude_modules_regex +
                         "\" excludes no targeted layer");
  for (const std::string& e : l.exclude_modules)
    if (!any([&](const std::string& n) { return named(l, n) && ends_with_part(n, e); }))
      out.others.push_back("exclude_modules entry \"" + e + "\" excludes no targeted layer");
  for (int64_t want : l.layers_to_transform)
    if (!any([&](const std::string& n) {
          return named_not_excluded(n) && layer_index(l, n) == std::optional<int64_t>(want);
        }))
      out.others.push_back("layers_to_transform has " + std::to_string(want) +
                           ", the index of no targeted layer");
  const auto check_keys = [&](const auto& keys, const char* field) {
    for (const auto& kv : keys)
      if (!any([&](const std::string& n) {
            return adapted(l, n) && pattern_key(keys, field, n) == &kv;
          }))
        out.others.push_back(std::string(field) + " key \"" + kv.first +
                             "\" gives no adapted layer its value");
  };
  check_keys(l.rank_pattern, "rank_pattern");
  check_keys(l.alpha_pattern, "alpha_pattern");
  return out;
}

std::vector<std::string> minimal_target_modules(const std::vector<std::string>& targets,
                                                const std::vector<std::string>& others) {
  if (targets.empty()) throw std::invalid_argument("[minimal_target_modules] no targets");
  // A name's suffixes of whole parts, shortest first.
  const auto suffixes = [](const std::string& name) {
    std::vector<std::string> out;
    for (std::size_t at = name.size();;) {
      const std::size_t dot = at == 0 ? std::string::npos : name.rfind('.', at - 1);
      if (dot == std::string::npos) {
        out.push_back(name);
        return out;
      }
      out.push_back(name.substr(dot + 1));
      at = dot;
    }
  };
  const std::set<std::string> other_set(others.begin(), others.end());
  std::set<std::string> taken_by_others;
  for (const std::string& o : others)
    for (std::string& s : suffixes(o)) taken_by_others.insert(std::move(s));
  // PEFT goes through the targets ordered by their suffix lists, for a
  // result that does not depend on the input's order.
  std::vector<std::pair<std::vector<std::string>, std::string>> ordered;
  for (const std::string& t : targets) {
    if (t.empty()) throw std::invalid_argument("[minimal_target_modules] an empty target");
    if (other_set.count(t))
      throw std::invalid_argument("[minimal_target_modules] " + t + " is a target and not one");
    ordered.emplace_back(suffixes(t), t);
  }
  std::sort(ordered.begin(), ordered.end());
  std::set<std::string> kept;
  for (const auto& [parts, name] : ordered) {
    if (std::any_of(kept.begin(), kept.end(),
                    [&](const std::string& k) { return ends_with_part(name, k); }))
      continue;
    for (const std::string& suffix : parts)
      if (!taken_by_others.count(suffix)) {
        kept.insert(suffix);
        break;
      }
  }
  return {kept.begin(), kept.end()};
}

}  // namespace quanta::llm
