"""The transformers oracle: tiny random Qwen3-Next / Qwen3-MoE models, every parameter re-randomised, saved as a
Hugging Face checkpoint directory that Strata loads like any other."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def build_hf_model(arch: str, seed: int, **overrides):
    import torch
    import transformers
    torch.manual_seed(seed)
    if arch == "qwen3_next":
        kw = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                  max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        kw.update(overrides)
        cfg = transformers.Qwen3NextConfig(**kw)
        model = transformers.Qwen3NextForCausalLM(cfg)
    elif arch == "qwen3_moe":
        kw = dict(vocab_size=160, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=4096, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        kw.update(overrides)
        cfg = transformers.Qwen3MoeConfig(**kw)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(arch)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif p.ndim == 1:   # norms: random around their neutral value, so a wrong (1 + w) convention shows
                base = 1.0 if name.endswith("linear_attn.norm.weight") or arch == "qwen3_moe" else 0.0
                p.copy_(base + torch.randn(p.shape, generator=gen) * 0.3)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in) * 1.5)
    model.eval()
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path
