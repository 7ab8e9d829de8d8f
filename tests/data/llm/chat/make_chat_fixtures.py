#!/usr/bin/env python3
# Makes tests/data/llm/chat/cases.json: expected renderings of the chat templates in
# tests/data/llm/chat/templates/*.jinja, produced by transformers' own chat-template renderer
# (transformers.utils.chat_template_utils.render_jinja_template), called the way
# PreTrainedTokenizerBase.apply_chat_template(tokenize=False) calls it. The C++ Jinja interpreter's
# tests read cases.json; no Python runs at test time.
#
# Run (no torch needed):
#   python3 -m venv /tmp/chat-venv && /tmp/chat-venv/bin/pip install -q "transformers==5.24.0" jinja2
#   /tmp/chat-venv/bin/python tests/data/llm/chat/make_chat_fixtures.py tests/data/llm/chat
#
# Each case: name, template (file name without .jinja), messages (as given to apply_chat_template,
# before transformers drops None-valued keys), tools (absent when None), add_generation_prompt,
# continue_final_message (false, true, or the name of the field to continue), variables (the other
# keyword arguments: bos_token/eos_token like a tokenizer's special_tokens_map, date_string, ...),
# then either expected (the rendered text) or error + error_type (str() and class name of the
# exception). Templates with {% generation %} also get generation_spans ([start, end) offsets in
# code points, from return_assistant_tokens_mask=True) and generation_byte_spans (same, in UTF-8 bytes).
import copy
import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jinja2  # noqa: E402
import transformers  # noqa: E402
from transformers.utils.chat_template_utils import (  # noqa: E402
    _normalize_chat_messages,
    render_jinja_template,
)

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
DATE = {"date_string": "26 Jul 2024"}

# ---------------------------------------------------------------- conversations
HELLO = [{"role": "user", "content": "Hello!"}]
SYS_HELLO = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
]
MULTI = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Eleven."},
]
MULTI_NOSYS = MULTI[1:]
UNICODE = [
    {"role": "user", "content": "Ça va? 你好 😀\nSecond line\twith a tab and \"quotes\" and a backslash \\"},
    {"role": "assistant", "content": "Très bien — merci!\n\n  indented line\n"},
]
EMPTY = [
    {"role": "user", "content": ""},
    {"role": "assistant", "content": ""},
]
PADDED = [
    {"role": "system", "content": "  Be kind.  \n"},
    {"role": "user", "content": "\n  Hi there  \n"},
    {"role": "assistant", "content": "  Hello!\n"},
    {"role": "user", "content": "Bye"},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Web search.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
]


def tool_call(name, arguments, id=None):
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if id is not None:
        call["id"] = id
    return call


TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            tool_call("get_weather", {"city": "Paris", "unit": "celsius"}, "call00001"),
            tool_call("get_weather", {"city": "Zürich"}, "call00002"),
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "call00002", "name": "get_weather", "content": "{\"temp\": 17}"},
    {"role": "assistant", "content": "Paris is 21°C, Zürich 17°C."},
]
TOOL_CHAT_SYS = [{"role": "system", "content": "Use tools when needed."}] + TOOL_CHAT
# OpenAI style: arguments as a JSON string, content None next to the tool calls.
TOOL_CHAT_STRING_ARGS = [
    {"role": "user", "content": "Find quanta docs."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call("search", "{\"query\": \"quanta docs\", \"max_results\": 3}", "abcDEF123")],
    },
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "3 results"},
    {"role": "user", "content": "Thanks, and the weather in Oslo?"},
]

# ---------------------------------------------------------------- torture data
DATA_A = {
    "people": [
        {"name": "Ada", "age": 36, "tags": ["math", "poet"]},
        {"name": "bob", "age": 25, "admin": True},
        {"name": "Cy", "age": 41, "email": None},
    ],
    "numbers": [3, 1, 4, 1, 5, 9, 2, 6],
    "mapping": {"zeta": 1, "Alpha": 2, "beta": 3},
    "empty": [],
    "text": "  Hello, World!  ",
    "uni": "héllo 😀",
}
DATA_B = {
    "people": [
        {"name": "zoe", "age": 25, "email": "z@example.com"},
        {"name": "Yan", "age": 19, "admin": False},
        {"name": "xi", "age": 25, "admin": True, "email": "x@example.com"},
        {"name": "Wu", "age": 70},
    ],
    "numbers": [2, 3],
    "mapping": {"b": 2, "a": 1, "C": 0},
    "empty": [],
    "text": "\n\tTabbed text\n",
    "uni": "naïve café — ∑ 🚀",
}


# ---------------------------------------------------------------- rendering
def render(src, messages, tools, add_generation_prompt, continue_final_message, variables, spans):
    """What apply_chat_template(tokenize=False) does before handing over to render_jinja_template."""
    conversations = [_normalize_chat_messages(copy.deepcopy(messages))]
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    rendered, indices = render_jinja_template(
        conversations=conversations,
        tools=copy.deepcopy(tools),
        documents=None,
        chat_template=src,
        return_assistant_tokens_mask=spans,
        continue_final_message=continue_final_message,
        add_generation_prompt=add_generation_prompt,
        **copy.deepcopy(variables),
    )
    return rendered[0], (indices[0] if spans else None)


def main(out_dir):
    tdir = os.path.join(out_dir, "templates")
    sources = {f[:-6]: open(os.path.join(tdir, f), encoding="utf-8").read() for f in sorted(os.listdir(tdir)) if f.endswith(".jinja")}
    cases = []

    def case(name, template, messages, tools=None, gen=False, cont=False, expect_error=False, **variables):
        variables = {**SPECIAL, **variables}
        spans = "{% generation %}" in sources[template] or "{%- generation %}" in sources[template]
        c = {"name": name, "template": template, "messages": messages}
        if tools is not None:
            c["tools"] = tools
        c.update(add_generation_prompt=gen, continue_final_message=cont, variables=variables)
        try:
            text, idx = render(sources[template], messages, tools, gen, cont, variables, spans and not cont)
        except Exception as e:  # the error a user of transformers would see
            if not expect_error:
                raise RuntimeError(f"case {name} failed unexpectedly: {type(e).__name__}: {e}") from e
            c["error"] = str(e)
            c["error_type"] = type(e).__name__
        else:
            if expect_error:
                raise RuntimeError(f"case {name} was expected to fail but rendered {text!r}")
            c["expected"] = text
            if idx is not None:
                c["generation_spans"] = [list(s) for s in idx]
                c["generation_byte_spans"] = [[len(text[:a].encode()), len(text[:b].encode())] for a, b in idx]
        cases.append(c)

    # chatml
    case("chatml/plain", "chatml", HELLO)
    case("chatml/plain-gen", "chatml", HELLO, gen=True)
    case("chatml/system", "chatml", SYS_HELLO, gen=True)
    case("chatml/multi", "chatml", MULTI)
    case("chatml/unicode", "chatml", UNICODE)
    case("chatml/empty-content", "chatml", EMPTY, gen=True)
    case("chatml/tools", "chatml", TOOL_CHAT, tools=TOOLS)
    case("chatml/tools-system-gen", "chatml", TOOL_CHAT_SYS, tools=TOOLS, gen=True)
    case("chatml/tools-string-args", "chatml", TOOL_CHAT_STRING_ARGS, tools=TOOLS, gen=True)
    case("chatml/tool-calls-without-tools", "chatml", TOOL_CHAT)
    case("chatml/continue", "chatml", HELLO + [{"role": "assistant", "content": "Hi! The answer starts with"}], cont=True)
    case("chatml/bad-role", "chatml", [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}], expect_error=True)

    # llama3
    case("llama3/plain", "llama3", HELLO, **DATE)
    case("llama3/system-trim-gen", "llama3", PADDED, gen=True, **DATE)
    case("llama3/multi", "llama3", MULTI, gen=True, date_string="01 Jan 2025")
    case("llama3/tools-in-user", "llama3", TOOL_CHAT_SYS, tools=TOOLS, **DATE)
    case("llama3/tools-in-system", "llama3", TOOL_CHAT, tools=TOOLS, gen=True, tools_in_user_message=False, **DATE)
    case(
        "llama3/tool-result-mapping",
        "llama3",
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "tool_calls": [tool_call("get_weather", {"city": "Oslo"})]},
            {"role": "ipython", "content": {"temp": -3, "sky": "snow ❄"}},
            {"role": "tool", "content": ["a", 1, None]},
        ],
        tools=TOOLS,
        gen=True,
        **DATE,
    )
    case("llama3/continue", "llama3", SYS_HELLO + [{"role": "assistant", "content": "Four, because"}], cont=True, **DATE)
    case("llama3/bad-role", "llama3", [{"role": "user", "content": "hi"}, {"role": "critic", "content": "meh"}], expect_error=True, **DATE)

    # gemma
    case("gemma/plain-gen", "gemma", HELLO, gen=True)
    case("gemma/system-merged", "gemma", SYS_HELLO, gen=True)
    case("gemma/multi", "gemma", MULTI)
    case("gemma/trim", "gemma", PADDED, gen=True)
    case("gemma/unicode", "gemma", UNICODE)
    # The template trims the content, so transformers takes its second continue_final_message path (rstrip).
    case("gemma/continue-trimmed", "gemma", HELLO + [{"role": "assistant", "content": "Well, "}], cont=True)
    case("gemma/bad-order", "gemma", [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}], expect_error=True)
    case(
        "gemma/bad-order-after-system",
        "gemma",
        [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        expect_error=True,
    )

    # mistral
    case("mistral/plain", "mistral", HELLO)
    case("mistral/system-last-user", "mistral", MULTI + [{"role": "user", "content": "And a third?"}])
    case("mistral/system-before-assistant-end", "mistral", MULTI)
    case("mistral/unicode-trim", "mistral", PADDED[1:])
    case(
        "mistral/tools",
        "mistral",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "tool_calls": [tool_call("get_weather", {"city": "Paris"}, "a1B2c3D4e")]},
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "sunny, 24°C"},
            {"role": "assistant", "content": "Sunny and 24°C."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=TOOLS,
    )
    case(
        "mistral/tools-string-args",
        "mistral",
        TOOL_CHAT_STRING_ARGS[:3] + [{"role": "assistant", "content": "Found 3."}, TOOL_CHAT_STRING_ARGS[3]],
        tools=TOOLS,
    )
    case("mistral/tools-then-user-alternation", "mistral", TOOL_CHAT_STRING_ARGS, tools=TOOLS, expect_error=True)
    case(
        "mistral/bad-tool-call-id",
        "mistral",
        [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [tool_call("search", {"query": "x"}, "short")]}],
        expect_error=True,
    )
    case(
        "mistral/bad-tool-result-id",
        "mistral",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [tool_call("search", {"query": "x"}, "123456789")]},
            {"role": "tool", "content": "done"},
        ],
        expect_error=True,
    )
    case("mistral/bad-alternation", "mistral", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], expect_error=True)
    case("mistral/gen-after-assistant", "mistral", MULTI, gen=True, expect_error=True)

    # phi
    case("phi/plain-gen", "phi", HELLO, gen=True)
    case("phi/system", "phi", SYS_HELLO)
    case("phi/multi", "phi", MULTI)
    case("phi/empty-system-skipped", "phi", [{"role": "system", "content": ""}] + UNICODE, gen=True)

    # think
    reasoning_chat = [
        {"role": "system", "content": "Think first.  \n"},
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12", "reasoning_content": "\nFour times three is twelve.\n"},
    ]
    case("think/plain-gen", "think", HELLO, gen=True)
    case("think/no-thinking-gen", "think", HELLO, gen=True, enable_thinking=False)
    case("think/thinking-true-gen", "think", SYS_HELLO, gen=True, enable_thinking=True)
    case("think/reasoning-multi", "think", reasoning_chat)
    case("think/reasoning-multi-gen", "think", reasoning_chat + [{"role": "user", "content": "Done?"}], gen=True)
    case(
        "think/inline-think-tags",
        "think",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello there!  "},
        ],
    )
    case(
        "think/reasoning-alias",  # transformers copies `reasoning` into reasoning_content (and thinking)
        "think",
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "Because."}],
    )
    case(
        "think/tools-multi-step",
        "think",
        [
            {"role": "user", "content": "Weather in Rome?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "Need the tool.",
                "tool_calls": [tool_call("get_weather", {"city": "Rome"})],
            },
            {"role": "tool", "content": "hot"},
            {"role": "user", "content": "<tool_response>\nextra\n</tool_response>"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Search too.",
                "tool_calls": [tool_call("search", "{\"query\": \"rome\"}"), tool_call("search", {"query": "roma"})],
            },
            {"role": "tool", "content": "r1"},
            {"role": "tool", "content": "r2"},
        ],
        tools=TOOLS,
        gen=True,
    )
    case("think/continue-content", "think", HELLO + [{"role": "assistant", "content": "Sure", "reasoning_content": "Easy."}], cont=True)
    case(
        "think/continue-reasoning",
        "think",
        HELLO + [{"role": "assistant", "content": "", "reasoning_content": "Let me think about"}],
        cont="reasoning_content",
    )
    case("think/bad-role", "think", [{"role": "user", "content": "a"}, {"role": "observer", "content": "b"}], expect_error=True)

    # generation (spans)
    case("generation/two-turns", "generation", MULTI_NOSYS[:2])
    case("generation/multi-system-gen", "generation", MULTI, gen=True)
    case("generation/empty-assistant", "generation", EMPTY)
    case("generation/unicode", "generation", UNICODE)
    case(
        "generation/reasoning",
        "generation",
        [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "  Because. ", "reasoning_content": "ponder 🤔"}],
        eos_token="<|end|>",
    )

    # torture
    case("torture/a", "torture", SYS_HELLO, data=DATA_A)
    case("torture/b", "torture", MULTI + [{"role": "user", "content": "x\ny ✓"}], gen=True, data=DATA_B, bos_token="[BOS]", eos_token="")
    case("torture/tools", "torture", TOOL_CHAT, tools=TOOLS, data=DATA_A)

    # sandbox: what transformers' ImmutableSandboxedEnvironment refuses (or quietly allows)
    for probe, fails in [
        ("list-append", True),
        ("dict-update", True),
        ("list-pop", True),
        ("dunder-print", False),
        ("namespace-underscore", True),
        ("set-attr-non-namespace", True),
        ("attr-of-undefined", True),
        ("call-undefined-method", True),
        ("str-plus-int", True),
        ("join-method-ints", True),
        ("div-zero", True),
        ("huge-range", True),
        ("include", True),
        ("raise", True),
        ("none", False),
    ]:
        case(f"sandbox/{probe}", "sandbox", HELLO, expect_error=fails, probe=probe)
    case("sandbox/do-tag", "sandbox_do", HELLO, expect_error=True)
    case("sandbox/unknown-filter", "sandbox_filter", HELLO, expect_error=True)

    used = {c["template"] for c in cases}
    assert used == set(sources), f"templates without cases: {set(sources) - used}"
    out = {"transformers": transformers.__version__, "jinja2": jinja2.__version__, "cases": cases}
    with open(os.path.join(out_dir, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases ({sum('error' in c for c in cases)} errors) to {out_dir}/cases.json")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
