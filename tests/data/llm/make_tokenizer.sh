#!/bin/sh
# Trains the tiny SentencePiece tokenizer of tests/data/llm/models/llama_gqa
# (64 pieces, the tiny model's vocabulary; ids 0 unk, 1 <s>, 2 </s>, as
# Llama's; no normalization table, which alone would be 240 KB) and writes
# what the reference encoder gives for a few texts.
# Needs Debian's `sentencepiece` (spm_train, spm_encode). Run from the
# repository root:  sh tests/data/llm/make_tokenizer.sh
set -eu
out=tests/data/llm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/corpus.txt" <<'TEXT'
the quick brown fox jumps over the lazy dog
a tiny model reads a tiny text and writes a tiny answer
quanta trains vector quantizers and language models on many machines
hello world, hello model, hello tokens
the rain in spain stays mainly in the plain
TEXT
spm_train --input="$tmp/corpus.txt" --model_prefix="$tmp/tok" --vocab_size=64 \
  --model_type=bpe --character_coverage=1.0 --normalization_rule_name=identity --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 \
  --minloglevel=2
cp "$tmp/tok.model" "$out/models/llama_gqa/tokenizer.model"
# One case per line: the text, a tab, its ids (spm_encode, no BOS).
: > "$out/tokenizer_cases.tsv"
for text in "hello world" "the lazy fox reads a model" "Quanta, tiny text!" "  two  spaces"; do
  ids=$(printf '%s\n' "$text" | spm_encode --model="$tmp/tok.model" --output_format=id)
  printf '%s\t%s\n' "$text" "$ids" >> "$out/tokenizer_cases.tsv"
done
