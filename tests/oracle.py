"""The transformers oracle: tiny random Qwen3-Next / Qwen3-MoE / qwen4_exp / Qwen3.5-MoE (text) models, every parameter
re-randomised, saved as a Hugging Face checkpoint directory that Strata loads like any other."""
from __future__ import annotations

from pathlib import Path

import numpy as np


# the hybrid families' (Qwen3-Next, qwen4_exp, Qwen3.5-MoE) common shapes: 4 layers, the last one attention
HYBRID = dict(vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
              num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=4096, bos_token_id=None,
              pad_token_id=None, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"])


def build_hf_model(arch: str, seed: int, **overrides):
    import torch
    import transformers
    torch.manual_seed(seed)
    if arch == "qwen3_next":
        kw = dict(HYBRID, intermediate_size=96, eos_token_id=None)
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
    elif arch == "qwen4_exp":
        # hyper-connections, one PLE layer with a small table, and QSA whose budget (2 blocks of 4) a 70-token
        # prompt exceeds, so the sparse selection runs
        kw = dict(HYBRID, layer_types=["linear_attention", "linear_attention", "linear_attention",
                                       "indexed_attention"],
                  eos_token_id=2, hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=32, heads_per_ngram=2,
                  ngram_vocab_size_base=50, split_ngram_parts=2, indexer_n_heads=4, indexer_kv_heads=1,
                  indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, output_gate_type="sigmoid",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        kw.update(overrides)
        cfg = transformers.Qwen4ExpTextConfig(**kw)
        model = transformers.Qwen4ExpForCausalLM(cfg)
        model.generation_config.eos_token_id = None      # greedy runs to its length: PLE needs an eos, generate not
    elif arch == "qwen3_5_moe":
        # the Qwen3-Next hybrid with Qwen3.5's separate delta-rule projections, fused expert matrices and MRoPE (text:
        # one position for its three sections, plain RoPE)
        kw = dict(HYBRID, eos_token_id=None, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
            "mrope_interleaved": True})
        kw.update(overrides)
        cfg = transformers.Qwen3_5MoeTextConfig(**kw)
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
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
            elif name.endswith("ngram_embedding.weight"):       # table rows are embeddings: O(1) values
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in) * 1.5)
    model.eval()
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def build_mtp_head(model, seed: int):
    """Qwen3-Next's (or Qwen3.5-MoE's, the same form) MTP head built from transformers' own decoder layer and norms
    (transformers does not load mtp.*), every parameter re-randomised as build_hf_model's. forward(model, hidden
    [B, T, H] after the final norm, next_ids [B, T], position_ids [B, T]) -> draft logits [B, T, V]."""
    import torch
    from transformers.masking_utils import create_causal_mask
    if model.config.model_type.startswith("qwen3_5_moe"):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        Qwen3NextDecoderLayer, Qwen3NextRMSNorm = m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeRMSNorm
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

    class MTPHead(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            H, eps = config.hidden_size, config.rms_norm_eps
            self.fc = torch.nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen3NextRMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen3NextRMSNorm(H, eps=eps)
            # built at the index of a full-attention MoE layer, so it is that kind of layer
            self.layers = torch.nn.ModuleList([Qwen3NextDecoderLayer(config, config.layer_types.index(
                "full_attention"))])
            self.norm = Qwen3NextRMSNorm(H, eps=eps)

        def forward(self, model, hidden, next_ids, position_ids):
            e = model.model.embed_tokens(next_ids)
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], dim=-1))
            mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                      position_ids=position_ids)
            x = self.layers[0](x, position_embeddings=model.model.rotary_emb(x, position_ids), attention_mask=mask,
                               position_ids=position_ids)
            return model.lm_head(self.norm(x))

    head = MTPHead(model.config)
    return _rerandomised(head, seed + 1)


def build_qwen4_exp_mtp_head(model, seed: int):
    """qwen4_exp's MTP head built from transformers' own pieces (its decoder layer at an indexed-attention index,
    gated residuals, norms; transformers does not load mtp.*) in the published tensor layout: each stream of the
    main model's pre-mixer streams (normed as one row of hc x H) projected by fc_hidden, plus fc_embedding of the
    normed next-token embedding; the layer; the head's own mixer; the model's lm_head. Parameters re-randomised as
    build_hf_model's. forward(model, streams [B, T, hc x H], next_ids [B, T], position_ids [B, T]) -> logits."""
    import torch
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer,
                                                                   Qwen4ExpTextGatedResidual, Qwen4ExpTextRMSNorm)

    class MTPHead(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            H, n, eps = config.hidden_size, config.hc_count, config.rms_norm_eps
            self.hc, self.hidden = n, H
            self.fc_embedding = torch.nn.Linear(H, H, bias=False)
            self.fc_hidden = torch.nn.Linear(H, H, bias=False)
            self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(n * H, eps=eps)
            self.layers = torch.nn.ModuleList([Qwen4ExpTextDecoderLayer(config, config.layer_types.index(
                "indexed_attention"))])
            self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(config, use_combine=False)

        def forward(self, model, streams, next_ids, position_ids):
            e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids))
            h = self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc, self.hidden))
            x = (self.fc_hidden(h) + self.fc_embedding(e).unsqueeze(-2)).flatten(-2)
            mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                      position_ids=position_ids, allow_is_causal_skip=False)
            rope = model.model.rotary_emb(x, position_ids[None].expand(3, -1, -1))
            x = self.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=position_ids)
            return model.lm_head(self.hyper_connection_mixer(x))

    head = MTPHead(model.config)
    return _rerandomised(head, seed + 1)


def _rerandomised(head, seed: int):
    """head with every parameter drawn again (norms around 0 for the 1 + w convention, matrices scaled by fan-in)
    from seed, in eval mode."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in head.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]) * 1.5)
    head.eval()
    return head


def save_mtp_head(head, path: Path) -> Path:
    """head's tensors as mtp.* in Hugging Face's on-disk names (routed experts one by one) -> path/mtp.safetensors,
    beside the model's own file."""
    from safetensors.torch import save_file
    out = {}
    for name, t in head.state_dict().items():
        t = t.detach().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"mtp.{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"mtp.{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"mtp.{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out["mtp." + name] = t
    save_file(out, str(path / "mtp.safetensors"))
    return path
