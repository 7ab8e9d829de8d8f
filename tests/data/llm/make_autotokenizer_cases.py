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


if __name__ == "__main__":
    main(sys.argv[1])
    sentencepiece_cases(sys.argv[1])
