#!/usr/bin/env python3
"""Tokenizes text for quanta with a model's Hugging Face tokenizer.json and
writes an llm.c token file (what `quanta eval --model --data` reads).

quanta reads raw text itself through a SentencePiece tokenizer.model or a
byte-level BPE tokenizer.json (docs/llm.md, "Text"). This script tokenizes
with any tokenizer.json, including the kinds quanta refuses, or a corpus once
ahead of many runs; it needs the `tokenizers` package (pip install
tokenizers).

    tools/tokenize.py --tokenizer MODEL_DIR --text corpus.txt --out tokens.bin
    tools/tokenize.py --tokenizer MODEL_DIR --jsonl data.jsonl --field text --out tokens.bin

Each document (the whole text file, or each JSONL line's field) is encoded
without special tokens; --bos / --eos put the model's BOS / EOS ids (from
--bos-id / --eos-id, else the tokenizer's bos_token / eos_token in
tokenizer_config.json) around every document. Ids are written as uint16
(magic 20240520, version 1) when the vocabulary fits, else uint32 (magic
20240801, version 7), with the 256 x int32 header llm.c's data_common.py
writes.
"""
import argparse
import json
import os
import struct
import sys


def special_id(tok, model_dir, key, given):
    if given is not None:
        return given
    cfg = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(cfg):
        with open(cfg) as f:
            name = json.load(f).get(key)
        if isinstance(name, dict):
            name = name.get("content")
        if name is not None and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    sys.exit(f"tokenize.py: no {key} in {cfg}; pass --{key.split('_')[0]}-id")


def documents(args):
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            yield f.read()
        return
    with open(args.jsonl, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"tokenize.py: {args.jsonl}:{n}: not JSON ({e})")
            if not isinstance(obj.get(args.field), str):
                sys.exit(f"tokenize.py: {args.jsonl}:{n}: no string field \"{args.field}\"")
            yield obj[args.field]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="model folder with tokenizer.json (or the file)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a UTF-8 text file: one document")
    src.add_argument("--jsonl", help="one JSON object per line: one document each")
    p.add_argument("--field", default="text", help="the JSONL field holding the text")
    p.add_argument("--out", required=True, help="the token file to write")
    p.add_argument("--bos", action="store_true", help="put BOS before every document")
    p.add_argument("--eos", action="store_true", help="put EOS after every document")
    p.add_argument("--bos-id", type=int)
    p.add_argument("--eos-id", type=int)
    args = p.parse_args()

    from tokenizers import Tokenizer

    path = args.tokenizer
    model_dir = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        sys.exit(f"tokenize.py: {path} does not exist")
    tok = Tokenizer.from_file(path)
    bos = special_id(tok, model_dir, "bos_token", args.bos_id) if args.bos else None
    eos = special_id(tok, model_dir, "eos_token", args.eos_id) if args.eos else None
    ids = []
    for doc in documents(args):
        if bos is not None:
            ids.append(bos)
        ids.extend(tok.encode(doc, add_special_tokens=False).ids)
        if eos is not None:
            ids.append(eos)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    wide = vocab > 65536 or (ids and max(ids) >= 65536)
    header = [0] * 256
    header[0], header[1], header[2] = (20240801, 7, len(ids)) if wide else (20240520, 1, len(ids))
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(ids)}{'I' if wide else 'H'}", *ids))
    os.replace(tmp, args.out)
    print(f"tokenize.py: {len(ids)} tokens ({'uint32' if wide else 'uint16'}) -> {args.out}")


if __name__ == "__main__":
    main()
