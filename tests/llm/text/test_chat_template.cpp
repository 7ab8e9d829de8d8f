// Chat templates rendered as transformers renders them: every case of
// tests/data/llm/chat/cases.json (made by make_chat_fixtures.py through
// transformers' own render_jinja_template) gives the same text and
// {% generation %} spans, or fails where transformers fails (a template's
// raise_exception with its message), and the Jinja layer's own errors name
// the line.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "llm/data/token_jsonl.h"
#include "llm/text/chat_template.h"
#include "llm/text/tokenizer.h"
#include "support/test_data.h"

using namespace quanta::llm;
using nlohmann::ordered_json;

namespace {

std::string chat_data() { return quanta::testing::test_data("llm/chat/"); }

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string render(const std::string& source,
                   const ordered_json& variables = ordered_json::object()) {
  return jinja::Template(source).render(jinja::Value::from_json(variables)).text;
}

std::string error_of(const std::string& source) {
  try {
    (void)render(source);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("chat templates: every fixture renders as transformers renders it") {
  const std::string dir = chat_data();
  std::ifstream in(dir + "cases.json");
  REQUIRE(in.good());
  const ordered_json fixture = ordered_json::parse(in);
  int passed = 0, failed_as_expected = 0;
  for (const ordered_json& c : fixture.at("cases")) {
    const std::string name = c.at("name").get<std::string>();
    CAPTURE(name);
    const std::string source =
        read(dir + "templates/" + c.at("template").get<std::string>() + ".jinja");
    ChatOptions o;
    o.add_generation_prompt = c.value("add_generation_prompt", false);
    const ordered_json& cont = c.at("continue_final_message");
    o.continue_final_message = cont.is_string()   ? cont.get<std::string>()
                               : cont.get<bool>() ? "content"
                                                  : "";
    if (c.contains("tools")) o.tools = c.at("tools");
    o.variables = c.at("variables");
    if (c.contains("error")) {
      const std::string type = c.at("error_type").get<std::string>();
      std::string got = "no error";
      bool raised = false;
      try {
        (void)ChatTemplate(source).render(c.at("messages"), o);
      } catch (const jinja::TemplateRaised& e) {
        got = e.what();
        raised = true;
      } catch (const std::exception& e) {
        got = e.what();
      }
      CAPTURE(got);
      if (type == "TemplateError") {
        // The template's own raise_exception: its message, exactly.
        CHECK(raised);
        CHECK(got == c.at("error").get<std::string>());
      } else {
        CHECK_FALSE(raised);
        CHECK(got != "no error");
      }
      ++failed_as_expected;
      continue;
    }
    jinja::Rendered r;
    try {
      r = ChatTemplate(source).render(c.at("messages"), o);
    } catch (const std::exception& e) {
      FAIL_CHECK("threw: " << std::string(e.what()));
      continue;
    }
    CHECK(r.text == c.at("expected").get<std::string>());
    if (c.contains("generation_byte_spans")) {
      std::vector<std::pair<std::size_t, std::size_t>> want;
      for (const ordered_json& s : c.at("generation_byte_spans"))
        want.emplace_back(s.at(0).get<std::size_t>(), s.at(1).get<std::size_t>());
      CHECK(r.generation_spans == want);
    }
    ++passed;
  }
  MESSAGE(passed << " rendered, " << failed_as_expected << " failed as transformers fails");
  CHECK(passed >= 50);
}

TEST_CASE(
    "chat templates: Jinja's own errors name the line, and nothing unsupported passes silently") {
  // An unknown filter or test fails where it is used (Jinja 3 lets a
  // branch that is never taken name one).
  CHECK(error_of("a\n{{ x | no_such }}") == "template line 2: No filter named 'no_such'.");
  CHECK(error_of("{% if x is no_such %}{% endif %}") ==
        "template line 1: No test named 'no_such'.");
  CHECK(render("{% if false %}{{ x | no_such }}{% endif %}ok") == "ok");
  CHECK(error_of("{% if true %}") ==
        "template line 1: the template ends inside a block: expected {% elif %}");
  CHECK(error_of("{% include 'x' %}") ==
        "template line 1: {% include %} is not supported in chat templates (no other templates to "
        "load)");
  CHECK(error_of("x\n\n{{ 'abc }}") == "template line 3: an unclosed string");
  CHECK(error_of("{{ nope.attr }}") == "template line 1: 'nope' is undefined");
  CHECK(error_of("{% set xs = [] %}{% set _ = xs.append(1) %}") ==
        "template line 1: access to attribute 'append' of 'list' object is unsafe.");
  CHECK(error_of("{{ 1 / 0 }}") == "template line 1: division by zero");
  CHECK(error_of("{% break %}") == "{% break %} outside a for loop");
  // What renders: Python's values, Jinja's scoping.
  CHECK(render("{{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-5 }} {{ 3 / 2 }} {{ 7 // -2 }} {{ -7 % 3 }}") ==
        "0.30000000000000004 1e+20 1e-05 1.5 -4 2");
  CHECK(render("{{ [1, 'it\\'s', none, true] }} {{ {'a': (1,)} }}") ==
        "[1, \"it's\", None, True] {'a': (1,)}");
  CHECK(
      render(
          "{% set x = 1 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %} {{ x }}") ==
      "124 1");
  CHECK(render("{{ 'héllo wörld'[1:4] }} {{ 'abc'[::-1] }} {{ 'a,b,,c'.split(',') }}") ==
        "éll cba ['a', 'b', '', 'c']");
  // Line breaks read as Jinja 3 reads them: \r\n and \r are \n (trim_blocks
  // and lstrip_blocks then work alike), one final one dropped.
  const std::string lf = "a\n  {% if true %}\n  b {{ 'x\ny' }}\n  {% endif %}\nc\n";
  std::string crlf, cr;
  for (const char ch : lf) {
    crlf += ch == '\n' ? std::string("\r\n") : std::string(1, ch);
    cr += ch == '\n' ? '\r' : ch;
  }
  CHECK(render(lf) == "a\n  b x\ny\nc");
  CHECK(render(crlf) == render(lf));
  CHECK(render(cr) == render(lf));
  // Integers: exact up to 64 bits, refused past them (never wrapped), and
  // a power by squaring (1 ** 10**18 ends at once).
  const ordered_json big = {{"max", INT64_MAX}, {"min", INT64_MIN}};
  CHECK(render("{{ max - 1 + 1 }} {{ min // 1 }} {{ min % -1 }} {{ -(min + 1) }}", big) ==
        "9223372036854775807 -9223372036854775808 0 9223372036854775807");
  CHECK(render("{{ 1 ** 1000000000000000000 }} {{ (-2) ** 63 }} {{ 3 ** 39 }}") ==
        "1 -9223372036854775808 4052555153018976267");
  for (const char* overflow :
       {"{{ max + 1 }}", "{{ min - 1 }}", "{{ max * 2 }}", "{{ -min }}", "{{ min | abs }}",
        "{{ min // -1 }}", "{{ 2 ** 63 }}", "{{ 3 ** 40 }}", "{{ [max, 1] | sum }}"}) {
    CAPTURE(overflow);
    std::string got = "no error";
    try {
      (void)render(overflow, big);
    } catch (const std::exception& e) {
      got = e.what();
    }
    CHECK(got == "template line 1: an integer beyond 64 bits");
  }
  const ordered_json v = {{"m", {{"b", 1}, {"a", "é\n"}}}};
  CHECK(render("{{ m | tojson }} {{ m | tojson(indent=2) }}", v) ==
        "{\"b\": 1, \"a\": \"é\\n\"} {\n  \"b\": 1,\n  \"a\": \"é\\n\"\n}");
}

TEST_CASE("chat templates: a folder's template and special tokens") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("quanta_chat_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
            "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"},
                              {"name": "tool_use", "template": "tools"}]})";
  CHECK(ChatTemplate::available(dir.string()));
  const ChatTemplate t = ChatTemplate::from_folder(dir.string());
  CHECK(t.render(
             ordered_json::array({{{"role", "user"}, {"content", "hi"}, {"tool_calls", nullptr}}}))
            .text == "<s>hi</s>");
  CHECK(ChatTemplate::from_folder(dir.string(), "tool_use").render(ordered_json::array()).text ==
        "tools");
  CHECK_THROWS_WITH_AS(
      ChatTemplate::from_folder(dir.string(), "rag"),
      doctest::Contains("no chat template named \"rag\" (it has default, tool_use)"),
      std::invalid_argument);
  // A template from elsewhere (TRL's chat_template_path) with this folder's
  // special tokens: a Jinja file, or another folder's templates.
  const fs::path other = dir.string() + "_other";
  fs::create_directories(other);
  std::ofstream(other / "train.jinja") << "{{ bos_token }}[{{ messages | length }}]";
  CHECK(ChatTemplate::from_folder(dir.string(), "", (other / "train.jinja").string())
            .render(ordered_json::array())
            .text == "<s>[0]");
  std::ofstream(other / "chat_template.jinja") << "{{ eos_token }}";
  CHECK(ChatTemplate::from_folder(dir.string(), "", other.string())
            .render(ordered_json::array())
            .text == "</s>");
  CHECK_THROWS_WITH_AS(ChatTemplate::from_folder(dir.string(), "", (other / "no.jinja").string()),
                       doctest::Contains("no.jinja: no such chat template file or folder"),
                       std::invalid_argument);
  fs::remove_all(other);
  // With tools and no name asked for, transformers takes "tool_use".
  ChatOptions with_tools;
  with_tools.tools = ordered_json::array();
  CHECK(t.render(ordered_json::array(), with_tools).text == "tools");
  CHECK(ChatTemplate::from_folder(dir.string(), "default")
            .render(ordered_json::array(), with_tools)
            .text == "<s>");
  // chat_template.jinja, which transformers writes since 4.50, wins, with
  // additional_chat_templates/NAME.jinja beside it.
  std::ofstream(dir / "chat_template.jinja") << "{{ messages | length }}";
  CHECK(ChatTemplate::from_folder(dir.string())
            .render(ordered_json::array({ordered_json::object()}))
            .text == "1");
  CHECK(ChatTemplate::from_folder(dir.string()).names() == std::vector<std::string>{"default"});
  fs::create_directories(dir / "additional_chat_templates");
  std::ofstream(dir / "additional_chat_templates" / "rag.jinja") << "rag {{ documents | length }}";
  std::ofstream(dir / "additional_chat_templates" / "tool_use.jinja")
      << "{{ tools | length }} tools";
  const ChatTemplate files = ChatTemplate::from_folder(dir.string());
  CHECK(files.names() == std::vector<std::string>{"default", "rag", "tool_use"});
  CHECK(files.render(ordered_json::array(), with_tools).text == "0 tools");
  ChatOptions with_documents;
  with_documents.documents = ordered_json::array({ordered_json::object()});
  CHECK(ChatTemplate::from_folder(dir.string(), "rag")
            .render(ordered_json::array(), with_documents)
            .text == "rag 1");
  CHECK_THROWS_WITH_AS(ChatTemplate::from_folder(dir.string(), "x"),
                       doctest::Contains("template files: no chat template named \"x\" (it has "
                                         "default, rag, tool_use)"),
                       std::invalid_argument);
  // Several and no default: which one is for the caller to say.
  fs::remove(dir / "chat_template.jinja");
  CHECK_THROWS_WITH_AS(ChatTemplate::from_folder(dir.string()),
                       doctest::Contains("several chat templates (rag, tool_use) and none named "
                                         "\"default\""),
                       std::invalid_argument);
  std::ofstream(dir / "additional_chat_templates" / "rag.jinja") << "{% if %}";
  CHECK_THROWS_WITH_AS(ChatTemplate::from_folder(dir.string(), "tool_use"),
                       doctest::Contains("chat template \"rag\": template line 1"),
                       jinja::TemplateError);
  fs::remove_all(dir / "additional_chat_templates");
  fs::remove_all(dir);
  CHECK_FALSE(ChatTemplate::available(dir.string()));
  CHECK_THROWS_WITH_AS(ChatTemplate::from_folder(dir.string()),
                       doctest::Contains("has no chat template"), std::invalid_argument);
}

TEST_CASE("chat templates: JSONL conversations become the ids apply_chat_template gives") {
  namespace fs = std::filesystem;
  const fs::path model = fs::path(quanta::testing::test_data("llm/models/qwen2_bpe"));
  if (!Tokenizer::available((model / "tokenizer.json").string())) {
    MESSAGE("skipped: this build reads no tokenizer.json (ICU not found)");
    return;
  }
  const fs::path dir =
      fs::temp_directory_path() / ("quanta_chat_jsonl_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const auto& f : fs::directory_iterator(model))
    fs::copy_file(f.path(), dir / f.path().filename());
  const std::string chatml = read(chat_data() + "templates/chatml.jinja");
  std::ofstream(dir / "chat_template.jinja") << chatml;
  const ordered_json messages =
      ordered_json::array({{{"role", "user"}, {"content", "the quick brown fox"}},
                           {{"role", "assistant"}, {"content", "jumps over the lazy dog"}}});
  const ordered_json tools = ordered_json::array(
      {{{"type", "function"},
        {"function", {{"name", "f"}, {"parameters", ordered_json::object()}}}}});
  {
    std::ofstream jl(dir / "chat.jsonl");
    jl << ordered_json{{"messages", messages}}.dump() << "\n";
    jl << ordered_json{{"messages", messages}, {"tools", tools}}.dump() << "\n";
    jl << ordered_json{{"prompt", ordered_json::array({messages[0]})},
                       {"completion", ordered_json::array({messages[1]})}}
              .dump()
       << "\n";
  }
  const Tokenizer tok((model / "tokenizer.json").string());
  const ChatTemplate t(chatml);
  const auto ids_of = [&](const ordered_json& m, bool generation, const ordered_json& with_tools) {
    ChatOptions o;
    o.add_generation_prompt = generation;
    o.tools = with_tools;
    return tok.encode(t.render(m, o).text, false);
  };
  const std::vector<int64_t> plain = ids_of(messages, false, nullptr);
  const std::vector<int64_t> prompt = ids_of(ordered_json::array({messages[0]}), true, nullptr);
  for (const bool completions_only : {false, true}) {
    CAPTURE(completions_only);
    const auto read_all = [&] {
      return read_token_jsonl(
          (dir / "chat.jsonl").string(), {},
          folder_text_reader(dir.string(), {.completions_only = completions_only}));
    };
    if (completions_only) {
      // Every line must then be a pair: the first is refused, naming it.
      CHECK_THROWS_WITH(read_all(),
                        doctest::Contains("chat.jsonl: line 1: no prompt and completion"));
      continue;
    }
    const std::vector<TokenExample> e = read_all();
    REQUIRE(e.size() == 3);
    CHECK(e[0].input_ids == plain);
    CHECK(e[0].labels == plain);
    CHECK(e[1].input_ids == ids_of(messages, false, tools));
    // The completion is what the whole conversation adds to the prompt.
    CHECK(e[2].input_ids == plain);
    REQUIRE(prompt.size() < plain.size());
    CHECK(std::equal(prompt.begin(), prompt.end(), plain.begin()));
  }
  {
    std::ofstream jl(dir / "pairs.jsonl");
    jl << ordered_json{{"prompt", ordered_json::array({messages[0]})},
                       {"completion", ordered_json::array({messages[1]})}}
              .dump()
       << "\n";
  }
  const std::vector<TokenExample> masked =
      read_token_jsonl((dir / "pairs.jsonl").string(), {},
                       folder_text_reader(dir.string(), {.completions_only = true}));
  REQUIRE(masked.size() == 1);
  for (std::size_t k = 0; k < plain.size(); ++k)
    CHECK(masked[0].labels[k] == (k < prompt.size() ? kIgnoreIndex : plain[k]));
  // Errors name the line: a template's refusal, no template at all.
  std::ofstream(dir / "bad.jsonl")
      << ordered_json{{"messages", ordered_json::array({{{"role", "narrator"}, {"content", "x"}}})}}
             .dump()
      << "\n";
  CHECK_THROWS_WITH(
      read_token_jsonl((dir / "bad.jsonl").string(), {}, folder_text_reader(dir.string())),
      doctest::Contains("bad.jsonl: line 1: the chat template: chatml: unknown role narrator"));
  fs::remove(dir / "chat_template.jinja");
  CHECK_THROWS_WITH(
      read_token_jsonl((dir / "chat.jsonl").string(), {}, folder_text_reader(dir.string())),
      doctest::Contains(
          "chat.jsonl: line 1: a conversation needs the model folder's chat template"));
  fs::remove_all(dir);
}

TEST_CASE("chat templates: the assistant's tokens are those apply_chat_template marks") {
  // chat/assistant_masks.json (make_autotokenizer_cases.py): transformers'
  // return_assistant_tokens_mask for templates with {% generation %} blocks,
  // through a byte-level tokenizer.json, a LlamaTokenizer folder and a
  // tokenizer.model; here through read_token_jsonl's assistant-only loss.
  namespace fs = std::filesystem;
  const fs::path data = fs::path(quanta::testing::test_data("llm"));
  if (!Tokenizer::available((data / "models/qwen2_bpe/tokenizer.json").string()) ||
      !Tokenizer::available((data / "models/llama_gqa/tokenizer.model").string())) {
    MESSAGE("skipped: this build lacks ICU or libsentencepiece");
    return;
  }
  std::ifstream in(chat_data() + "assistant_masks.json");
  REQUIRE(in.good());
  const ordered_json fixture = ordered_json::parse(in);
  int cases = 0;
  for (const ordered_json& c : fixture.at("cases")) {
    const std::string tokenizer = c.at("tokenizer").get<std::string>();
    CAPTURE(tokenizer);
    CAPTURE(c.at("template").get<std::string>());
    CAPTURE(c.at("messages").dump());
    const fs::path dir =
        fs::temp_directory_path() /
        ("quanta_assistant_" + std::to_string(::getpid()) + "_" + std::to_string(cases));
    fs::create_directories(dir);
    if (tokenizer == "qwen2_bpe") {
      for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
        fs::copy_file(data / "models/qwen2_bpe" / f, dir / f);
    } else if (tokenizer == "llama2") {
      fs::copy_file(data / "bpe/llama2/tokenizer.json", dir / "tokenizer.json");
      std::ofstream(dir / "tokenizer_config.json")
          << R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"})";
    } else {
      for (const char* f : {"config.json", "tokenizer.model"})
        fs::copy_file(data / "models/llama_gqa" / f, dir / f);
    }
    std::ofstream(dir / "chat_template.jinja") << c.at("source").get<std::string>();
    std::ofstream(dir / "chat.jsonl")
        << ordered_json{{"messages", c.at("messages")}}.dump() << "\n";
    const std::vector<TokenExample> e =
        read_token_jsonl((dir / "chat.jsonl").string(), {},
                         folder_text_reader(dir.string(), {.assistant_only = true}));
    REQUIRE(e.size() == 1);
    CHECK(e[0].input_ids == c.at("input_ids").get<std::vector<int64_t>>());
    const std::vector<int> want = c.at("assistant_masks").get<std::vector<int>>();
    std::vector<int> got;
    for (const int64_t label : e[0].labels) got.push_back(label != kIgnoreIndex);
    std::string gs, ws;
    for (int v : got) gs += char('0' + v);
    for (int v : want) ws += char('0' + v);
    CHECK(gs == ws);
    fs::remove_all(dir);
    ++cases;
  }
  CHECK(cases == 27);
  {
    // TRL's per-line chat_template_kwargs reach the template as variables.
    const fs::path kdir =
        fs::temp_directory_path() / ("quanta_kwargs_" + std::to_string(::getpid()));
    fs::create_directories(kdir);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(data / "models/qwen2_bpe" / f, kdir / f);
    std::ofstream(kdir / "chat_template.jinja")
        << "{{ messages[0].content }}{% if think is defined %} think={{ think }}{% endif %}";
    const ordered_json hi = ordered_json::array({{{"role", "user"}, {"content", "hi"}}});
    std::ofstream(kdir / "k.jsonl")
        << ordered_json{{"messages", hi}}.dump() << "\n"
        << ordered_json{{"messages", hi}, {"chat_template_kwargs", {{"think", false}}}}.dump()
        << "\n";
    std::ofstream(kdir / "bad.jsonl")
        << ordered_json{{"messages", hi}, {"chat_template_kwargs", "x"}}.dump() << "\n";
    const Tokenizer tok((kdir / "tokenizer.json").string());
    const std::vector<TokenExample> e =
        read_token_jsonl((kdir / "k.jsonl").string(), {}, folder_text_reader(kdir.string()));
    REQUIRE(e.size() == 2);
    CHECK(e[0].input_ids == tok.encode("hi", false));
    CHECK(e[1].input_ids == tok.encode("hi think=False", false));
    CHECK_THROWS_WITH(
        read_token_jsonl((kdir / "bad.jsonl").string(), {}, folder_text_reader(kdir.string())),
        doctest::Contains("bad.jsonl: line 1: chat_template_kwargs is not an object"));
    fs::remove_all(kdir);
  }
  // What the assistant-only loss refuses, naming the line: a line that is
  // no conversation, a template that marks no assistant token.
  const fs::path dir =
      fs::temp_directory_path() / ("quanta_assistant_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(data / "models/qwen2_bpe" / f, dir / f);
  std::ofstream(dir / "chat_template.jinja")
      << "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
  const ordered_json turns = ordered_json::array(
      {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "hello"}}});
  std::ofstream(dir / "chat.jsonl") << ordered_json{{"messages", turns}}.dump() << "\n";
  std::ofstream(dir / "text.jsonl") << ordered_json{{"text", "hello"}}.dump() << "\n";
  const auto read_assistant = [&](const char* file) {
    return read_token_jsonl((dir / file).string(), {},
                            folder_text_reader(dir.string(), {.assistant_only = true}));
  };
  CHECK_THROWS_WITH(read_assistant("chat.jsonl"),
                    doctest::Contains("chat.jsonl: line 1: the chat template marks no assistant "
                                      "tokens"));
  CHECK_THROWS_WITH(read_assistant("text.jsonl"),
                    doctest::Contains("text.jsonl: line 1: not a conversation"));
  fs::remove_all(dir);
}
