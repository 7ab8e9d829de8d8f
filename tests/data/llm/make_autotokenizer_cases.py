"""Writes the ids transformers 5's AutoTokenizer gives where they differ from
what the tokenizer files alone say.

bpe/class_cases.json: the ids transformers 5 gives for the small
tokenizers of bpe/ (make_bpe_tokenizers.py) when a folder's
tokenizer_config.json names a tokenizer class. transformers 5 loads a folder
through that class, and LlamaTokenizer builds its own pipeline (Metaspace with
a prepend scheme from `legacy` and `add_prefix_space`, no normalizer) around
the vocabulary and merges of a tokenizer.json that is not byte-level, so its
ids differ from `tokenizers`' reading of the file after a special token
written in the text and for leading spaces. Run from the repository root with
transformers 5.24 (no torch needed):

    python3 -m venv /tmp/tf-venv && /tmp/tf-venv/bin/pip install -q "transformers==5.24.0"
    /tmp/tf-venv/bin/python tests/data/llm/make_autotokenizer_cases.py tests/data/llm

class_cases.json: {"transformers": version, "texts": [...], "cases": [{"tokenizer":
bpe folder, "config": the tokenizer_config.json written beside it, "ids": per
text (add_special_tokens=False), "with_special": per text (True), "decoded":
per text (skip_special_tokens=True)}]}

sentencepiece_cases.json: the same for the tiny SentencePiece model of
models/llama_gqa (tokenizer.model and config.json alone, then with a
tokenizer_config.json adding tokens beyond its 64 pieces), where transformers
splits the special tokens written in a text out first ({"transformers", "texts",
"cases": [{"config": the tokenizer_config.json or null, "ids", "decoded"}]}; no
ids with special tokens: whether a BOS goes first depends on the class
transformers picks, and quanta adds one as LlamaTokenizer does).

chat/assistant_masks.json: apply_chat_template(tokenize=True,
return_assistant_tokens_mask=True) of conversations through the chat templates
of chat/templates/ that hold {% generation %} blocks, with three tokenizers
(models/qwen2_bpe's byte-level tokenizer.json, bpe/llama2's as a LlamaTokenizer
folder, models/llama_gqa's tokenizer.model): {"transformers", "cases":
[{"tokenizer": "qwen2_bpe" | "llama2" | "llama_gqa", "template" (its name),
"source", "messages", "input_ids", "assistant_masks"}]}.
"""
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "  two leading spaces",
    "<s>[INST] What is NF4? [/INST] A 4-bit type.</s>",
    "a</s>b c</s> d",
    "<s>\nnewline after a special token",
    "tabs\tand  double  spaces   then\n\nnewlines",
    "café naïve 中文 🙂",
    "",
    " ",
]

CONFIGS = [
    ("llama2", {"tokenizer_class": "LlamaTokenizer"}),
    ("llama2", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True}),
    ("llama2", {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_prefix_space": False}),
    ("mistral", {"tokenizer_class": "LlamaTokenizerFast", "legacy": False}),
    ("gemma", {"tokenizer_class": "GemmaTokenizer"}),
    ("llama3", {"tokenizer_class": "LlamaTokenizerFast"}),
    ("qwen2", {"tokenizer_class": "Qwen2Tokenizer"}),
]


def main(root):
    out = {"transformers": transformers.__version__, "texts": TEXTS, "cases": []}
    for name, extra in CONFIGS:
        folder = tempfile.mkdtemp()
        shutil.copy(os.path.join(root, "bpe", name, "tokenizer.json"), folder)
        with open(os.path.join(root, "bpe", name, "tokenizer_config.json")) as f:
            config = json.load(f)
        config.update(extra)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)
        tok = AutoTokenizer.from_pretrained(folder)
        case = {"tokenizer": name, "config": config, "ids": [], "with_special": [], "decoded": []}
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            case["ids"].append(ids)
            case["with_special"].append(tok.encode(text, add_special_tokens=True))
            case["decoded"].append(tok.decode(ids, skip_special_tokens=True))
        out["cases"].append(case)
        shutil.rmtree(folder)
    with open(os.path.join(root, "bpe", "class_cases.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


SPM_TEXTS = [
    "hello world",
    "<s>[INST] hello [/INST] world</s>",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "x [INST]y",
    "<|im_start|><|im_end|>  a",
    "  two  spaces",
    "hello</s><s>the fox",
    "<unk>the rain",
    "the<s>",
    "",
]

SPM_CONFIG = {
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "added_tokens_decoder": {
        "0": {"content": "<unk>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True},
        "1": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True},
        "2": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
              "special": True},
        "64": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
               "single_word": False, "special": True},
        "65": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": True,
               "single_word": False, "special": True},
        "66": {"content": "[INST]", "lstrip": True, "normalized": False, "rstrip": False, "single_word": False,
               "special": False},
    },
}


def sentencepiece_cases(root):
    out = {"transformers": transformers.__version__, "texts": SPM_TEXTS, "cases": []}
    for config in [None, SPM_CONFIG]:
        folder = tempfile.mkdtemp()
        for f in ["config.json", "tokenizer.model"]:
            shutil.copy(os.path.join(root, "models", "llama_gqa", f), folder)
        if config is not None:
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                json.dump(config, f)
        tok = AutoTokenizer.from_pretrained(folder)
        case = {"config": config, "ids": [], "decoded": []}
        for text in SPM_TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            case["ids"].append(ids)
            case["decoded"].append(tok.decode(ids, skip_special_tokens=True))
        out["cases"].append(case)
        shutil.rmtree(folder)
    with open(os.path.join(root, "sentencepiece_cases.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven is prime."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Eleven, and 13 too."},
    ],
    [
        {"role": "user", "content": "Ça va? 你好 🙂"},
        {"role": "assistant", "content": "Très bien — merci!\n\n  indented line\n"},
    ],
    [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "  Because. ", "reasoning_content": "ponder 🤔"},
    ],
]


def tokenizer_folders(root):
    """(name, folder) for the three tokenizers, each in a folder of its own."""
    out = []
    qwen = tempfile.mkdtemp()
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(root, "models", "qwen2_bpe", f), qwen)
    out.append(("qwen2_bpe", qwen))
    llama2 = tempfile.mkdtemp()
    shutil.copy(os.path.join(root, "bpe", "llama2", "tokenizer.json"), llama2)
    with open(os.path.join(llama2, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"}, f)
    out.append(("llama2", llama2))
    spm = tempfile.mkdtemp()
    for f in ["config.json", "tokenizer.model"]:
        shutil.copy(os.path.join(root, "models", "llama_gqa", f), spm)
    out.append(("llama_gqa", spm))
    return out


# Spans that start right after a special token and end with one (ChatML's
# shape), and spans that start at a space inside the text (Llama 2's [/INST]
# answer), where a tokenizer may merge across the boundary.
INLINE_TEMPLATES = {
    "chatml_generation": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
        "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    ),
    "inst_generation": (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}"
        "{% generation %} {{ m.content | trim }} {{ eos_token }}{% endgeneration %}"
        "{% else %}[INST] {{ m.content | trim }} [/INST]{% endif %}{% endfor %}"
    ),
}


def assistant_mask_cases(root):
    templates = os.path.join(root, "chat", "templates")
    sources = {}
    for file in sorted(os.listdir(templates)):
        with open(os.path.join(templates, file)) as f:
            source = f.read()
        if "generation %}" in source.replace("endgeneration", ""):
            sources[file.removesuffix(".jinja")] = source
    sources.update(INLINE_TEMPLATES)
    out = {"transformers": transformers.__version__, "cases": []}
    for name, folder in tokenizer_folders(root):
        tok = AutoTokenizer.from_pretrained(folder)
        for template, source in sources.items():
            for messages in CONVERSATIONS:
                try:
                    r = tok.apply_chat_template(messages, chat_template=source, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
                except Exception:  # a template that refuses the conversation (raise_exception)
                    continue
                out["cases"].append({"tokenizer": name, "template": template, "source": source,
                                     "messages": messages, "input_ids": list(r["input_ids"]),
                                     "assistant_masks": list(r["assistant_masks"])})
        shutil.rmtree(folder)
    with open(os.path.join(root, "chat", "assistant_masks.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
    sentencepiece_cases(sys.argv[1])
    assistant_mask_cases(sys.argv[1])
