"""Writes small BPE tokenizers in the tokenizer.json forms the published
models ship, byte-level (GPT-2's, Llama 3's, Qwen2's, SmolLM's) and converted
from SentencePiece with byte fallback (Llama 2's, Mistral's, Gemma's), trained with
Hugging Face `tokenizers` on Debian's licence texts, and the ids `tokenizers`
gives for texts chosen to reach every rule (contractions, digit runs,
whitespace runs and newlines, accents in composed and decomposed form, CJK,
emoji, special tokens in the text, stripped added tokens). Run with the peer
environment (../shared/peer/setup.sh) from the repository root:

    /tmp/peer-venv/bin/python tests/data/llm/make_bpe_tokenizers.py tests/data/llm

bpe/<name>/tokenizer.json      the tokenizer
bpe/<name>/tokenizer_config.json  its eos_token (as the hub's folders name it)
bpe/cases.json                 for each tokenizer and text: the ids with and
                               without special tokens, and the decoded text
                               (skip_special_tokens=True)
"""
import json
import os
import sys

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(split=None, digits=False, ignore_merges=False, nfc=False):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    steps = []
    if split:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False))
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


# A corpus that does not change with this repository (Debian's base-files).
CORPUS = [f"/usr/share/common-licenses/{name}" for name in ("GPL-3", "Apache-2.0", "LGPL-2.1", "MPL-2.0")]


def train(tok, special, vocab_size=700):
    files = CORPUS
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def gpt2():
    tok = train(byte_level(), ["<|endoftext|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, "<|endoftext|>"


def llama3():
    tok = train(byte_level(split=LLAMA3_PATTERN, ignore_merges=True),
                ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok, "<|eot_id|>"


def qwen2():
    tok = train(byte_level(split=QWEN2_PATTERN, nfc=True), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # A token the text may hold, not special, absorbing the spaces around it.
    tok.add_tokens([tokenizers.AddedToken("<tool>", lstrip=True, rstrip=True, normalized=False,
                                          special=False)])
    return tok, "<|im_end|>"


def smollm():
    tok = train(byte_level(digits=True), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    # A token matched only as a whole word (not inside "metadata" or "data_x").
    tok.add_tokens([tokenizers.AddedToken("data", single_word=True, normalized=False)])
    return tok, "<|im_end|>"


TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "It's what we've done; they'll say I'd, you're, I'm. IT'S LOUD",
    "numbers 1 12 123 1234 12345 3.14159 -42 ٣٤٥",
    "tabs\tand  double  spaces   then\n\nnewlines\r\nand a line\n   indented",
    "café naïve résumé (composed) cafe\u0301 nai\u0308ve (decomposed)",
    "中文字符 日本語のテキスト 한국어",
    "emoji 🙂👍🏽 and symbols ©®™ → ≠ ∑",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|eot_id|> end",
    "<s>Hello</s> <s> world</s>",
    "call  <tool>  now and<tool>then",
    "data metadata datas data_x (data) dataé data",
    "quanta trains VQ tokenizers and QLoRA fine-tunes on many GPUs.",
    "",
    "   ",
    "\n",
    "a\u00a0b\u2003c\u000bd\u0085e",
]


# SentencePiece's BPE as transformers converts it: words marked by U+2581,
# characters outside the vocabulary as their bytes' <0xXX> tokens.
SPM_SPECIAL = ["<unk>", "<s>", "</s>"]


def sentencepiece_like(normalizer, pre_tokenizer, decoder, bos):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Trained on words (Metaspace, split), few characters kept: emoji and
    # CJK fall back to bytes.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPM_SPECIAL + [bos], show_progress=False,
                                  limit_alphabet=80)
    tok.train(CORPUS, trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for b in range(256):  # the byte tokens SentencePiece's byte_fallback models carry
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(j))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def llama2():  # transformers' legacy conversion: Prepend and Replace, no pre-tokenizer
    spm_decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return sentencepiece_like(normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
                              None, spm_decoder, "<s>"), "</s>"


def mistral():  # the later conversion: Metaspace, a prefix on the text's first piece
    return sentencepiece_like(None, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
                              decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False),
                              "<s>"), "</s>"


def gemma():  # spaces replaced, no prefix
    return sentencepiece_like(normalizers.Replace(" ", "\u2581"), None,
                              decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                                 decoders.Fuse()]), "<bos>"), "</s>"


def main(root):
    out = os.path.join(root, "bpe")
    cases = {"tokenizers": tokenizers.__version__, "texts": TEXTS, "tokenizers_cases": {}}
    for name, make in [("gpt2", gpt2), ("llama3", llama3), ("qwen2", qwen2), ("smollm", smollm),
                       ("llama2", llama2), ("mistral", mistral), ("gemma", gemma)]:
        tok, eos = make()
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": eos}, f, indent=2)
            f.write("\n")
        tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        rows = []
        for text in TEXTS:
            plain = tok.encode(text, add_special_tokens=False).ids
            special = tok.encode(text, add_special_tokens=True).ids
            rows.append({"ids": plain, "with_special": special,
                         "decoded": tok.decode(plain, skip_special_tokens=True)})
        cases["tokenizers_cases"][name] = {"eos_id": tok.token_to_id(eos), "cases": rows}
        print(name, tok.get_vocab_size(), [len(r["ids"]) for r in rows])
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
