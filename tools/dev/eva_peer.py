"""PEFT 0.21's EVA start over bitsandbytes' NF4 base, on the windows of an
llm.c token file in order: what `quanta finetune --model DIR --data FILE
--init-lora-weights eva` computes, for a side-by-side look (forward passes,
seconds, ranks). Run with the peer environment (../shared/peer/setup.sh)
from the repository root:

    /tmp/peer-venv/bin/python tools/dev/eva_peer.py MODEL_DIR TOKENS SEQ ROWS R ALPHA OUT [exact]

`exact` replaces PEFT's randomized SVD (a seed-42 sketch of torch's
generator) by torch.linalg.svd, as quanta's EvaData::svd_niter -1. Prints
one JSON line; OUT receives PEFT's adapter folder.
"""
import json
import sys
import time

import bitsandbytes as bnb
import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import EvaConfig
from peft.tuners.lora import eva as peft_eva
from peft.tuners.lora.eva import initialize_lora_eva_weights
from peft.utils.incremental_pca import IncrementalPCA
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

sys.path.insert(0, "tests/data/llm/qlora")
# bitsandbytes' native CPU dequantize takes the 64-blocks per row, wrong
# where K is not a multiple of 64 (the tiny models): the fixtures' script
# puts the flat layout in its place when imported.
import make_qlora_fixtures  # noqa: E402,F401

model_dir, tokens, seq, rows, r, alpha, out = sys.argv[1:8]
seq, rows, r, alpha = int(seq), int(rows), int(r), float(alpha)
if len(sys.argv) > 8 and sys.argv[8] == "exact":
    peft_eva.IncrementalPCA = lambda **kw: IncrementalPCA(**{**kw, "lowrank": False})
with open(tokens, "rb") as f:
    header = np.frombuffer(f.read(1024), dtype=np.int32)
    ids = np.frombuffer(f.read(), dtype=np.uint16 if header[1] == 1 else np.uint32).astype(np.int64)
windows = torch.from_numpy(ids[: len(ids) // seq * seq].reshape(-1, seq))
batches = [{"input_ids": windows[i:i + rows], "attention_mask": torch.ones_like(windows[i:i + rows]),
            "labels": windows[i:i + rows].clone()} for i in range(0, len(windows), rows)]
model = AutoModelForCausalLM.from_pretrained(
    model_dir, dtype=torch.float32, device_map="cpu",
    quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True,
                                           bnb_4bit_compute_dtype=torch.float32))
for m in model.modules():  # the flat layout, not the fused kernel
    if isinstance(m, bnb.nn.Linear4bit):
        m.support_avx512bf16_for_cpu = False
forwards = [0]
model.register_forward_pre_hook(lambda m, a, kw: forwards.__setitem__(0, forwards[0] + 1), with_kwargs=True)
pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear",
                                      task_type="CAUSAL_LM", init_lora_weights="eva",
                                      eva_config=EvaConfig()))
start = time.time()
initialize_lora_eva_weights(pm, batches, show_progress_bar=False)
seconds = time.time() - start
pm.save_pretrained(out)
with open(out + "/adapter_config.json") as f:
    config = json.load(f)
print(json.dumps({"windows": len(windows), "batches": len(batches), "forwards": forwards[0],
                  "seconds": round(seconds, 1), "rank_pattern": config["rank_pattern"],
                  "target_modules": config["target_modules"]}))
