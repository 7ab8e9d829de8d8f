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
each layer's start product B0 A0 is compared with PEFT's B A, and for the
layer where they differ most both with PEFT's algorithm run in f64 on PEFT's
covariance. Prints one JSON line.
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
                 corda_config=CordaConfig(corda_method=method, prune_temporary_fields=False))


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
    # That layer's start in f64 from PEFT's covariance (PEFT's damping and
    # decomposition, in f64): which side is nearer.
    m = pm.get_submodule(prefix + worst_layer)
    base = m.get_base_layer()
    c = base.covariance_matrix.double()
    w = base.weight.double() + m.scaling["default"] * (
        m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double())
    eye = torch.eye(c.shape[0], dtype=torch.float64)
    damp = 0.01
    while True:
        fixed = c + eye * c.diag().mean() * damp
        inv = torch.linalg.inv(fixed)
        if torch.dist(fixed @ inv, eye).item() < 0.05:
            break
        damp *= 2
    u, sv, vh = torch.linalg.svd(w @ fixed, full_matrices=False)
    v = (vh @ inv).T
    keep = slice(0, r) if method == "ipm" else slice(-r, None)
    exact = (u[:, keep] * sv[keep]) @ v[:, keep].T / m.scaling["default"]
    a0 = theirs[prefix + worst_layer + ".lora_A.weight"][r:].double()
    b0 = -theirs[prefix + worst_layer + ".lora_B.weight"][:, r:].double()
    mine = m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double()
    out["peft_vs_f64"] = ((mine - exact).abs().max() / exact.abs().max()).item()
    out["quanta_vs_f64"] = ((b0 @ a0 - exact).abs().max() / exact.abs().max()).item()
print(json.dumps(out))
