"""Writes tiny Hugging Face model folders (random weights) and what
transformers computes with them, for quanta's decoder parity tests. Run with
the peer environment (../shared/peer/setup.sh):

    /tmp/peer-venv/bin/python tests/data/llm/make_tiny_models.py tests/data/llm [NAME ...]

With names, only those models are written (each keeps its seed).

models/<name>/       config.json + model.safetensors (or shards + index),
                     as save_pretrained writes them
expected/<name>.safetensors
                     input_ids [2, 12] (I64), logits [2, 12, vocab] (F32),
                     loss [] (F32: transformers' causal-LM loss with
                     labels = input_ids), prompt [1, 5] (I64) and generated
                     [1, 8] (I64: generate(do_sample=False) new tokens)

One folder's config.json is rewritten in transformers 4.x's names
(rope_theta and rope_scaling at the top level, torch_dtype), the names most
published models carry.
"""
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=None)

# Gemma 2: four norms a layer, query_pre_attn_scalar != head_dim, caps
# small enough that tanh bends the scores and the logits, every other layer
# sliding over a window no test sequence fills.
GEMMA2 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
              query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=2.0,
              sliding_window=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# Gemma 3: Gemma 2's layout with q and k norms (1 + weight), no caps, a
# window of 4 on layer 0 (layer 1 full), each with its own RoPE: the
# sliding layers' base 10000, the full ones' 1e6 scaled linearly.
GEMMA3 = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
              query_pre_attn_scalar=24, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

# OLMo 2: Llama's options; its norms and q and k norms are the model's own.
OLMO2 = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# Granite 3's scalings: the embeddings times 12, each block's output times
# 0.22, the scores times 1/64 instead of head_dim^-0.5, the logits over 4.
GRANITE = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
               embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
               logits_scaling=4.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

# Gemma 3's image-text model: GEMMA3's decoder as its text_config beside a
# one-layer SigLIP vision tower and projector, which text never reaches.
TINY_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                   num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)


def gemma3_image_text(**text):
    return Gemma3Config(text_config=text, vision_config=TINY_SIGLIP, mm_tokens_per_image=4,
                        boi_token_index=61, eoi_token_index=62, image_token_index=63,
                        tie_word_embeddings=True)


MODELS = {
    # Grouped-query attention, untied embeddings, default RoPE.
    "llama_gqa": (LlamaConfig, LlamaForCausalLM,
                  dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                  torch.float32, None),
    # Plain heads, tied embeddings, head_dim != hidden / heads, Llama 3's RoPE
    # scaling; config rewritten in 4.x names.
    "llama_tied_llama3": (LlamaConfig, LlamaForCausalLM,
                          dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                               tie_word_embeddings=True,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32}),
                          torch.float32, None),
    # bf16 weights and activations.
    "llama_bf16": (LlamaConfig, LlamaForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                   torch.bfloat16, None),
    # Qwen2: q, k, v biases, tied embeddings.
    "qwen2_bias": (Qwen2Config, Qwen2ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                   torch.float32, None),
    # Mistral without a sliding window, saved in shards with an index.
    "mistral_sharded": (MistralConfig, MistralForCausalLM,
                        dict(num_attention_heads=4, num_key_value_heads=1,
                             tie_word_embeddings=False, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                        torch.float32, "40KB"),
    # Qwen3: q_norm and k_norm over each head, head_dim != hidden / heads,
    # grouped heads, tied embeddings, no biases.
    "qwen3_qk_norm": (Qwen3Config, Qwen3ForCausalLM,
                      dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                      torch.float32, None),
    # Qwen3 as it is published: bf16 (its q and k norms round to bf16 too).
    "qwen3_bf16": (Qwen3Config, Qwen3ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                   torch.bfloat16, None),
    # Gemma: GeGLU (gelu_pytorch_tanh), norms scaling by 1 + weight, the
    # embeddings times sqrt(hidden_size), tied, head_dim != hidden / heads.
    "gemma_geglu": (GemmaConfig, GemmaForCausalLM,
                    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                    torch.float32, None),
    "gemma2_softcap": (Gemma2Config, Gemma2ForCausalLM,
                       GEMMA2,
                       torch.float32, None),
    # Gemma 2 as it is published: bf16.
    "gemma2_bf16": (Gemma2Config, Gemma2ForCausalLM,
                    GEMMA2,
                    torch.bfloat16, None),
    # Sliding windows shorter than the 12 tokens: Mistral's on every layer,
    # Qwen2's from layer 1 (max_window_layers).
    "mistral_window": (MistralConfig, MistralForCausalLM,
                       dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                            sliding_window=4,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                       torch.float32, None),
    "qwen2_window": (Qwen2Config, Qwen2ForCausalLM,
                     dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          use_sliding_window=True, sliding_window=5, max_window_layers=1,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                     torch.float32, None),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM,
                    GEMMA3,
                    torch.float32, None),
    # Gemma 3 as it is published: bf16.
    "gemma3_bf16": (Gemma3TextConfig, Gemma3ForCausalLM,
                    GEMMA3,
                    torch.bfloat16, None),
    # Gemma 3 4B-27B's form: the decoder under text_config, stored as the
    # hub's language_model.model.*, beside a vision tower.
    "gemma3_image_text": (gemma3_image_text, Gemma3ForConditionalGeneration,
                          GEMMA3,
                          torch.float32, None),
    # Phi-3: q, k and v from one qkv_proj, gate and up from one gate_up_proj,
    # a window of 5 on every layer (Phi-3-mini-4k's 2047), untied.
    "phi3_fused": (Phi3Config, Phi3ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                        sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                   torch.float32, None),
    # Phi-4-mini's RoPE: 3/4 of each head rotated, longrope past an original
    # length of 8 (the 12 tokens take the long factors, generation crosses
    # from short to long), tied.
    "phi3_longrope": (Phi3Config, Phi3ForCausalLM,
                      dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                           original_max_position_embeddings=8,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75,
                                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
                      torch.float32, None),
    # OLMo 2: norms only after each block, q and k normalized over all their
    # heads before the split, untied; in f32 and in bf16 (its norms apply
    # the weight before their one rounding).
    "olmo2_post_norms": (Olmo2Config, Olmo2ForCausalLM, OLMO2, torch.float32, None),
    "olmo2_bf16": (Olmo2Config, Olmo2ForCausalLM, OLMO2, torch.bfloat16, None),
    # YaRN as Qwen3's model cards extend its context: factor 4 over an
    # original length of 32, theta 10000 so that the blend between kept and
    # interpolated frequencies spans two dimensions; cos and sin scaled by
    # 0.1 ln 4 + 1.
    "qwen3_yarn": (Qwen3Config, Qwen3ForCausalLM,
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        tie_word_embeddings=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 32}),
                   torch.float32, None),
    # SmolLM3: layer 1 without RoPE (no_rope_layers), sliding over 4 keys
    # as use_sliding_window makes its NoPE layers do, tied.
    "smollm3_nope": (SmolLM3Config, SmolLM3ForCausalLM,
                     dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=4,
                          rope_parameters={"rope_type": "default", "rope_theta": 2000000.0}),
                     torch.float32, None),
    # OLMo 3: OLMo 2's norms, a window of 4 on layer 0, YaRN on the full
    # layer 1 only (OLMo 3's long-context settings); config rewritten in 4.x
    # names as OLMo 3 is published.
    "olmo3_window": (Olmo3Config, Olmo3ForCausalLM,
                     dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={
                              "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0,
                                                 "factor": 4.0, "original_max_position_embeddings": 32,
                                                 "beta_fast": 8.0, "beta_slow": 1.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
                     torch.float32, None),
    # Granite: its four scalings, each far from 1 (the residual's 0.22 not a
    # bf16 number), untied; in f32 and in bf16 (each applied in f32 and
    # rounded once).
    "granite_multipliers": (GraniteConfig, GraniteForCausalLM, GRANITE, torch.float32, None),
    "granite_bf16": (GraniteConfig, GraniteForCausalLM, GRANITE, torch.bfloat16, None),
    # Ministral: Mistral with layer types, a window of 4 on layer 0 alone.
    "ministral_window": (MinistralConfig, MinistralForCausalLM,
                         dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              tie_word_embeddings=False, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 100000000.0}),
                         torch.float32, None),
    # Qwen2 with bpe/qwen2's byte-level BPE tokenizer.json (written by
    # make_bpe_tokenizers.py; 701 tokens) beside it: text through a
    # tokenizer.json in quanta's commands.
    "qwen2_bpe": (Qwen2Config, Qwen2ForCausalLM,
                  dict(vocab_size=704, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  torch.float32, None),
    # EXAONE 4: OLMo 2's norms after each block with Qwen3's per-head q and k
    # norms, a window of 4 on layer 0 and layer 1 full, which has no RoPE.
    "exaone4_window": (Exaone4Config, Exaone4ForCausalLM,
                       dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                            sliding_window=4, sliding_window_pattern=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                       torch.float32, None),
}
# Tokenizer files copied into a model's folder (from tests/data/llm/).
TOKENIZER_FILES = {"qwen2_bpe": ("bpe/qwen2/tokenizer.json", "bpe/qwen2/tokenizer_config.json")}


def to_4x_names(path):
    with open(path) as f:
        c = json.load(f)
    rope = c.pop("rope_parameters")
    if "full_attention" in rope:  # per layer type: 4.x's rope_scaling is the full layers'
        rope = rope["full_attention"]
    c["rope_theta"] = rope.pop("rope_theta")
    c["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    c["torch_dtype"] = c.pop("dtype")
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def main(root, only):
    for i, (name, (config_cls, model_cls, extra, dtype, shard)) in enumerate(MODELS.items()):
        if only and name not in only:
            continue
        torch.manual_seed(1000 + i)
        config = config_cls(**{**COMMON, **extra})
        model = model_cls(config).to(dtype).eval()
        with torch.no_grad():  # norms start at 1 (Gemma's at 0): moved, so a missed scale shows
            for pname, p in model.named_parameters():
                if pname.endswith(("q_norm.weight", "k_norm.weight")) or (
                        name.startswith(("gemma", "olmo", "exaone")) and pname.endswith("norm.weight")):
                    p.add_(0.3 * torch.randn_like(p))
        folder = os.path.join(root, "models", name)
        os.makedirs(folder, exist_ok=True)
        for f in os.listdir(folder):  # make_tokenizer.sh's tokenizer.model stays
            if f != "tokenizer.model":
                os.remove(os.path.join(folder, f))
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(folder, safe_serialization=True, **kwargs)
        for f in os.listdir(folder):  # keep only what the loader reads
            if f == "generation_config.json":
                os.remove(os.path.join(folder, f))
        for f in TOKENIZER_FILES.get(name, ()):
            with open(os.path.join(root, f), "rb") as src, \
                    open(os.path.join(folder, os.path.basename(f)), "wb") as dst:
                dst.write(src.read())
        if name in ("llama_tied_llama3", "olmo3_window"):
            to_4x_names(os.path.join(folder, "config.json"))
        # What a user gets: the folder loaded back (from_pretrained keeps RoPE's
        # inverse frequencies in f32; the .to(dtype) above rounded them too).
        model = model_cls.from_pretrained(folder).eval()
        ids = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7 + i))
        prompt = torch.randint(3, COMMON["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(70 + i))
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        save_file({
            "input_ids": ids.contiguous(),
            "logits": out.logits.float().contiguous(),
            "loss": out.loss.float().reshape(()).contiguous(),
            "prompt": prompt.contiguous(),
            "generated": gen[:, prompt.shape[1]:].contiguous(),
        }, os.path.join(root, "expected", name + ".safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__})
        print(name, sorted(os.listdir(folder)))


if __name__ == "__main__":
    main(sys.argv[1], set(sys.argv[2:]))
