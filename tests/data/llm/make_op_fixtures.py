"""Writes ops.json: what transformers and PyTorch compute for quanta's
language-model ops (RoPE tables of each scaling kind, apply_rotary_pos_emb,
LlamaRMSNorm, scaled dot-product attention and its gradients), in f32 and
bf16. Run with the peer environment (../shared/peer/setup.sh):

    /tmp/peer-venv/bin/python tests/data/llm/make_op_fixtures.py tests/data/llm/ops.json

Tensors are stored as {"shape": [...], "data": [...]} (values as float64,
exact for f32 and bf16), in quanta's layouts: heads as [batch, len, heads,
dim], RoPE tables as [batch, len, head_dim / 2].
"""
import json
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def t(x):
    x = x.detach().to(torch.float64).contiguous()
    return {"shape": list(x.shape), "data": x.flatten().tolist()}


def heads(x):  # [B, H, T, D] -> [B, T, H, D]
    return t(x.transpose(1, 2))


def rope_case(name, params, head_dim, max_pos, positions):
    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    rotary = LlamaRotaryEmbedding(config)
    pos = torch.tensor([positions], dtype=torch.int64)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    half = head_dim // 2
    return {
        "name": name,
        "rope_parameters": params,
        "head_dim": head_dim,
        "max_position_embeddings": max_pos,
        "positions": positions,
        "attention_scaling": float(rotary.attention_scaling),
        "inv_freq": rotary.inv_freq.tolist(),
        "cos": t(cos[..., :half]),
        "sin": t(sin[..., :half]),
    }


def main(path):
    torch.manual_seed(20261128)
    out = {"transformers": transformers.__version__, "torch": torch.__version__}

    out["rope"] = [
        rope_case("default", {"rope_type": "default", "rope_theta": 10000.0}, 16, 64,
                  [0, 1, 2, 5, 17, 63]),
        rope_case("theta_500000", {"rope_type": "default", "rope_theta": 500000.0}, 64, 2048,
                  [0, 3, 100, 1000, 2047]),
        rope_case("linear", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 16, 64,
                  [0, 1, 7, 40, 63]),
        rope_case("dynamic", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 16,
                  16, [0, 5, 20, 40]),
        rope_case("llama3", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}, 64, 131072,
                  [0, 1, 100, 5000, 9000]),
    ]

    # LlamaRMSNorm in f32 and bf16.
    n, eps = 16, 1e-5
    x = torch.randn(3, n) * 3
    norm = LlamaRMSNorm(n, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n) * 0.5 + 1)
    rms = {"eps": eps, "x": t(x), "weight": t(norm.weight), "y": t(norm(x))}
    norm_bf16 = LlamaRMSNorm(n, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm_bf16.weight.copy_(norm.weight.to(torch.bfloat16))
    xb = x.to(torch.bfloat16)
    rms["x_bf16"] = t(xb)
    rms["weight_bf16"] = t(norm_bf16.weight)
    rms["y_bf16"] = t(norm_bf16(xb))
    out["rms_norm"] = rms

    # apply_rotary_pos_emb on q [B, H, T, D] in f32 and bf16.
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, head_dim=8,
                         max_position_embeddings=64)
    rotary = LlamaRotaryEmbedding(config)
    positions = [0, 1, 2, 9, 30, 63]
    pos = torch.tensor([positions])
    q = torch.randn(1, 2, len(positions), 8)
    rope_out = {"positions": positions, "theta": 10000.0, "head_dim": 8, "q": heads(q)}
    for dtype, tag in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        qd = q.to(dtype)
        cos, sin = rotary(qd, pos)
        rotated, _ = apply_rotary_pos_emb(qd, qd, cos, sin)
        rope_out["q" + tag] = heads(qd)
        rope_out["out" + tag] = heads(rotated)
    out["apply_rope"] = rope_out

    # Scaled dot-product attention, grouped heads: causal with equal lengths
    # (PyTorch's is_causal), and queries at the end of a longer key sequence
    # (transformers' mask with a KV cache: bottom-right aligned).
    cases = []
    for name, T, S in (("causal_gqa", 5, 5), ("kv_cache", 2, 6)):
        B, H, Hk, D = 2, 4, 2, 8
        q = torch.randn(B, H, T, D, requires_grad=True)
        k = torch.randn(B, Hk, S, D, requires_grad=True)
        v = torch.randn(B, Hk, S, D, requires_grad=True)
        g = torch.randn(B, H, T, D)
        if T == S:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        o.backward(g)
        case = {"name": name, "q": heads(q), "k": heads(k), "v": heads(v), "grad_out": heads(g),
                "out": heads(o), "grad_q": heads(q.grad), "grad_k": heads(k.grad),
                "grad_v": heads(v.grad)}
        with torch.no_grad():
            qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
            if T == S:
                ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
            else:
                ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        case["out_bf16"] = heads(ob)
        cases.append(case)
    out["attention"] = cases

    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
