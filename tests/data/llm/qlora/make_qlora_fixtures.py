"""Writes what PEFT + bitsandbytes + transformers compute for QLoRA on the CPU
(NF4 base with double quantization, blocksize 64, LoRA adapters), for quanta's
QLoRA parity tests. Reads the tiny models in ../models (make_tiny_models.py).
Run from the repository root with the peer environment (../shared/peer/setup.sh):

    /tmp/peer-venv/bin/python tests/data/llm/qlora/make_qlora_fixtures.py tests/data/llm [PART...]

(PART: cases, quanta_written, transformers_4bit, loftq, residual_starts, eva, corda; all
when none is named;
case=NAME for one case, quanta_written=NAME for one folder.)

One folder per case in qlora/:

case.json            the settings (model, r, lora_alpha, target_modules, PEFT's
                     layer choice where given: exclude_modules, rank_pattern, ...),
                     "targeted": the modules with LoRA adapters ("ranks",
                     "scalings": each one's r and scaling), "quantized":
                     the modules bitsandbytes made Linear4bit (every Linear but
                     lm_head, targeted or not), both in model order
adapter_init/        adapter_config.json + adapter_model.safetensors as PEFT's
                     save_pretrained writes them before training (lora_A as PEFT
                     initialises it, lora_B = randn * 0.05), base_model_name_or_path
                     set to the model folder's name, target_modules sorted
nf4_base.safetensors each quantized module's state as bitsandbytes serializes it,
                     under the original module name: <m>.weight (U8 packed codes
                     [n*k/2, 1]), <m>.weight.absmax (U8), .quant_map (F32 [16]),
                     .nested_absmax (F32), .nested_quant_map (F32 [256]),
                     .quant_state.bitsandbytes__nf4 (U8 JSON), <m>.bias if any
expected.safetensors ids, labels [2, 12] (I64, labels -100 at [0, 0:3] and [1, 7]);
                     loss [], logits [2, 12, 64] (train mode), logits_eval (eval
                     mode, no_grad); grad.<adapter name> (the gradients of the
                     loss); updated.<adapter name> (after one AdamW step);
                     loss_after [] (train-mode loss after the step); floats all F32

transformers_4bit/   <model>/config.json + model.safetensors: llama_gqa,
                     qwen2_bias and gemma3_image_text (its vision tower
                     skipped) loaded in 4 bits and saved by transformers'
                     save_pretrained (the folder quanta's 4-bit save must equal);
                     gemma3_image_text_vision_4bit: the vision tower quantized
                     too (load_in_4bit's default);
                     llama_gqa_bf16_storage: llama_gqa with
                     bnb_4bit_quant_storage=bfloat16 (FSDP-QLoRA's setting: the
                     packed codes stored as BF16 [bytes / 2, 1])

loftq_*/             case.json + expected.safetensors: the adapters PEFT's
                     replace_lora_weights_loftq starts from (loftq_cases)
pissa_*/, olora_*/   case.json + expected.safetensors: PiSSA's and OLoRA's
                     starts, the residual bases they leave, logits, and
                     PEFT's conversion to LoRA (residual_start_cases)
eva_*/               data.jsonl + case.json + expected.safetensors: EVA's
                     start over that data, its ranks and the config PEFT
                     writes (eva_cases)
corda_*/             data.jsonl + case.json + expected.safetensors: CorDA's
                     covariances over those samples, its starts and the
                     residual bases they leave (corda_cases)

quanta_written*/     adapters/ as quanta finetune writes them (QUANTA_WRITTEN:
                     all-linear; PEFT's layer choice by lists, by regexes;
                     modules trained whole; DoRA) and
                     peft_logits.safetensors, what PEFT computes with them: the
                     folders PEFT loads

Two of bitsandbytes' CPU kernels are set aside. Its native dequantize_4bit
takes the 64-blocks per row (absmax[row * (K // 64) + col // 64]) while
quantize_4bit and the CUDA kernels take them over the flattened weight
(absmax[(row * K + col) // 64]); the two differ when K is not a multiple of
64, as here (K = 32, 48). dequantize_4bit is replaced by the flat layout, the
one the serialized state means: code[q] * absmax in f32, then rounded to the
compute dtype. The fused AVX512-BF16 kernel (eval mode, on CPUs that have it)
is switched off so that logits_eval does not depend on the machine.
"""
import json
import os
import shutil
import sys
import warnings
from math import prod

import bitsandbytes as bnb
import peft
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

CASES = {
    "llama_gqa_all": dict(model="llama_gqa", r=4, lora_alpha=8, target_modules="all-linear",
                          use_rslora=False, dtype=torch.float32, n_targeted=14),
    "qwen2_qv_rslora": dict(model="qwen2_bias", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                            use_rslora=True, dtype=torch.float32, n_targeted=4),
    "llama_bf16_all": dict(model="llama_bf16", r=4, lora_alpha=8, target_modules="all-linear",
                           use_rslora=False, dtype=torch.bfloat16, n_targeted=14),
    # PEFT's layer choice: a regex, an exclusion, per-layer r and alpha (the
    # first matching key wins: layer 1's q_proj gets 6, layer 0's 2).
    "llama_gqa_regex_patterns": dict(
        model="llama_gqa", r=4, lora_alpha=8, target_modules=r".*\.(q_proj|v_proj|down_proj)",
        use_rslora=False, dtype=torch.float32, n_targeted=5,
        choice=dict(exclude_modules=["layers.0.mlp.down_proj"],
                    rank_pattern={"layers.1.self_attn.q_proj": 6, "q_proj": 2},
                    alpha_pattern={"down_proj": 3})),
    "qwen2_layers_rslora": dict(
        model="qwen2_bias", r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"],
        use_rslora=True, dtype=torch.float32, n_targeted=3,
        choice=dict(layers_to_transform=[1], layers_pattern="layers", rank_pattern={"up_proj": 3})),
    # Embeddings and lm_head trained whole beside the adapters.
    "llama_gqa_saved": dict(
        model="llama_gqa", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=False,
        dtype=torch.float32, n_targeted=4, choice=dict(modules_to_save=["embed_tokens", "lm_head"])),
    # DoRA: a magnitude per output row over the adapted weight's direction;
    # qwen2's q, k and v biases take the path that subtracts the bias.
    "qwen2_dora": dict(model="qwen2_bias", r=4, lora_alpha=8, target_modules="all-linear",
                       use_rslora=False, dtype=torch.float32, n_targeted=14, choice=dict(use_dora=True)),
    "llama_bf16_dora": dict(model="llama_bf16", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                            use_rslora=False, dtype=torch.bfloat16, n_targeted=6, choice=dict(use_dora=True)),
    # Biases trained beside the adapters: bias="all" trains qwen2's q, k and
    # v biases, adapted (q_proj, saved as base_layer.bias) or not (k, v);
    # lora_only those of the adapted layers, with lora_bias's bias on B.
    "qwen2_bias_all": dict(model="qwen2_bias", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"],
                           use_rslora=False, dtype=torch.float32, n_targeted=6, n_biases=6,
                           choice=dict(bias="all")),
    "qwen2_lora_only_lora_bias": dict(model="qwen2_bias", r=4, lora_alpha=8, target_modules="all-linear",
                                      use_rslora=True, dtype=torch.float32, n_targeted=14, n_biases=6,
                                      choice=dict(bias="lora_only", lora_bias=True)),
    "llama_bf16_lora_bias": dict(model="llama_bf16", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                 use_rslora=False, dtype=torch.bfloat16, n_targeted=6,
                                 choice=dict(lora_bias=True)),
    # DoRA over trained biases: y + (k - 1)(y - bias) passes the bias's
    # gradient through both terms.
    "qwen2_dora_bias": dict(model="qwen2_bias", r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                            use_rslora=False, dtype=torch.float32, n_targeted=6, n_biases=6,
                            choice=dict(use_dora=True, bias="lora_only")),
    # Token rows trained beside the adapters (trainable_token_indices): the
    # input embeddings' (list form); a tied model's, which its output layer
    # shares; the embeddings' and the untied output layer's (object form).
    "llama_gqa_tokens": dict(model="llama_gqa", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             use_rslora=False, dtype=torch.float32, n_targeted=4, n_tokens=1,
                             choice=dict(trainable_token_indices=[2, 25, 60])),
    "llama_tied_tokens": dict(model="llama_tied_llama3", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                              use_rslora=False, dtype=torch.float32, n_targeted=4, n_tokens=1,
                              choice=dict(trainable_token_indices=[2, 5, 27])),
    "llama_gqa_tokens_head": dict(model="llama_gqa", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                  use_rslora=False, dtype=torch.float32, n_targeted=4, n_tokens=2,
                                  choice=dict(trainable_token_indices={"embed_tokens": [7, 40], "lm_head": [5, 9]})),
    # Qwen3: adapters beside the per-head q and k norms (which stay in the
    # model's dtype, frozen), then those norms trained whole (modules_to_save).
    "qwen3_all": dict(model="qwen3_qk_norm", r=4, lora_alpha=8, target_modules="all-linear",
                      use_rslora=False, dtype=torch.float32, n_targeted=14),
    "qwen3_qk_norm_saved": dict(model="qwen3_qk_norm", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                use_rslora=False, dtype=torch.float32, n_targeted=4, n_saved=4,
                                choice=dict(modules_to_save=["q_norm", "k_norm"])),
    "qwen3_bf16_all": dict(model="qwen3_bf16", r=4, lora_alpha=8, target_modules="all-linear",
                           use_rslora=False, dtype=torch.bfloat16, n_targeted=14),
    # Gemma: GeGLU and norms of 1 + weight under the adapters; Gemma 2 with
    # soft-capped scores and logits and four norms a layer, those after the
    # MLP trained whole beside the adapters.
    "gemma_all": dict(model="gemma_geglu", r=4, lora_alpha=8, target_modules="all-linear",
                      use_rslora=False, dtype=torch.float32, n_targeted=14),
    "gemma2_all": dict(model="gemma2_softcap", r=4, lora_alpha=8, target_modules="all-linear",
                       use_rslora=False, dtype=torch.float32, n_targeted=14),
    "gemma2_norms_saved": dict(model="gemma2_softcap", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                               use_rslora=False, dtype=torch.float32, n_targeted=4, n_saved=4,
                               choice=dict(modules_to_save=["pre_feedforward_layernorm",
                                                            "post_feedforward_layernorm"])),
    "gemma2_bf16_all": dict(model="gemma2_bf16", r=4, lora_alpha=8, target_modules="all-linear",
                            use_rslora=False, dtype=torch.bfloat16, n_targeted=14),
    # Gemma 3: q and k norms of 1 + weight, a sliding window shorter than the
    # 12 tokens, each layer type with its RoPE; the q and k norms trained
    # whole in the second case.
    "gemma3_all": dict(model="gemma3_text", r=4, lora_alpha=8, target_modules="all-linear",
                       use_rslora=False, dtype=torch.float32, n_targeted=14),
    "gemma3_qk_norm_saved": dict(model="gemma3_text", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 use_rslora=False, dtype=torch.float32, n_targeted=4, n_saved=4,
                                 choice=dict(modules_to_save=["q_norm", "k_norm"])),
    "gemma3_bf16_all": dict(model="gemma3_bf16", r=4, lora_alpha=8, target_modules="all-linear",
                            use_rslora=False, dtype=torch.bfloat16, n_targeted=14),
    # Gemma 3's image-text model as users fine-tune it on text: bitsandbytes
    # quantizes the vision tower too and PEFT's all-linear adapts it too
    # (adapters text never reaches: no gradient, no step); case.json's
    # "quantized" and "targeted" are the decoder's, "vision_targeted" the
    # rest's.
    "gemma3_image_text_all": dict(model="gemma3_image_text", r=4, lora_alpha=8, target_modules="all-linear",
                                  use_rslora=False, dtype=torch.float32, n_targeted=14),
    # Phi-3: the fused qkv_proj and gate_up_proj quantized and adapted whole
    # (four linear layers a layer), over a window; Phi-4-mini's RoPE (partial,
    # longrope's long factors over the 12 tokens) with q, k and v's adapter
    # alone.
    "phi3_all": dict(model="phi3_fused", r=4, lora_alpha=8, target_modules="all-linear",
                     use_rslora=False, dtype=torch.float32, n_targeted=8, n_quantized=8),
    "phi3_longrope_qkv": dict(model="phi3_longrope", r=4, lora_alpha=8, target_modules=["qkv_proj"],
                              use_rslora=False, dtype=torch.float32, n_targeted=2, n_quantized=8),
    # OLMo 2: norms after each block, q and k normalized over all heads; its
    # q and k norms trained whole beside all-linear adapters, in bf16 too.
    "olmo2_qk_norm_saved": dict(model="olmo2_post_norms", r=4, lora_alpha=8, target_modules="all-linear",
                                use_rslora=False, dtype=torch.float32, n_targeted=14, n_saved=4,
                                choice=dict(modules_to_save=["q_norm", "k_norm"])),
    "olmo2_bf16_all": dict(model="olmo2_bf16", r=4, lora_alpha=8, target_modules="all-linear",
                           use_rslora=False, dtype=torch.bfloat16, n_targeted=14),
    # SmolLM3: a layer without RoPE that slides; OLMo 3: OLMo 2's norms, a
    # sliding layer and a full one with YaRN, from a 4.x-named config.
    "smollm3_all": dict(model="smollm3_nope", r=4, lora_alpha=8, target_modules="all-linear",
                        use_rslora=False, dtype=torch.float32, n_targeted=14),
    "olmo3_all": dict(model="olmo3_window", r=4, lora_alpha=8, target_modules="all-linear",
                      use_rslora=False, dtype=torch.float32, n_targeted=14),
    # EXAONE 4: post-block norms, per-head q and k norms, a full layer without RoPE.
    "exaone4_all": dict(model="exaone4_window", r=4, lora_alpha=8, target_modules="all-linear",
                        use_rslora=False, dtype=torch.float32, n_targeted=14),
    # Granite: its scalings, the logits' divisor inside the loss's gradient.
    "granite_all": dict(model="granite_multipliers", r=4, lora_alpha=8, target_modules="all-linear",
                        use_rslora=False, dtype=torch.float32, n_targeted=14),
}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
# One metadata key: safetensors writes several in a random order.
VERSIONS = (f"torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}, bitsandbytes {bnb.__version__}")
QUANT_KEYS = ["weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
              "weight.nested_quant_map", "weight.quant_state.bitsandbytes__nf4"]


def dequantize_4bit_flat(A, absmax, blocksize, quant_type, shape, dtype):
    assert prod(shape) % blocksize == 0
    packed = A.view(torch.uint8).reshape(-1)
    q = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()  # high nibble first
    code = bnb.functional.get_4bit_type(quant_type, device="cpu")
    return (code[q].view(-1, blocksize) * absmax.float().view(-1, 1)).reshape(shape).to(dtype)


with warnings.catch_warnings():  # "Overriding a previously registered kernel"
    warnings.simplefilter("ignore")
    torch.library.register_kernel("bitsandbytes::dequantize_4bit", "cpu", dequantize_4bit_flat)


def run_case(root, name, c, seed):
    out_dir = os.path.join(root, "qlora", name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    dtype = c["dtype"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(root, "models", c["model"]), dtype=dtype, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype))
    # An image-text model's decoder is model.language_model; the rest is
    # its vision tower, quantized too, and never reached by text.
    image_text = "image_text" in c["model"]

    def decoder(n):
        return not image_text or n.startswith(("model.language_model.", "lm_head"))

    all_quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    quantized = [n for n in all_quantized if decoder(n)]
    assert len(quantized) == c.get("n_quantized", 14), quantized
    assert len(all_quantized) > len(quantized) if image_text else len(all_quantized) == len(quantized)
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit) and model.lm_head.weight.dtype == dtype
    for n, p in model.named_parameters():  # embeddings, norms, lm_head stay in the model dtype
        if decoder(n) and not any(n.startswith(q + ".") for q in quantized):
            assert p.dtype == dtype and ("embed" in n or "norm" in n or n.startswith("lm_head")), (n, p.dtype)
    for n in all_quantized:
        m = model.get_submodule(n)
        assert m.weight.dtype == torch.uint8 and m.weight.quant_state.nested
        assert m.weight.quant_state.blocksize == 64 and m.weight.quant_state.quant_type == "nf4"
        m.support_avx512bf16_for_cpu = False

    choice = {"bias": "none", **c.get("choice", {})}
    cfg = LoraConfig(r=c["r"], lora_alpha=c["lora_alpha"], lora_dropout=0.0, target_modules=c["target_modules"],
                     use_rslora=c["use_rslora"], task_type="CAUSAL_LM", **choice)
    torch.manual_seed(seed + 1)
    pm = get_peft_model(model, cfg)
    prefix = "base_model.model."
    all_targeted = [n[len(prefix):] for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    targeted = [n for n in all_targeted if decoder(n)]
    vision_targeted = [n for n in all_targeted if not decoder(n)]
    assert len(targeted) == c["n_targeted"] and "lm_head" not in targeted, targeted
    assert bool(vision_targeted) == image_text, vision_targeted
    all_trainable = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    trainable = [(n, p) for n, p in all_trainable if decoder(n[len(prefix):])]
    saved_modules = c.get("choice", {}).get("modules_to_save", [])
    # A, B (and the magnitude, or B's bias)
    per_layer = 2 + bool(choice.get("use_dora")) + bool(choice.get("lora_bias"))
    # (n_saved: the trained modules' count where a name matches one per layer)
    assert len(trainable) == (per_layer * len(targeted) + c.get("n_saved", len(saved_modules)) + c.get("n_biases", 0)
                              + c.get("n_tokens", 0)), [n for n, _ in trainable]
    assert all(".lora_" in n or ".modules_to_save." in n or n.endswith(".bias") or ".token_adapter." in n
               for n, _ in trainable)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for n, p in trainable:
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif ".lora_magnitude_vector." in n:  # away from the rows' norms
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif ".trainable_tokens_delta." in n:  # away from the rows they replace
                p.add_(0.05 * torch.randn(p.shape, generator=g))

    # Initial adapters, as PEFT saves them.
    adapter_dir = os.path.join(out_dir, "adapter_init")
    pm.save_pretrained(adapter_dir)
    for f in os.listdir(adapter_dir):  # keep only what a loader reads (not the model card)
        if f not in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(adapter_dir, f))
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        acfg = json.load(f)
    acfg["base_model_name_or_path"] = c["model"]
    if isinstance(acfg["target_modules"], list):
        acfg["target_modules"] = sorted(acfg["target_modules"])  # a set, saved in hash order
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(acfg, f, indent=2, sort_keys=True)
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
        saved = {k for k in f.keys() if decoder(k[len(prefix):])}
    # PEFT saves a module trained whole under the module's own name.
    # and DoRA's magnitude as "<layer>.lora_magnitude_vector", without ".weight".
    saved_name = {n: n.replace(".modules_to_save.default.", ".")
                  .replace(".lora_magnitude_vector.default.weight", ".lora_magnitude_vector")
                  .replace(".default.", ".").removesuffix(".default") for n, _ in trainable}
    assert set(saved_name.values()) == saved, (sorted(saved), sorted(saved_name.values()))

    # NF4 bases, bitsandbytes' serialization under the original module names.
    base = {}
    for n in quantized:
        peft_name = prefix + n + (".base_layer" if n in targeted else "")
        for k, v in pm.get_submodule(peft_name).state_dict().items():
            base[f"{n}.{k}"] = v.detach().clone().contiguous()
    base_path = os.path.join(out_dir, "nf4_base.safetensors")
    save_file(base, base_path, metadata={"versions": VERSIONS})
    with safe_open(base_path, "pt") as f:
        back = {k: f.get_tensor(k) for k in f.keys()}
    for n in quantized:
        for k, dt in zip(QUANT_KEYS, [torch.uint8, torch.uint8, torch.float32, torch.float32, torch.float32,
                                      torch.uint8]):
            assert back[f"{n}.{k}"].dtype == dt, (n, k)
        qs = json.loads(bytes(back[f"{n}.weight.quant_state.bitsandbytes__nf4"].tolist()))
        assert qs["quant_type"] == "nf4" and qs["blocksize"] == 64 and qs["nested_blocksize"] == 256, qs
        if pm.get_submodule(prefix + n + (".base_layer" if n in targeted else "")).bias is not None:
            assert back[f"{n}.bias"].dtype == dtype
    assert set(back) == set(base)

    # Inputs.
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed + 3))
    labels = ids.clone()
    labels[0, 0:3] = -100
    labels[1, 7] = -100

    pm.eval()
    with torch.no_grad():
        logits_eval = pm(input_ids=ids, labels=labels).logits.float()
    pm.train()
    out = pm(input_ids=ids, labels=labels)
    loss = out.loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in trainable}
    for n, gr in grads.items():
        assert torch.isfinite(gr).all() and (".lora_B." in n or gr.abs().max() > 0), n
    assert all(p.grad is None for n, p in all_trainable if not decoder(n[len(prefix):]))
    opt = torch.optim.AdamW([p for _, p in trainable], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    opt.step()
    loss_after = pm(input_ids=ids, labels=labels).loss
    assert torch.isfinite(loss_after)

    exp = {"ids": ids, "labels": labels, "loss": loss.detach().float().reshape(()),
           "logits": out.logits.detach().float(), "logits_eval": logits_eval,
           "loss_after": loss_after.detach().float().reshape(())}
    for n, p in trainable:
        exp["grad." + saved_name[n]] = grads[n]
        exp["updated." + saved_name[n]] = p.detach().float()
    save_file({k: v.contiguous() for k, v in exp.items()}, os.path.join(out_dir, "expected.safetensors"),
              metadata={"versions": VERSIONS})

    settings = {"model": c["model"], "r": c["r"], "lora_alpha": c["lora_alpha"], "lora_dropout": 0.0,
                "target_modules": c["target_modules"], "use_rslora": c["use_rslora"],
                "compute_dtype": str(dtype).removeprefix("torch."), "lr": LR, "weight_decay": WEIGHT_DECAY,
                "betas": list(BETAS), "eps": EPS, "targeted": targeted, "quantized": quantized,
                "ranks": {n: pm.get_submodule(prefix + n).r["default"] for n in targeted},
                "scalings": {n: pm.get_submodule(prefix + n).scaling["default"] for n in targeted},
                **({"vision_targeted": vision_targeted} if image_text else {}),
                **c.get("choice", {})}
    with open(os.path.join(out_dir, "case.json"), "w") as f:
        json.dump(settings, f, indent=2)
        f.write("\n")
    print(name, "loss", loss.item(), "loss_after", loss_after.item(), "targeted", len(targeted))


# quanta_written*/adapters, made by `quanta finetune --model models/llama_gqa
# --data TOKENS --seq-len 64 --steps 20 --batch-size 8 --lr 1e-2 --lora-r 4`
# with these flags (TOKENS: 64 JSONL lines of 64 ids below 64), their
# base_model_name_or_path set to llama_gqa (QUANTA_WRITTEN_MODEL names
# another model where one is used).
QUANTA_WRITTEN = {
    "quanta_written": "",
    "quanta_written_choice": "--target-modules q_proj,v_proj,down_proj --exclude-modules "
                             "layers.0.mlp.down_proj --layers-to-transform 0,1 --layers-pattern layers "
                             "--rank-pattern 'v_proj|layers\\.1\\.self_attn\\.q_proj=6' --rank-pattern q_proj=2 "
                             "--alpha-pattern down_proj=3",
    "quanta_written_regex": "--target-modules-regex '.*\\.(q_proj|k_proj|up_proj|down_proj)' "
                            "--exclude-modules-regex '.*layers\\.1\\.mlp\\..*' --use-rslora "
                            "--rank-pattern k_proj=3 --alpha-pattern up_proj=5",
    "quanta_written_saved": "--target-modules q_proj,v_proj --modules-to-save embed_tokens,lm_head",
    "quanta_written_dora": "--use-dora",
    # Over qwen2_bias (QUANTA_WRITTEN_MODEL): q, k and v biases trained.
    "quanta_written_bias": "--target-modules q_proj,o_proj --bias all --lora-bias",
    "quanta_written_tokens": "--target-modules q_proj,v_proj --trainable-token-indices embed_tokens=2,25,60 "
                             "--trainable-token-indices lm_head=5,9",
    # Over qwen3_qk_norm: every linear layer adapted, the per-head q and k
    # norms trained whole.
    "quanta_written_qwen3": "--modules-to-save q_norm,k_norm",
    # Over gemma2_softcap: every linear layer adapted, the norms before and
    # after each MLP trained whole.
    "quanta_written_gemma2": "--modules-to-save pre_feedforward_layernorm,post_feedforward_layernorm",
    # Over gemma3_image_text: every linear layer of the decoder adapted, none
    # of the vision tower's (which PEFT's all-linear alone would reach).
    "quanta_written_gemma3_image_text": "",
    # Over phi3_longrope: the fused qkv_proj and gate_up_proj adapted whole,
    # with Phi-4-mini's partial rotary and longrope (sequences of 64 over an
    # original length of 8).
    "quanta_written_phi3": "",
    # PiSSA's start, saved converted to LoRA of rank 8 over the original
    # weight: PEFT reads it as plain LoRA over bitsandbytes' NF4(W).
    "quanta_written_pissa": "--init-lora-weights pissa",
    # EVA's start: ranks 2-5 by layer (rank_pattern, alpha_pattern) and
    # target_modules the layers by full name, init_lora_weights "eva".
    "quanta_written_eva": "--init-lora-weights eva",
}
QUANTA_WRITTEN_MODEL = {"quanta_written_bias": "qwen2_bias", "quanta_written_qwen3": "qwen3_qk_norm",
                        "quanta_written_gemma2": "gemma2_softcap",
                        "quanta_written_gemma3_image_text": "gemma3_image_text",
                        "quanta_written_phi3": "phi3_longrope"}


def check_quanta_adapters(root, names=()):
    """PEFT's logits with each adapter folder quanta wrote (QUANTA_WRITTEN),
    over bitsandbytes' base, in eval mode: <case>/peft_logits.safetensors
    (ids, logits). quanta_written_choice's rank_pattern is in an order other
    than sorted, and its first key must win for layer 1's q_proj (r 6)."""
    from peft import PeftModel
    for name in names or QUANTA_WRITTEN:
        case = os.path.join(root, "qlora", name)
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(root, "models", QUANTA_WRITTEN_MODEL.get(name, "llama_gqa")), dtype=torch.float32,
            device_map="cpu",
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.float32))
        for m in model.modules():  # as in run_case: the flat layout, not the fused kernel
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = False
        peft_model = PeftModel.from_pretrained(model, os.path.join(case, "adapters")).eval()
        ranks = {n.removeprefix("base_model.model."): m.r["default"] for n, m in peft_model.named_modules()
                 if isinstance(m, peft.tuners.lora.LoraLayer)}
        if name == "quanta_written_choice":
            assert ranks == {"model.layers.0.self_attn.q_proj": 2, "model.layers.0.self_attn.v_proj": 6,
                             "model.layers.1.self_attn.q_proj": 6, "model.layers.1.self_attn.v_proj": 6,
                             "model.layers.1.mlp.down_proj": 4}, ranks
        ids = torch.tensor([[5, 12, 19, 26, 33, 40, 47, 54, 1, 8, 15, 22],
                            [3, 10, 17, 24, 31, 38, 45, 52, 59, 6, 13, 20]])
        with torch.no_grad():
            logits = peft_model(input_ids=ids).logits.float()
        save_file({"ids": ids, "logits": logits.contiguous()},
                  os.path.join(case, "peft_logits.safetensors"), metadata={"versions": VERSIONS})
        if name == "quanta_written_pissa":
            assert set(ranks.values()) == {8}, ranks
        if name == "quanta_written_eva":
            assert len(ranks) == 14 and set(ranks.values()) != {4}, ranks
        if name == "quanta_written_tokens":
            assert peft_model.base_model.model.lm_head.token_adapter.token_indices["default"] == [5, 9]
        if name == "quanta_written_bias":
            assert all(m.lora_bias["default"] for m in peft_model.modules()
                       if isinstance(m, peft.tuners.lora.LoraLayer))
        if name == "quanta_written_qwen3":  # both norms of both layers trained whole
            saved = [n for n, m in peft_model.named_modules() if isinstance(m, peft.utils.ModulesToSaveWrapper)]
            assert len(saved) == 4 and all(n.endswith(("q_norm", "k_norm")) for n in saved), saved
        if name == "quanta_written_gemma2":  # both feedforward norms of both layers trained whole
            saved = [n for n, m in peft_model.named_modules() if isinstance(m, peft.utils.ModulesToSaveWrapper)]
            assert len(saved) == 4 and all(n.endswith("feedforward_layernorm") for n in saved), saved
        if name == "quanta_written_gemma3_image_text":  # the decoder's 14 layers, no vision layer
            assert len(ranks) == 14 and all(n.startswith("model.language_model.") for n in ranks), ranks
        if name == "quanta_written_phi3":  # the fused layers adapted as they are
            assert len(ranks) == 8 and any(n.endswith("qkv_proj") for n in ranks), ranks
        if name == "quanta_written_dora":
            assert all(m.lora_magnitude_vector for m in peft_model.modules()
                       if isinstance(m, peft.tuners.lora.LoraLayer))
        print(name + ": PEFT adapted", ranks)


def save_transformers_4bit(root):
    """The tiny f32 folders loaded with load_in_4bit (NF4, double quant,
    compute float32) and saved again by save_pretrained: the 4-bit checkpoint
    transformers writes and loads, config.json with its quantization_config
    and model.safetensors (transformers_4bit/<model>/)."""
    # gemma3_image_text: its vision tower and projector skipped (left in
    # f32), the folder quanta's quantize writes; gemma3_image_text_vision_4bit:
    # load_in_4bit's default, which quantizes them too.
    vision = ["model.vision_tower", "model.multi_modal_projector", "lm_head"]
    for name, model_name, storage, skip in [("llama_gqa", "llama_gqa", torch.uint8, None),
                                            ("qwen2_bias", "qwen2_bias", torch.uint8, None),
                                            ("llama_gqa_bf16_storage", "llama_gqa", torch.bfloat16, None),
                                            ("gemma3_image_text", "gemma3_image_text", torch.uint8, vision),
                                            ("gemma3_image_text_vision_4bit", "gemma3_image_text", torch.uint8,
                                             None)]:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(root, "models", model_name), dtype=torch.float32, device_map="cpu",
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.float32,
                                                   bnb_4bit_quant_storage=storage,
                                                   llm_int8_skip_modules=skip))
        out = os.path.join(root, "qlora", "transformers_4bit", name)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        os.remove(os.path.join(out, "generation_config.json"))
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            print("transformers_4bit:", name, len(list(f.keys())), "tensors")


# LoftQ's start (PEFT's replace_lora_weights_loftq over the bitsandbytes
# model, reading the float weights from the model folder): lora_alpha = r,
# the scaling of 1 PEFT's LoftQ assumes (quanta divides by the scaling).
def write_case(out_dir, exp, settings):
    """A start case's expected.safetensors (the tensors of `exp`, with the
    library versions) and case.json (`settings`)."""
    save_file({k: v.contiguous() for k, v in exp.items()}, os.path.join(out_dir, "expected.safetensors"),
              metadata={"versions": VERSIONS})
    with open(os.path.join(out_dir, "case.json"), "w") as f:
        json.dump(settings, f, indent=2)
        f.write("\n")


LOFTQ_CASES = {"loftq_llama_gqa": dict(model="llama_gqa", r=4, dtype=torch.float32),
               "loftq_llama_bf16": dict(model="llama_bf16", r=4, dtype=torch.bfloat16)}


def load_4bit(model_dir, dtype):
    """The model in model_dir loaded in 4 bits (NF4, double quantization,
    compute in dtype) with the fused AVX512-BF16 kernel off, as in run_case."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True,
                                               bnb_4bit_compute_dtype=dtype))
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def loftq_on_cpu(fn):
    """Runs fn with Tensor.to(device="cuda") kept on the CPU: PEFT's
    _loftq_init_new names a GPU for its SVD; the arithmetic is the same."""
    to = torch.Tensor.to

    def cpu_to(self, *args, **kwargs):
        if kwargs.get("device") in ("cuda", "xpu"):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    torch.Tensor.to = cpu_to
    try:
        return fn()
    finally:
        torch.Tensor.to = to


def loftq_cases(root):
    """qlora/<case>/: case.json (model, r, lora_alpha, targeted) and
    expected.safetensors: "<layer>.lora_A.weight" and ".lora_B.weight" as
    replace_lora_weights_loftq sets them (f32), the squared Frobenius norm
    of each layer's quantization error before ("<layer>.error_before") and
    after ("<layer>.error_after", of W - Q - B A), and ids [2, 12] with the
    eval-mode logits over them."""
    from peft import replace_lora_weights_loftq
    for i, (name, c) in enumerate(LOFTQ_CASES.items()):
        out_dir = os.path.join(root, "qlora", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        model_dir = os.path.join(root, "models", c["model"])
        dtype = c["dtype"]
        model = load_4bit(model_dir, dtype)
        torch.manual_seed(900 + i)
        pm = get_peft_model(model, LoraConfig(r=c["r"], lora_alpha=c["r"], lora_dropout=0.0,
                                              target_modules="all-linear", task_type="CAUSAL_LM"))
        loftq_on_cpu(lambda: replace_lora_weights_loftq(pm, model_path=model_dir))
        prefix = "base_model.model."
        exp = {}
        targeted = []
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            for n, m in pm.named_modules():
                if not isinstance(m, peft.tuners.lora.Linear4bit):
                    continue
                layer = n[len(prefix):]
                targeted.append(layer)
                a = m.lora_A["default"].weight.detach().float()
                b = m.lora_B["default"].weight.detach().float()
                assert m.scaling["default"] == 1.0
                w = f.get_tensor(layer + ".weight").float()
                q = bnb.functional.dequantize_4bit(m.base_layer.weight.data,
                                                   m.base_layer.weight.quant_state).float()
                exp[layer + ".lora_A.weight"] = a
                exp[layer + ".lora_B.weight"] = b
                exp[layer + ".error_before"] = ((w - q) ** 2).sum().reshape(())
                exp[layer + ".error_after"] = ((w - q - b @ a) ** 2).sum().reshape(())
                assert exp[layer + ".error_after"] < exp[layer + ".error_before"], layer
        assert len(targeted) == 14, targeted
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(950 + i))
        pm.eval()
        with torch.no_grad():
            exp["logits_eval"] = pm(input_ids=ids).logits.float()
        exp["ids"] = ids
        write_case(out_dir, exp, {"model": c["model"], "r": c["r"], "lora_alpha": c["r"],
                                  "target_modules": "all-linear",
                                  "compute_dtype": str(dtype).removeprefix("torch."),
                                  "targeted": targeted})
        before = sum(exp[t + ".error_before"].item() for t in targeted)
        after = sum(exp[t + ".error_after"].item() for t in targeted)
        print(name, "quantization error (sum of squares)", before, "->", after)


# PiSSA's and OLoRA's starts (PEFT's init_lora_weights "pissa" and "olora"),
# r 4 and lora_alpha 8 (scaling 2, which PiSSA divides out and OLoRA does
# not). PiSSA as PEFT's recipe for a 4-bit base runs it
# (examples/pissa_finetuning: PEFT refuses it over a quantized layer): the
# start on the float model, the residual model saved in its dtype and loaded
# in 4 bits, the start's adapters loaded over it. OLoRA directly over the
# bitsandbytes model, whose layers it dequantizes, decomposes and quantizes
# again.
RESIDUAL_CASES = {"pissa_llama_gqa": dict(model="llama_gqa", init="pissa", dtype=torch.float32),
                  "pissa_llama_bf16": dict(model="llama_bf16", init="pissa", dtype=torch.bfloat16),
                  "olora_llama_gqa": dict(model="llama_gqa", init="olora", dtype=torch.float32),
                  "olora_llama_bf16": dict(model="llama_bf16", init="olora", dtype=torch.bfloat16)}


def residual_model_in_4bit(pm, tmp, dtype):
    """PEFT's recipe for a start taken out of a float model over a 4-bit
    base: the start saved as plain adapters, the residual model saved in its
    dtype, loaded in 4 bits, the start's adapters loaded over it (in tmp)."""
    from peft import PeftModel
    pm.peft_config["default"].init_lora_weights = True
    pm.save_pretrained(os.path.join(tmp, "start"))
    pm.unload().save_pretrained(os.path.join(tmp, "residual"))
    model = load_4bit(os.path.join(tmp, "residual"), dtype)
    return PeftModel.from_pretrained(model, os.path.join(tmp, "start"), is_trainable=True)


def starts_and_bases(pm, prefix="base_model.model."):
    """Each Linear4bit's start "<layer>.lora_A.weight", ".lora_B.weight"
    (f32) and its base as bitsandbytes serializes it, and the layers in
    model order."""
    exp = {}
    targeted = []
    for n, m in pm.named_modules():
        if not isinstance(m, peft.tuners.lora.Linear4bit):
            continue
        layer = n[len(prefix):]
        targeted.append(layer)
        exp[layer + ".lora_A.weight"] = m.lora_A["default"].weight.detach().float().clone()
        exp[layer + ".lora_B.weight"] = m.lora_B["default"].weight.detach().float().clone()
        for k, v in m.base_layer.state_dict().items():
            exp[f"{layer}.{k}"] = v.detach().clone()
    return exp, targeted


def residual_start_cases(root):
    """qlora/<case>/: case.json (model, init, r, lora_alpha, compute_dtype,
    targeted) and expected.safetensors: each adapted layer's start
    "<layer>.lora_A.weight" and ".lora_B.weight" (f32), its base as
    bitsandbytes serializes it ("<layer>.weight", ".weight.absmax", ...), ids
    [2, 12] with the eval-mode logits. pissa_llama_gqa also holds PEFT's
    conversion to LoRA (save_pretrained with
    path_initial_model_for_weight_conversion) of adapters moved from the start
    ("trained.<layer>.lora_A.weight", ...; "converted.<PEFT's name>") and
    case.json its config's r and lora_alpha."""
    import tempfile
    prefix = "base_model.model."
    for i, (name, c) in enumerate(RESIDUAL_CASES.items()):
        out_dir = os.path.join(root, "qlora", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        model_dir = os.path.join(root, "models", c["model"])
        dtype = c["dtype"]
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                         task_type="CAUSAL_LM", init_lora_weights=c["init"])
        tmp = tempfile.mkdtemp()
        if c["init"] == "pissa":
            float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="cpu")
            pm = residual_model_in_4bit(get_peft_model(float_model, cfg), tmp, dtype)
        else:
            pm = get_peft_model(load_4bit(model_dir, dtype), cfg)
        exp, targeted = starts_and_bases(pm, prefix)
        assert all(m.scaling["default"] == 2.0 for m in pm.modules()
                   if isinstance(m, peft.tuners.lora.Linear4bit))
        assert len(targeted) == 14, targeted
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(970 + i))
        pm.eval()
        with torch.no_grad():
            exp["logits_eval"] = pm(input_ids=ids).logits.float()
        exp["ids"] = ids
        settings = {"model": c["model"], "init": c["init"], "r": 4, "lora_alpha": 8,
                    "compute_dtype": str(dtype).removeprefix("torch."), "targeted": targeted}
        if name == "pissa_llama_gqa":
            # Adapters moved from the start as training would, then PEFT's
            # conversion against the start saved above.
            g = torch.Generator().manual_seed(990)
            with torch.no_grad():
                for n, p in pm.named_parameters():
                    if ".lora_A." in n or ".lora_B." in n:
                        p.add_(0.01 * torch.randn(p.shape, generator=g))
            for layer in targeted:
                m = pm.get_submodule(prefix + layer)
                exp["trained." + layer + ".lora_A.weight"] = m.lora_A["default"].weight.detach().float().clone()
                exp["trained." + layer + ".lora_B.weight"] = m.lora_B["default"].weight.detach().float().clone()
            pm.save_pretrained(os.path.join(tmp, "converted"),
                               path_initial_model_for_weight_conversion=os.path.join(tmp, "start"))
            with safe_open(os.path.join(tmp, "converted", "adapter_model.safetensors"), "pt") as f:
                for k in f.keys():
                    exp["converted." + k] = f.get_tensor(k)
            with open(os.path.join(tmp, "converted", "adapter_config.json")) as f:
                conv = json.load(f)
            settings["converted"] = {"r": conv["r"], "lora_alpha": conv["lora_alpha"],
                                     "init_lora_weights": conv["init_lora_weights"]}
        shutil.rmtree(tmp)
        write_case(out_dir, exp, settings)
        print(name, "written:", len(targeted), "layers")


# EVA's start (PEFT's init_lora_weights "eva" with initialize_lora_eva_weights)
# over the bitsandbytes model: r 4, lora_alpha 8, every linear layer, batches
# of 4 JSONL examples (data.jsonl: ids and labels, a prompt of 0-4 positions
# labelled -100) padded on the right. PEFT's IncrementalPCA approximates each
# SVD from a seed-42 sketch of torch's generator, which no other library
# draws: "exact" cases replace it by torch.linalg.svd (lowrank=False), the
# decomposition quanta's svd_niter -1 computes; the "lowrank" case keeps
# PEFT's own, to compare ranks and directions with quanta's sketches.
EVA_CASES = {
    "eva_llama_gqa": dict(model="llama_gqa", dtype=torch.float32, svd="exact", eva={}),
    "eva_llama_gqa_lowrank": dict(model="llama_gqa", dtype=torch.float32, svd="lowrank", eva={}),
    "eva_llama_gqa_whiten": dict(model="llama_gqa", dtype=torch.float32, svd="exact",
                                 eva=dict(rho=1.5, tau=0.98, use_label_mask=False, whiten=True,
                                          adjust_scaling_factors=False)),
    "eva_llama_bf16": dict(model="llama_bf16", dtype=torch.bfloat16, svd="exact", eva={}),
}


def eva_examples(seed, count=24):
    """count (ids, labels) examples of 10-24 ids below 64, the first 0-4
    positions labelled -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(10, 25, (1,), generator=g))
        ids = torch.randint(0, 64, (n,), generator=g).tolist()
        prompt = int(torch.randint(0, 5, (1,), generator=g))
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


def eva_batches(examples, rows=4):
    """The examples in order, `rows` a batch, padded on the right (id 0,
    label -100, attention_mask 0): what quanta's LmExamples batches."""
    batches = []
    for s in range(0, len(examples), rows):
        part = examples[s:s + rows]
        length = max(len(ids) for ids, _ in part)
        ids = torch.zeros(len(part), length, dtype=torch.long)
        labels = torch.full((len(part), length), -100, dtype=torch.long)
        mask = torch.zeros(len(part), length, dtype=torch.long)
        for k, (i, l) in enumerate(part):
            ids[k, :len(i)] = torch.tensor(i)
            labels[k, :len(l)] = torch.tensor(l)
            mask[k, :len(i)] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def eva_cases(root):
    """qlora/<case>/: data.jsonl, case.json (model, compute_dtype, r,
    lora_alpha, svd, eva_config, forwards: PEFT's forward passes, the one
    finding shared inputs included; adapter_config: the fields PEFT's
    save_pretrained writes after EVA: target_modules sorted, rank_pattern,
    alpha_pattern, init_lora_weights, eva_config) and expected.safetensors:
    "<layer>.lora_A.weight" as EVA sets it (f32) for the layers it gives a
    rank, ids [2, 12] with the eval-mode logits (the base's: B is zero)."""
    import tempfile
    from peft.tuners.lora import EvaConfig
    from peft.tuners.lora import eva as peft_eva
    from peft.tuners.lora.eva import initialize_lora_eva_weights
    from peft.utils.incremental_pca import IncrementalPCA
    prefix = "base_model.model."
    make_pca = peft_eva.IncrementalPCA
    for i, (name, c) in enumerate(EVA_CASES.items()):
        out_dir = os.path.join(root, "qlora", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        examples = eva_examples(1000 + i)
        with open(os.path.join(out_dir, "data.jsonl"), "w") as f:
            for ids, labels in examples:
                f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
        if c["svd"] == "exact":
            peft_eva.IncrementalPCA = lambda **kw: IncrementalPCA(**{**kw, "lowrank": False})
        model = load_4bit(os.path.join(root, "models", c["model"]), c["dtype"])
        forwards = [0]
        model.register_forward_pre_hook(lambda m, a, kw: forwards.__setitem__(0, forwards[0] + 1),
                                        with_kwargs=True)
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                         task_type="CAUSAL_LM", init_lora_weights="eva",
                         eva_config=EvaConfig(**c["eva"]))
        pm = get_peft_model(model, cfg)
        try:
            initialize_lora_eva_weights(pm, eva_batches(examples), show_progress_bar=False)
        finally:
            peft_eva.IncrementalPCA = make_pca
        eva_forwards = forwards[0]
        exp = {}
        for n, m in pm.named_modules():
            if isinstance(m, peft.tuners.lora.Linear4bit):
                exp[n[len(prefix):] + ".lora_A.weight"] = m.lora_A["default"].weight.detach().float().clone()
                assert m.lora_B["default"].weight.abs().max() == 0
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1100 + i))
        pm.eval()
        with torch.no_grad():
            exp["logits_eval"] = pm(input_ids=ids).logits.float()
        exp["ids"] = ids
        tmp = tempfile.mkdtemp()
        pm.save_pretrained(tmp)
        with open(os.path.join(tmp, "adapter_config.json")) as f:
            written = json.load(f)
        shutil.rmtree(tmp)
        tm = written["target_modules"]
        settings = {"model": c["model"], "compute_dtype": str(c["dtype"]).removeprefix("torch."),
                    "r": 4, "lora_alpha": 8, "svd": c["svd"], "eva_config": written["eva_config"],
                    "forwards": eva_forwards,
                    "adapter_config": {"target_modules": sorted(tm) if isinstance(tm, list) else tm,
                                       "rank_pattern": written["rank_pattern"],
                                       "alpha_pattern": written["alpha_pattern"],
                                       "init_lora_weights": written["init_lora_weights"]}}
        write_case(out_dir, exp, settings)
        print(name, "forwards", eva_forwards, "ranks", written["rank_pattern"])


# CorDA's start (PEFT's init_lora_weights "corda" after preprocess_corda),
# r 4, lora_alpha 8, every linear layer, as PEFT's recipe for a 4-bit base
# runs it (examples/corda_finetuning; corda_init refuses a quantized layer):
# each sample of data.jsonl a forward of its own through the float model
# (batch 1, no padding: run_model over the calibration set), the start on
# the float model, the residual model saved in its dtype and loaded in 4
# bits, the start's adapters loaded over it. ipm keeps the r largest
# singular triplets of W C, kpm the r smallest.
CORDA_CASES = {"corda_llama_gqa": dict(model="llama_gqa", method="ipm", dtype=torch.float32),
               "corda_llama_gqa_kpm": dict(model="llama_gqa", method="kpm", dtype=torch.float32),
               "corda_llama_bf16": dict(model="llama_bf16", method="ipm", dtype=torch.bfloat16)}


def corda_cases(root):
    """qlora/<case>/: data.jsonl (the samples' input_ids), case.json (model,
    init, corda_method, samples, r, lora_alpha, compute_dtype, targeted) and
    expected.safetensors: as residual_start_cases' (each adapted layer's
    start, its base as bitsandbytes serializes it, ids [2, 12] with the
    eval-mode logits), plus "<layer>.covariance" (f32 [in, in]): the
    covariance preprocess_corda collected for it."""
    import tempfile
    from peft.tuners.lora.config import CordaConfig
    try:
        import attr  # noqa: F401
    except ImportError:
        # PEFT's corda.py takes `dataclass` from attrs for one record (its
        # eigens); the peer environment has no attrs, and the standard
        # library's does the same there.
        import dataclasses
        import types
        sys.modules["attr"] = types.SimpleNamespace(dataclass=dataclasses.dataclass)
    from peft.tuners.lora.corda import preprocess_corda
    for i, (name, c) in enumerate(CORDA_CASES.items()):
        out_dir = os.path.join(root, "qlora", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
        samples = [ids for ids, _ in eva_examples(1200 + i, count=16)]
        with open(os.path.join(out_dir, "data.jsonl"), "w") as f:
            for ids in samples:
                f.write(json.dumps({"input_ids": ids}) + "\n")
        dtype = c["dtype"]
        model_dir = os.path.join(root, "models", c["model"])
        float_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="cpu")
        # preprocess_corda matches target_modules by name, without expanding
        # "all-linear": the same seven names spelled out.
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                         "up_proj", "down_proj"],
                         task_type="CAUSAL_LM", init_lora_weights="corda",
                         corda_config=CordaConfig(corda_method=c["method"],
                                                  prune_temporary_fields=False))

        def run_model():
            for ids in samples:
                float_model(input_ids=torch.tensor([ids]))

        preprocess_corda(float_model, cfg, run_model=run_model)
        covariances = {}
        for n, m in float_model.named_modules():
            if hasattr(m, "covariance_matrix"):
                covariances[n + ".covariance"] = m.covariance_matrix.float().clone()
        tmp = tempfile.mkdtemp()
        pm = residual_model_in_4bit(get_peft_model(float_model, cfg), tmp, dtype)
        shutil.rmtree(tmp)
        exp, targeted = starts_and_bases(pm)
        exp.update(covariances)
        assert len(targeted) == 14, targeted
        assert len(covariances) == 14, list(covariances)
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1250 + i))
        pm.eval()
        with torch.no_grad():
            exp["logits_eval"] = pm(input_ids=ids).logits.float()
        exp["ids"] = ids
        settings = {"model": c["model"], "init": "corda", "corda_method": c["method"],
                    "samples": len(samples), "r": 4, "lora_alpha": 8,
                    "compute_dtype": str(dtype).removeprefix("torch."), "targeted": targeted}
        write_case(out_dir, exp, settings)
        print(name, "written:", len(targeted), "layers")


PARTS = {"cases": lambda root: [run_case(root, name, c, seed=100 * (i + 1))
                                for i, (name, c) in enumerate(CASES.items())],
         "quanta_written": check_quanta_adapters,
         "loftq": loftq_cases,
         "residual_starts": residual_start_cases,
         "eva": eva_cases,
         "corda": corda_cases,
         "transformers_4bit": save_transformers_4bit}


def main(root, parts):
    for part in parts or PARTS:
        if part.startswith("case="):  # one case alone: case=NAME
            name = part.removeprefix("case=")
            run_case(root, name, CASES[name], seed=100 * (list(CASES).index(name) + 1))
        elif part.startswith("quanta_written="):
            check_quanta_adapters(root, [part.removeprefix("quanta_written=")])
        else:
            PARTS[part](root)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
