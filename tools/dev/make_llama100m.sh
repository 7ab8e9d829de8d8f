#!/bin/sh
# Writes the ~110M Llama of `quanta bench llm` (768 hidden, 12 layers, 12 heads,
# 2048 MLP, 32000 vocabulary, tied, f32; random weights from transformers'
# own initialisation, seed 0) as a Hugging Face folder with a SentencePiece
# tokenizer trained on the license texts every Debian machine has: the model
# of docs/finetune.md's "The ~110M config on a license text".
#
# Needs Debian's `sentencepiece` (spm_train) and the peer environment's
# python with transformers (sh ../shared/peer/setup.sh). Usage:
#   sh tools/dev/make_llama100m.sh OUT_DIR [PYTHON]
set -eu
out=${1:?usage: make_llama100m.sh OUT_DIR [PYTHON]}
python=${2:-/tmp/peer-venv/bin/python}
licenses=/usr/share/common-licenses
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# 2000 BPE pieces (ids 0 unk, 1 <s>, 2 </s>, as Llama's) from six licenses;
# the model's vocabulary stays 32000, the ids above 1999 simply unused.
# spm_train breaks some ties differently from run to run (neither one thread
# nor --random_seed made two runs' files equal), so the figures of a fine-tune
# move a little with each new tokenizer.
spm_train --input="$licenses/GPL-3,$licenses/GPL-2,$licenses/LGPL-2.1,$licenses/GFDL-1.3,$licenses/MPL-2.0,$licenses/Artistic" \
  --model_prefix="$tmp/tok" --vocab_size=2000 --model_type=bpe --character_coverage=1.0 \
  --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 --minloglevel=2
"$python" - "$out" <<'PY'
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                     num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                     max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
LlamaForCausalLM(config).float().save_pretrained(sys.argv[1])
PY
cp "$tmp/tok.model" "$out/tokenizer.model"
echo "wrote $out"
