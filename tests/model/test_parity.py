"""The engine against transformers (float32, CPU): logits, prompts read in parts + decode, greedy generation.

Every parameter of each tiny model is re-randomised. Router near-ties (two experts within 1e-4 in probability) and
greedy near-ties would make the two implementations legitimately pick different experts or tokens; a model whose
oracle run has one is rejected and the next seed is drawn, so tolerances never loosen.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oracle import build_hf_model  # noqa: E402
from strata import Engine  # noqa: E402
from strata.jax_backend.backend import JaxBackend  # noqa: E402
from strata.backend import quantize_kv  # noqa: E402

TOL = 1e-4           # of the logit range, float32
NEAR_TIE = 1e-4      # router probability margin, and greedy logit margin relative to the range
PROMPT_LEN = 70      # crosses the 64-token delta-rule chunk
GEN = 32

CONFIGS = {
    # Qwen3-Next: partial RoPE (0.25) and more value heads than key heads in every config
    "next-odd-hidden-untied": ("qwen3_next", dict(hidden_size=72, norm_topk_prob=True, tie_word_embeddings=False)),
    "next-sparse-step2-tied": ("qwen3_next", dict(decoder_sparse_step=2, tie_word_embeddings=True, norm_topk_prob=False,
                                                  linear_num_value_heads=6, linear_num_key_heads=2)),
    "next-mlp-only-interval": ("qwen3_next", dict(mlp_only_layers=[0, 3], hidden_size=48, head_dim=24,
                                                  num_hidden_layers=4, layer_types=None, full_attention_interval=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                                   "partial_rotary_factor": 0.5})),
    "moe-odd-hidden-untied": ("qwen3_moe", dict(hidden_size=72, norm_topk_prob=False, tie_word_embeddings=False)),
    "moe-sparse-step2-tied": ("qwen3_moe", dict(decoder_sparse_step=2, tie_word_embeddings=True, norm_topk_prob=True,
                                                num_hidden_layers=4)),
    "moe-mlp-only-gqa4": ("qwen3_moe", dict(mlp_only_layers=[1], num_attention_heads=8, num_key_value_heads=2,
                                            hidden_size=40, head_dim=8, num_experts=6, num_experts_per_tok=3)),
    # qwen4_exp: 4 hyper-connection streams, a PLE layer, QSA keeping 2 blocks of 4 (the prompt runs far past it)
    "q4-ple-qsa-sigmoid": ("qwen4_exp", dict()),
    # two PLE layers (their own hash multipliers and table sizes), 2 streams, QSA in two layers, tied, silu gate.
    # (With 2 indexer heads, blocks whose every head's score is negative tie at 0 after relu, and torch.topk's
    # order among ties is unspecified: tests/model/test_qsa.py holds the tie rule; these configs use 4 heads.)
    "q4-two-ple-tied-silu": ("qwen4_exp", dict(
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        ple_layer_ids=[1, 3], hc_count=2, hc_lowrank=8, tie_word_embeddings=True, output_gate_type="silu",
        indexer_budget=16, indexer_compress_ratio=8, indexer_n_heads=4)),
    # Qwen3.5-MoE (qwen3_5_moe): in_proj_qkv / z / b / a, experts as one gate_up_proj, the router always renormalised
    "q35-moe-tied": ("qwen3_5_moe", dict(tie_word_embeddings=True)),
    "q35-moe-gqa4-r3": ("qwen3_5_moe", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                            linear_num_value_heads=6, linear_num_key_heads=2)),
}


def _oracle_run(model, prompt):
    """transformers' greedy continuation, and its logits and router probabilities over prompt + continuation."""
    with torch.no_grad():
        gen = model.generate(torch.tensor(prompt)[None], max_new_tokens=GEN, do_sample=False,
                             min_new_tokens=GEN)[0, len(prompt):].tolist()
        full = prompt + gen
        out = model(torch.tensor(full)[None], output_router_logits=True)
    logits = out.logits[0].float().numpy()
    routers = [torch.softmax(r.float(), dim=-1).numpy() for r in (out.router_logits or ())]
    return gen, full, logits, routers


def _near_tie(cfg_k: int, logits, routers, prompt_len) -> str | None:
    for i, p in enumerate(routers):
        top = -np.sort(-p, axis=-1)
        margin = (top[:, cfg_k - 1] - top[:, cfg_k]).min()
        if margin < NEAR_TIE:
            return f"router near-tie in sparse layer {i}: margin {margin:.2e}"
    span = logits.max() - logits.min()
    gen_logits = logits[prompt_len - 1:-1]
    top2 = -np.sort(-gen_logits, axis=-1)[:, :2]
    margin = (top2[:, 0] - top2[:, 1]).min()
    if margin < NEAR_TIE * span:
        return f"greedy near-tie: margin {margin:.2e}"
    return None


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    arch, overrides = CONFIGS[request.param]
    rejected = []
    for seed in range(20):
        model = build_hf_model(arch, seed, **overrides)
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, model.config.vocab_size, PROMPT_LEN).tolist()
        if arch == "qwen4_exp":         # an end token mid-prompt: the PLE n-gram history restarts after it
            prompt[PROMPT_LEN // 2] = model.config.eos_token_id
        gen, full, logits, routers = _oracle_run(model, prompt)
        why = _near_tie(model.config.num_experts_per_tok, logits, routers, len(prompt))
        if why is None:
            break
        rejected.append(f"seed {seed}: {why}")
    else:
        pytest.fail(f"no tie-free model in 20 seeds: {rejected}")
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    engine = Engine.load(path, max_context=256)
    return dict(engine=engine, path=path, prompt=prompt, gen=gen, full=full, logits=logits, name=request.param)


def _assert_close(ours, ref, what, tol=TOL):
    span = float(ref.max() - ref.min())
    err = float(np.abs(ours - ref).max())
    assert np.isfinite(ours).all(), f"{what}: non-finite logits"
    assert err <= tol * span, f"{what}: max |diff| {err:.3e} > {tol} x logit range {span:.3f}"


def test_logits_match_transformers(case):
    ours = case["engine"].logits(case["full"])
    _assert_close(ours, case["logits"], f"{case['name']} full pass")


@pytest.mark.parametrize("part", [1, 7, 64])
def test_parts_plus_decode_equal_one_pass(case, part):
    e = case["engine"]
    full, n = case["full"], len(case["prompt"])
    one_pass = e.logits(full)
    seq = e.sequence()
    pieces = [seq.read(full[:n], part_size=part, all_logits=True)]
    for tok in full[n:]:                       # the decode form: one token at a time
        pieces.append(seq.read([tok], all_logits=True))
    _assert_close(np.concatenate(pieces), one_pass, f"{case['name']} parts of {part} + decode")
    _assert_close(np.concatenate(pieces), case["logits"], f"{case['name']} parts of {part} vs transformers")


def test_greedy_generation_identical(case):
    ours = case["engine"].generate(case["prompt"], GEN, temperature=0.0)
    assert ours == case["gen"]



def test_int8_kv_equals_a_float32_cache_holding_the_dequantised_rows(case, monkeypatch):
    """The int8 cache's plumbing (codes and scales written and read at the right rows, in parts and in decode) is
    exact: it gives the logits of a float32 cache into which the same rows were written quantised and dequantised.
    (Against transformers directly, the quantisation noise, ~amax / 254 per value, is above these tiny random
    models' router margins, so their routing, and the logits after it, legitimately differ.)"""
    full, n = case["full"], len(case["prompt"])

    def read(engine):      # both read alike, so both quantise the same keys (a flip at a rounding boundary is a step)
        seq = engine.sequence()
        return np.concatenate([seq.read(full[:n], part_size=7, all_logits=True)] +
                              [seq.read([tok], all_logits=True) for tok in full[n:]])
    ours = read(Engine.load(case["path"], max_context=256, kv="int8"))

    def store_dequantised(self, kv, k, v, start):
        out = {}
        for name, x in (("k", k), ("v", v)):
            q8, scale = quantize_kv(self.xp, x)
            out[name] = self.kv_write(kv[name], q8.astype(self.xp.float32) * scale[..., None], start)
        return out
    monkeypatch.setattr(JaxBackend, "kv_store", store_dequantised)
    ref = read(Engine.load(case["path"], max_context=256))
    _assert_close(ours, ref, f"{case['name']} int8 KV (parts of 7 + decode) vs float32 KV of the dequantised rows")


# --- the built-in tiny model: trained weights, stored as bf16, read by both in float32 --------------------------------

def _greedy(model, prompt, n):
    """transformers' greedy continuation with no stop token (generate's min_new_tokens would instead mask the end
    tokens out of the argmax)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_tiny_model_matches_transformers():
    import transformers
    from pydoc_data.topics import topics

    from strata.builtin import builtin_dir
    model = transformers.Qwen3NextForCausalLM.from_pretrained(builtin_dir("tiny"), dtype=torch.float32).eval()
    engine = Engine.load("tiny", max_context=256)
    prompt = engine.tokenizer.encode(topics["if"])[:PROMPT_LEN]      # a topic whose routers and argmaxes have no near-tie
    assert len(prompt) == PROMPT_LEN
    gen = _greedy(model, prompt, GEN)
    full = prompt + gen
    with torch.no_grad():
        out = model(torch.tensor(full)[None], output_router_logits=True)
    logits = out.logits[0].numpy()
    routers = [torch.softmax(r.float(), dim=-1).numpy() for r in out.router_logits]
    why = _near_tie(model.config.num_experts_per_tok, logits, routers, len(prompt))
    assert why is None, f"the tiny model meets a {why} on this prompt: the comparison needs a prompt without one"
    _assert_close(engine.logits(full), logits, "tiny full pass")
    assert engine.generate(prompt, GEN, stop_token_ids=()) == gen
