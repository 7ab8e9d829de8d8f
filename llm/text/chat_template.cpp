#include "llm/text/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "llm/text/tokenizer.h"

namespace quanta::llm {

namespace fs = std::filesystem;

namespace {

const char* const kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};
const std::string kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

nlohmann::ordered_json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return nlohmann::ordered_json();
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    throw std::invalid_argument(p.string() + ": not a JSON object");
  return j;
}

// tokenizer_config.json's special tokens by name: a string, or an added
// token's {"content": ...}.
nlohmann::ordered_json special_tokens_of(const nlohmann::ordered_json& config) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  if (!config.is_object()) return out;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    if (!config.contains(key)) continue;
    const nlohmann::ordered_json& v = config.at(key);
    if (v.is_string())
      out[key] = v;
    else if (v.is_object() && v.contains("content") && v.at("content").is_string())
      out[key] = v.at("content");
  }
  if (config.contains("additional_special_tokens") &&
      config.at("additional_special_tokens").is_array()) {
    nlohmann::ordered_json extra = nlohmann::ordered_json::array();
    for (const nlohmann::ordered_json& v : config.at("additional_special_tokens"))
      extra.push_back(v.is_object() && v.contains("content") ? v.at("content") : v);
    out["additional_special_tokens"] = extra;
  }
  return out;
}

// The special tokens a folder's template sees, as transformers gathers them:
// tokenizer_config.json's; special_tokens_map.json's over them in a folder
// whose tokenizer_config.json predates added_tokens_decoder; and for a
// tokenizer.model, its own BOS and EOS pieces where neither file names them
// (transformers' conversion of the model takes them from it).
nlohmann::ordered_json folder_special_tokens(const std::string& dir,
                                             const nlohmann::ordered_json& config) {
  nlohmann::ordered_json tokens = special_tokens_of(config);
  if (!config.is_object() || !config.contains("added_tokens_decoder")) {
    const nlohmann::ordered_json map =
        special_tokens_of(read_json(fs::path(dir) / "special_tokens_map.json"));
    for (auto it = map.begin(); it != map.end(); ++it) tokens[it.key()] = it.value();
  }
  const std::string model = tokenizer_model_in(dir);
  if (fs::path(model).extension() == ".model" && Tokenizer::available(model) &&
      (!tokens.contains("bos_token") || !tokens.contains("eos_token"))) {
    const Tokenizer tokenizer(model);
    if (!tokens.contains("bos_token") && tokenizer.bos_id() >= 0)
      tokens["bos_token"] = tokenizer.token(tokenizer.bos_id());
    if (!tokens.contains("eos_token") && tokenizer.eos_id() >= 0)
      tokens["eos_token"] = tokenizer.token(tokenizer.eos_id());
  }
  return tokens;
}

// transformers' _normalize_chat_messages and _alias_reasoning_fields.
nlohmann::ordered_json prepared(const nlohmann::ordered_json& messages) {
  if (!messages.is_array())
    throw std::invalid_argument("a conversation must be a list of messages");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const nlohmann::ordered_json& m : messages) {
    if (!m.is_object()) throw std::invalid_argument("chat messages must be dicts, got " + m.dump());
    nlohmann::ordered_json kept = nlohmann::ordered_json::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (!it.value().is_null()) kept[it.key()] = it.value();
    const nlohmann::ordered_json* reasoning = nullptr;
    for (const char* f : kReasoningFields)
      if (!reasoning && kept.contains(f)) reasoning = &kept.at(f);
    if (reasoning) {
      // {"thinking": r, **message, "reasoning_content": r}: thinking keeps a
      // value of its own, and comes first when new.
      nlohmann::ordered_json aliased = nlohmann::ordered_json::object();
      const nlohmann::ordered_json r = *reasoning;
      aliased["thinking"] = r;
      for (auto it = kept.begin(); it != kept.end(); ++it) aliased[it.key()] = it.value();
      aliased["reasoning_content"] = r;
      kept = std::move(aliased);
    }
    out.push_back(std::move(kept));
  }
  return out;
}

std::string rstrip(std::string s) {
  while (!s.empty() &&
         (s.back() == ' ' || s.back() == '\n' || s.back() == '\t' || s.back() == '\r'))
    s.pop_back();
  return s;
}

std::string strip(const std::string& s) {
  std::size_t b = 0;
  while (b < s.size() && (s[b] == ' ' || s[b] == '\n' || s[b] == '\t' || s[b] == '\r')) ++b;
  return rstrip(s.substr(b));
}

}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, nlohmann::ordered_json special_tokens)
    : special_tokens_(std::move(special_tokens)) {
  templates_.push_back({"default", source, jinja::Template(source)});
}

ChatTemplate::ChatTemplate(std::vector<Named> templates, nlohmann::ordered_json special_tokens,
                           std::string chosen)
    : templates_(std::move(templates)),
      special_tokens_(std::move(special_tokens)),
      chosen_(std::move(chosen)) {}

namespace {

// The folder's templates as transformers reads them: its template files
// (chat_template.jinja as "default", additional_chat_templates/NAME.jinja),
// which take priority over tokenizer_config.json's chat_template (a string,
// "default", or a list of {"name", "template"}). `where` names their origin.
std::vector<std::pair<std::string, std::string>> template_sources(
    const fs::path& dir, const nlohmann::ordered_json& config, std::string& where) {
  std::vector<std::pair<std::string, std::string>> out;
  const fs::path file = dir / "chat_template.jinja";
  if (fs::exists(file)) out.emplace_back("default", read_file(file));
  const fs::path extra = dir / "additional_chat_templates";
  if (fs::is_directory(extra)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(extra))
      if (e.path().extension() == ".jinja") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) out.emplace_back(f.stem().string(), read_file(f));
  }
  if (!out.empty()) {
    where = dir.string() + "'s template files";
    return out;
  }
  where = (dir / "tokenizer_config.json").string();
  const nlohmann::ordered_json t = config.is_object()
                                       ? config.value("chat_template", nlohmann::ordered_json())
                                       : nlohmann::ordered_json();
  if (t.is_string()) out.emplace_back("default", t.get<std::string>());
  if (t.is_array())
    for (const nlohmann::ordered_json& e : t) {
      if (!e.is_object() || !e.contains("name") || !e.at("name").is_string() ||
          !e.contains("template") || !e.at("template").is_string())
        throw std::invalid_argument(where + ": a chat_template entry is not {\"name\": ..., " +
                                    "\"template\": ...}");
      out.emplace_back(e.at("name").get<std::string>(), e.at("template").get<std::string>());
    }
  return out;
}

}  // namespace

bool ChatTemplate::available(const std::string& dir) {
  try {
    std::string where;
    return !template_sources(dir, read_json(fs::path(dir) / "tokenizer_config.json"), where)
                .empty();
  } catch (const std::invalid_argument&) {
    return false;
  }
}

ChatTemplate ChatTemplate::from_folder(const std::string& dir, const std::string& name,
                                       const std::string& template_path) {
  const nlohmann::ordered_json config = read_json(fs::path(dir) / "tokenizer_config.json");
  std::string where;
  std::vector<std::pair<std::string, std::string>> sources;
  // The folder the templates come from, when they come from one.
  const std::string folder = template_path.empty() ? dir : template_path;
  if (!template_path.empty() && !fs::is_directory(template_path)) {
    if (!fs::exists(template_path))
      throw std::invalid_argument(template_path + ": no such chat template file or folder");
    sources.emplace_back("default", read_file(template_path));
    where = template_path;
  } else {
    sources =
        template_sources(folder, read_json(fs::path(folder) / "tokenizer_config.json"), where);
  }
  if (sources.empty())
    throw std::invalid_argument(folder +
                                " has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json)");
  std::vector<Named> templates;
  std::string names;
  for (auto& [n, source] : sources) {
    names += (names.empty() ? "" : ", ") + n;
    try {
      templates.push_back({n, source, jinja::Template(source)});
    } catch (const jinja::TemplateError& e) {
      throw jinja::TemplateError(where + ": chat template \"" + n + "\": " + e.what());
    }
  }
  bool found = name.empty();
  for (const Named& t : templates) found = found || t.name == name;
  if (!found)
    throw std::invalid_argument(where + ": no chat template named \"" + name + "\" (it has " +
                                names + ")");
  if (name.empty()) {
    bool has_default = false;
    for (const Named& t : templates) has_default = has_default || t.name == "default";
    if (!has_default && templates.size() > 1)
      throw std::invalid_argument(where + ": several chat templates (" + names +
                                  ") and none named \"default\": name the one to use");
  }
  return ChatTemplate(std::move(templates), folder_special_tokens(dir, config), name);
}

const ChatTemplate::Named& ChatTemplate::chosen(bool with_tools) const {
  // As transformers' get_chat_template: a name asked for; else tool_use
  // when there are tools, else default, else the only one.
  const std::string want = !chosen_.empty() ? chosen_ : with_tools ? "tool_use" : "default";
  for (const Named& t : templates_)
    if (t.name == want) return t;
  if (chosen_.empty())
    for (const Named& t : templates_)
      if (t.name == "default") return t;
  return templates_.front();
}

void ChatTemplate::save(const std::string& dir) const {
  for (const Named& t : templates_) {
    const fs::path file = t.name == "default"
                              ? fs::path(dir) / "chat_template.jinja"
                              : fs::path(dir) / "additional_chat_templates" / (t.name + ".jinja");
    fs::create_directories(file.parent_path());
    std::ofstream out(file, std::ios::binary);
    out << t.source;
    if (!out) throw std::runtime_error(file.string() + ": cannot write");
  }
}

std::vector<std::string> ChatTemplate::names() const {
  std::vector<std::string> out;
  for (const Named& t : templates_) out.push_back(t.name);
  return out;
}

jinja::Rendered ChatTemplate::render(const nlohmann::ordered_json& messages,
                                     const ChatOptions& o) const {
  nlohmann::ordered_json chat = prepared(messages);
  const Named& use = chosen(!o.tools.is_null());
  std::string final_text;
  if (!o.continue_final_message.empty()) {
    if (o.add_generation_prompt)
      throw std::invalid_argument(
          "continue_final_message and add_generation_prompt do not go together");
    if (chat.empty())
      throw std::invalid_argument("continue_final_message is set but the conversation is empty");
    nlohmann::ordered_json& last = chat.back();
    const std::string& field = o.continue_final_message;
    if (!last.contains(field))
      throw std::invalid_argument("continue_final_message is set but the final message has no \"" +
                                  field + "\" to continue");
    std::vector<std::string> fields = {field};
    bool reasoning = false;
    for (const char* f : kReasoningFields) reasoning = reasoning || field == f;
    if (reasoning) {
      fields.clear();
      for (const char* f : kReasoningFields)
        if (last.contains(f) && last.at(f) == last.at(field)) fields.push_back(f);
    }
    bool read = false;
    for (const std::string& f : fields) read = read || use.source.find(f) != std::string::npos;
    if (!read)
      throw std::invalid_argument("continue_final_message is set to \"" + field +
                                  "\" but the chat template never reads it");
    nlohmann::ordered_json& value = last.at(field);
    if (value.is_array()) {
      bool found = false;
      for (auto it = value.rbegin(); it != value.rend() && !found; ++it)
        if (it->is_object() && it->contains("text") && it->at("text").is_string()) {
          final_text = it->at("text").get<std::string>();
          (*it)["text"] = final_text + kContinueTag;
          found = true;
        }
      if (!found)
        throw std::invalid_argument(
            "continue_final_message is set but the final message has no text to continue");
    } else if (value.is_string()) {
      final_text = value.get<std::string>();
      for (const std::string& f : fields) last[f] = last.at(f).get<std::string>() + kContinueTag;
    } else {
      throw std::invalid_argument("continue_final_message: the final message's \"" + field +
                                  "\" is not text");
    }
  }
  nlohmann::ordered_json variables = special_tokens_;
  for (auto it = o.variables.begin(); it != o.variables.end(); ++it)
    variables[it.key()] = it.value();
  variables["messages"] = chat;
  variables["tools"] = o.tools;
  variables["documents"] = o.documents;
  variables["add_generation_prompt"] = o.add_generation_prompt;
  jinja::Rendered r = use.compiled.render(jinja::Value::from_json(variables));
  if (!o.continue_final_message.empty()) {
    const std::string tag = strip(kContinueTag);
    const std::size_t at = r.text.rfind(tag);
    if (r.text.find(strip(final_text)) == std::string::npos || at == std::string::npos)
      throw std::invalid_argument(
          "continue_final_message is set but the final message does not appear in the chat "
          "after applying the chat template");
    r.text = r.text.compare(at, kContinueTag.size(), kContinueTag) == 0
                 ? r.text.substr(0, at)
                 : rstrip(r.text.substr(0, at));
  }
  return r;
}

}  // namespace quanta::llm
