"""QSA's selection mask (strata/model/qsa.py) against transformers' qwen4_exp indexer (Qwen4ExpTextQSAIndexer, fp32,
CPU): the whole prompt at once, one query at a time against a cache whose later rows are garbage, in parts, and
within the budget, where it is the causal mask. qsa_select runs with numpy and jitted with jax.numpy."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer, Qwen4ExpTextRotaryEmbedding

from strata.model.qsa import qsa_block_keys, qsa_mask_reference, qsa_select

RATIO, BUDGET = 4, 8         # 2 blocks kept: a query past position 10 sees more complete blocks than it keeps
T = 48                       # prompt length
CAP = 50                     # cache rows in the decode view: 12 blocks and 2 rows no block covers
SEEDS = range(8)
# a query's k-th and (k+1)-th best block scores closer than this (relative to its best) count as tied: float
# rounding (numpy's against torch's) could swap them, and torch.topk orders exact ties as its partition falls
# (seen here: 0, 2 of [1.8, 0, 0, 0] but 3, 2 of [0, 0, 0, 1.1]). Exact ties are common: relu makes every block
# whose dot products are all negative score 0, and this indexer has two heads.
MARGIN = 1e-4


def _config(budget=BUDGET) -> Qwen4ExpTextConfig:
    return Qwen4ExpTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
        layer_types=["indexed_attention"], vocab_size=128, hc_lowrank=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1]},
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=budget,
        indexer_compress_ratio=RATIO, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16)


def _rope(xp, cos, sin):
    """NeoX rotate-half over the first rotary_dim features, from cos/sin tables [positions, rotary_dim]."""
    rd = cos.shape[-1]

    def rope(x, positions):
        c = xp.take(cos, positions, axis=0)[:, None, :]
        s = xp.take(sin, positions, axis=0)[:, None, :]
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        half = xp.concatenate([-x_rot[..., rd // 2:], x_rot[..., :rd // 2]], axis=-1)
        return xp.concatenate([x_rot * c + half * s, x_pass], axis=-1)
    return rope


class Case:
    """A randomised indexer, its hidden states and what both sides need: the torch module's mask, and q, the raw
    index keys and the k norm computed here in numpy from the same weights."""

    def __init__(self, seed, budget=BUDGET, n=T):
        cfg = _config(budget)
        torch.manual_seed(seed)
        self.ix = Qwen4ExpTextQSAIndexer(cfg, 0)
        with torch.no_grad():
            self.ix.index_qk_proj.weight.normal_(0.0, 1.0 / math.sqrt(cfg.hidden_size))
            self.ix.q_layernorm.weight.normal_(0.0, 0.5)    # zero-centred norms: 0 would be the identity scale
            self.ix.k_layernorm.weight.normal_(0.0, 0.5)
        self.hidden = torch.randn(1, n, cfg.hidden_size)
        # text positions: the model gives the rotary embedding [3, batch, n] (the t/h/w rows, all equal here)
        pos = torch.arange(max(n, CAP)).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = Qwen4ExpTextRotaryEmbedding(cfg)(self.hidden, pos)
        self.cos_t, self.sin_t = cos[:, :n], sin[:, :n]
        self.cos, self.sin = cos[0].numpy(), sin[0].numpy()
        self.rope_np = _rope(np, self.cos, self.sin)
        self.eps, self.budget, self.n = cfg.rms_norm_eps, budget, n

        hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
        qk = self.hidden[0].numpy() @ self.ix.index_qk_proj.weight.detach().numpy().T
        q = qk[:, :hi * di].reshape(n, hi, di)
        self.keys = qk[:, hi * di:]                                 # the one index key head, before any norm
        q_scale = self.ix.q_layernorm.weight.detach().numpy()
        q = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + self.eps) * (1.0 + q_scale)
        self.q = self.rope_np(q.astype(np.float32), np.arange(n, dtype=np.int32))
        self.k_scale = 1.0 + self.ix.k_layernorm.weight.detach().numpy()      # the scale, as params.py loads it
        self.pos = np.arange(n, dtype=np.int32)

    def torch_mask(self):
        causal = torch.ones(self.n, self.n, dtype=torch.bool).tril()[None, None]
        with torch.no_grad():
            out = self.ix(self.hidden, (self.cos_t, self.sin_t), causal, None)
        assert out.shape == (1, 1, self.n, self.n) and out.dtype == torch.bool
        return out[0, 0].numpy()

    def block_keys(self, keys):
        return qsa_block_keys(np, keys, self.k_scale, self.eps, RATIO, self.rope_np)

    def tied_rows(self):
        """The queries that drop blocks and whose k-th and (k+1)-th block scores are tied (MARGIN)."""
        bk = self.block_keys(self.keys)
        scores = np.maximum(np.einsum("thd,nd->thn", self.q, bk), 0).sum(1) / math.sqrt(bk.shape[-1])
        k, tied = self.budget // RATIO, []
        for p in range(self.n):
            s = np.sort(scores[p, :(p + 1) // RATIO])[::-1]
            if len(s) > k and s[k - 1] - s[k] <= MARGIN * s[0]:
                tied.append(p)
        return tied

    def jax_select(self, cap):
        """qsa_block_keys then qsa_select, jitted with jax.numpy, for caches of `cap` rows."""
        return functools.partial(_jax_select, k_scale=self.k_scale, cos=self.cos, sin=self.sin, eps=self.eps,
                                 budget=self.budget, cap=cap)

    def numpy_select(self, q, keys, q_pos, cap):
        return qsa_select(np, q, self.block_keys(keys), q_pos, RATIO, self.budget, cap)

    def reference(self, q, keys, q_pos):
        return qsa_mask_reference(q, keys, self.k_scale, self.eps, q_pos, RATIO, self.budget, self.rope_np)


@functools.partial(jax.jit, static_argnames=("eps", "budget", "cap"))
def _jax_select(q, keys, q_pos, *, k_scale, cos, sin, eps, budget, cap):
    block_keys = qsa_block_keys(jnp, keys, k_scale, eps, RATIO, _rope(jnp, cos, sin))
    return qsa_select(jnp, q, block_keys, q_pos, RATIO, budget, cap)


@functools.cache
def _cases():
    """(seeds without tied rows, seeds with them)."""
    cases = [Case(seed) for seed in SEEDS]
    return [c for c in cases if not c.tied_rows()], [c for c in cases if c.tied_rows()]


def _causal(n, cap):
    return np.arange(cap)[None, :] <= np.arange(n)[:, None]


def _three(case, q, keys, q_pos, cap):
    """(name, mask) of the jitted jax.numpy, numpy and reference selections; keys has `cap` rows."""
    return (("jax", np.asarray(case.jax_select(cap)(q, keys, q_pos))),
            ("numpy", case.numpy_select(q, keys, q_pos, cap)),
            ("reference", case.reference(q, keys, q_pos)))


def test_prompt_mask_matches_transformers():
    clean, tied = _cases()
    assert len(clean) >= 4 and tied, (len(clean), len(tied))
    k = BUDGET // RATIO
    for case in clean + tied:
        want, ties = case.torch_mask(), case.tied_rows()
        masks = _three(case, case.q, case.keys, case.pos, T)
        for name, got in masks:
            assert got.dtype == bool and got.shape == (T, T), name
            assert np.array_equal(got, masks[0][1]), name               # ours agree everywhere, ties included
            differ = np.flatnonzero((got != want).any(1))
            assert set(differ) <= set(ties), f"{name}: rows {differ} differ from transformers, tied rows {ties}"
        # selection really happened: a query past the budget keeps k whole blocks and its tail, not everything
        n_complete = (case.pos + 1) // RATIO
        kept = np.minimum(n_complete, k) * RATIO + (case.pos + 1 - n_complete * RATIO)
        assert np.array_equal(masks[0][1].sum(1), kept)
        assert (kept < case.pos + 1).sum() > T // 2


def test_ties_go_to_the_lower_block():
    case = _cases()[0][0]
    q = np.zeros_like(case.q)                                   # every block scores 0
    want = np.zeros((T, T), bool)
    for p in range(T):
        n = (p + 1) // RATIO
        want[p, :min(n, BUDGET // RATIO) * RATIO] = True
        want[p, n * RATIO:p + 1] = True
    for name, got in _three(case, q, case.keys, case.pos, T):
        assert np.array_equal(got, want), name


def test_within_budget_is_causal():
    # the small budget: the rows whose complete blocks all fit in it
    case = _cases()[0][0]
    fits = (case.pos + 1) // RATIO <= BUDGET // RATIO
    assert fits.sum() == BUDGET + RATIO - 1
    assert np.array_equal(case.torch_mask()[fits], _causal(T, T)[fits])
    for name, got in _three(case, case.q, case.keys, case.pos, T):
        assert np.array_equal(got[fits], _causal(T, T)[fits]), name
    # a budget over the whole prompt: every row, on both sides, in a cache longer than the prompt
    wide = Case(0, budget=T + RATIO)
    assert np.array_equal(wide.torch_mask(), _causal(T, T))
    keys = np.pad(wide.keys, ((0, CAP - T), (0, 0)))
    for name, got in _three(wide, wide.q, keys, wide.pos, CAP):
        assert np.array_equal(got, _causal(T, CAP)), name


def _garbage_cache(keys, upto, fill):
    """A cache of CAP rows holding keys[:upto], then `fill` (a number, or an array of CAP rows)."""
    cache = np.full((CAP, keys.shape[1]), fill, np.float32) if np.isscalar(fill) else fill.copy()
    cache[:upto] = keys[:upto]
    return cache


def test_decode_one_query_at_a_time():
    noise = np.random.default_rng(1).normal(0.0, 100.0, (CAP, 16)).astype(np.float32)
    for case, fill in zip(_cases()[0], (np.nan, 0.0, noise)):
        want = case.torch_mask()
        for p in range(T):
            cache = _garbage_cache(case.keys, p + 1, fill)
            q_pos = np.array([p], np.int32)
            for name, got in _three(case, case.q[p:p + 1], cache, q_pos, CAP):
                assert got.shape == (1, CAP), name
                assert np.array_equal(got[0, :T], want[p]) and not got[0, T:].any(), (name, p)


def test_prompt_in_parts():
    case = _cases()[0][1]
    want = case.torch_mask()
    parts = ((0, 13), (13, 20), (33, 15))                       # starts and lengths, not aligned to blocks
    assert sum(n for _, n in parts) == T
    for start, n in parts:
        cache = _garbage_cache(case.keys, start + n, np.nan)
        q, q_pos = case.q[start:start + n], case.pos[start:start + n]
        for name, got in _three(case, q, cache, q_pos, CAP):
            assert got.shape == (n, CAP), name
            assert np.array_equal(got[:, :T], want[start:start + n]) and not got[:, T:].any(), (name, start)
