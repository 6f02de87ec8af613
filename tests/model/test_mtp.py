"""The MTP head against an oracle built from transformers' own decoder layers and norms (float32, CPU): draft logits
at every position of a sequence, from the main model's final hidden states (qwen4_exp: its streams before the final
mixer) and the next tokens. Qwen3-Next's and Qwen3.5-MoE's (one form), and qwen4_exp's in its published layout
(transformers has no MTP forward for it: the oracle composes its pieces as the published tensors and the public
ports do, docs/qwen4-exp.md)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from oracle import build_hf_model, build_mtp_head, build_qwen4_exp_mtp_head, save_mtp_head  # noqa: E402
from strata import Engine  # noqa: E402
from strata.engine.spec import sequence_draft_logits  # noqa: E402

TOL = 1e-4           # of the logit range, float32
NEAR_TIE = 1e-4      # router probability margin of the head's MoE block
N = 40


def _oracle(model, head, tokens):
    """The head's draft logits [N-1, V] and its router probabilities [N-1, E]."""
    seen = {}
    hook = head.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    with torch.no_grad():
        ids = torch.tensor(tokens)[None]
        hidden = model.model(input_ids=ids).last_hidden_state
        pos = torch.arange(N - 1)[None]
        logits = head(model, hidden[:, :-1], ids[:, 1:], pos)[0].numpy()
        gate = head.layers[0].mlp.gate.weight
        probs = torch.softmax(seen["h"].reshape(-1, gate.shape[1]) @ gate.T, dim=-1).numpy()
    hook.remove()
    return logits, probs


def _assert_strata_drafts(tmp_path, model, head, tokens, ref):
    """The model and head saved as a checkpoint, loaded by Strata: its draft logits equal ref within TOL."""
    path = tmp_path / "model"
    model.save_pretrained(path)
    save_mtp_head(head, path)
    engine = Engine.load(path, max_context=256, mtp=True)
    ours = sequence_draft_logits(engine, tokens)
    span = float(ref.max() - ref.min())
    err = float(np.abs(ours - ref).max())
    assert np.isfinite(ours).all()
    assert err <= TOL * span, f"max |diff| {err:.3e} > {TOL} x logit range {span:.3f}"


@pytest.mark.parametrize("arch, tied", [("qwen3_next", False), ("qwen3_next", True), ("qwen3_5_moe", False)])
def test_draft_logits_match_transformers(tmp_path, arch, tied):
    rejected = []
    for seed in range(20):
        model = build_hf_model(arch, seed, tie_word_embeddings=tied)
        head = build_mtp_head(model, seed)
        tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, N).tolist()
        ref, probs = _oracle(model, head, tokens)
        top = np.sort(probs, axis=-1)[:, ::-1]
        k = model.config.num_experts_per_tok
        margin = (top[:, k - 1] - top[:, k]).min()
        if margin >= NEAR_TIE:
            break
        rejected.append(f"seed {seed}: router margin {margin:.2e}")
    else:
        pytest.fail(f"no tie-free head in 20 seeds: {rejected}")
    _assert_strata_drafts(tmp_path, model, head, tokens, ref)


def test_mtp_needs_a_head(tmp_path):
    model = build_hf_model("qwen3_next", 0)
    model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="no MTP head"):
        Engine.load(tmp_path, max_context=64, mtp=True)


def test_qwen4_exp_draft_logits_match_transformers_pieces(tmp_path):
    """The head over the main model's streams; its QSA layer selects blocks (39 positions past a budget of 8)."""
    model = build_hf_model("qwen4_exp", 3)
    head = build_qwen4_exp_mtp_head(model, 3)
    tokens = np.random.default_rng(3).integers(3, model.config.vocab_size, N).tolist()
    seen = {}
    hook = model.model.hyper_connection_mixer.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    with torch.no_grad():
        ids = torch.tensor(tokens)[None]
        model.model(input_ids=ids)
        ref = head(model, seen["x"][:, :-1], ids[:, 1:], torch.arange(N - 1)[None])[0].numpy()
    hook.remove()
    _assert_strata_drafts(tmp_path, model, head, tokens, ref)
