"""PEFT 0.21's CorDA start (preprocess_corda, then init_lora_weights "corda")
on the float model, over the first windows of an llm.c token file, one
forward pass each: what `quanta finetune --model DIR --data FILE
--init-lora-weights corda` computes, for a side-by-side look (seconds, and
with QUANTA_ADAPTERS the starts against quanta's). Run with the peer
environment (../shared/peer/setup.sh) from the repository root:

    /tmp/peer-venv/bin/python tools/dev/corda_peer.py MODEL_DIR TOKENS SEQ SAMPLES R ALPHA \
        METHOD [QUANTA_ADAPTERS]

METHOD is ipm or kpm. QUANTA_ADAPTERS is the adapters/ folder of a quanta
run with the same settings: quanta saves adapters started from CorDA
converted to LoRA ([B | -B0], [A; A0]), so the second half is the start, and
each layer's start product B0 A0 is compared with PEFT's B A. Prints one
JSON line.
"""
import json
import os
import sys
import time

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.config import CordaConfig
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

try:
    import attr  # noqa: F401
except ImportError:
    # PEFT's corda.py takes `dataclass` from attrs for one record; the peer
    # environment has no attrs (make_qlora_fixtures.py does the same).
    import dataclasses
    import types
    sys.modules["attr"] = types.SimpleNamespace(dataclass=dataclasses.dataclass)
from peft.tuners.lora.corda import preprocess_corda  # noqa: E402

model_dir, tokens, seq, samples, r, alpha, method = sys.argv[1:8]
quanta_adapters = sys.argv[8] if len(sys.argv) > 8 else None
seq, samples, r, alpha = int(seq), int(samples), int(r), float(alpha)
with open(tokens, "rb") as f:
    header = np.frombuffer(f.read(1024), dtype=np.int32)
    ids = np.frombuffer(f.read(), dtype=np.uint16 if header[1] == 1 else np.uint32).astype(np.int64)
windows = torch.from_numpy(ids[: len(ids) // seq * seq].reshape(-1, seq))[:samples]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu")
cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"],
                 task_type="CAUSAL_LM", init_lora_weights="corda",
                 corda_config=CordaConfig(corda_method=method))


@torch.no_grad()
def run_model():
    for w in windows:
        model(input_ids=w[None])


start = time.time()
preprocess_corda(model, cfg, run_model=run_model)
preprocess_s = time.time() - start
start = time.time()
pm = get_peft_model(model, cfg)
init_s = time.time() - start
out = {"samples": len(windows), "preprocess_seconds": round(preprocess_s, 1),
       "init_seconds": round(init_s, 1)}
if quanta_adapters:
    theirs = load_file(os.path.join(quanta_adapters, "adapter_model.safetensors"))
    worst, worst_layer = 0.0, ""
    prefix = "base_model.model."
    for name, m in pm.named_modules():
        if not hasattr(m, "lora_A") or "default" not in m.lora_A:
            continue
        key = prefix + name[len(prefix):] if name.startswith(prefix) else name
        a0 = theirs[key + ".lora_A.weight"][r:].double()
        b0 = -theirs[key + ".lora_B.weight"][:, r:].double()
        mine = (m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double())
        diff = ((b0 @ a0 - mine).abs().max() / mine.abs().max()).item()
        if diff > worst:
            worst, worst_layer = diff, key[len(prefix):]
    out["start_products_max_rel_diff"] = worst
    out["worst_layer"] = worst_layer
print(json.dumps(out))
