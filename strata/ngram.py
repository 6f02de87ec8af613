"""qwen4_exp's PLE n-gram ids: the rows of the hashed n-gram table each token looks up, as transformers computes them.

Heads come in blocks of `heads_per_ngram` per order k = 2..ngram_size. For token t the order-k hash is
XOR over s < k of token[t - s] * multipliers[s] (exact, < 2^63), its id `hash % head_sizes[h] + head_offsets[h]`.
A token before the sequence or at/before the last EOS strictly before t counts as EOS; an EOS starts a new history.
A sequence is read in parts, each carrying the previous `ngram_size - 1` tokens (EOS at the start) as its context.
`ngram_spec` derives the constants; `ngram_ids_reference` is the int64 numpy definition; `ngram_ids` gives the
same ids with 32-bit integer ops only (for numpy, or traced under jax.jit with x64 off; `xp` is either namespace).
A leaf module (numpy only): the model's PLE layer and the demo-flash checkpoint writer both use it.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15        # SplitMix64's increment; also spaces the per-position seeds
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007              # seed step between PLE layers
_INT32_LIMIT = 1 << 31
_LIMB = 16                         # limb width: a limb times a limb fits uint32
_LIMB_MASK = (1 << _LIMB) - 1
_HASH_LIMBS = 4                    # the hash is < 2^63: four 16-bit limbs


@dataclass(frozen=True)
class NgramSpec:
    """The static constants of one PLE layer's n-gram hashing (hashable: a jit static argument)."""
    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    multipliers: tuple[int, ...]   # [ngram_size], odd, < 2^63 // vocab_size so token * multiplier < 2^63
    head_sizes: tuple[int, ...]    # [heads] primes, each head's hash bucket count
    head_offsets: tuple[int, ...]  # [heads] each head's first row in the shared table
    table_rows: int                # the table's rows: the sizes' sum padded to `divisible_by`, < 2^31

    @property
    def heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_len(self) -> int:
        """Tokens a part carries over from the previous one."""
        return self.ngram_size - 1

    @property
    def hash_bits(self) -> int:
        """An upper bound on the bit length of any hash of in-vocabulary tokens."""
        return max(((self.vocab_size - 1) * m).bit_length() for m in self.multipliers)


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def _multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> tuple[int, ...]:
    # odd multipliers below 2^63 // vocab_size, so every product token * multiplier is a non-negative int64
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_layer_index
    return tuple(2 * (_splitmix64((base + _GAMMA * (s + 1)) & _MASK64) % half) + 1 for s in range(ngram_size))


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (these bases are exact for n < 3.3e24): trial division is slow near 2^31."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.lru_cache(maxsize=None)
def _primes_from(start: int, count: int) -> tuple[int, ...]:
    """The first `count` primes >= start (cached: every PLE layer's search starts at the same base)."""
    found, n = [], start
    while len(found) < count:
        if _is_prime(n):
            found.append(n)
        n += 1
    return tuple(found)


def ngram_spec(vocab_size: int, ngram_size: int, heads_per_ngram: int, vocab_size_base: int, divisible_by: int,
               seed: int, ple_layer_index: int, eos_token_id: int | Sequence[int]) -> NgramSpec:
    """The constants of PLE layer number `ple_layer_index` (its rank among the PLE layers, from 0). The global head
    g = ple_layer_index * heads + h gets the (g + 1)-th prime >= vocab_size_base. A list of EOS ids uses the first,
    as transformers does."""
    if isinstance(eos_token_id, Sequence):
        if not eos_token_id:
            raise ConfigError("eos_token_id must be set for the PLE n-gram ids, got an empty list")
        eos_token_id = eos_token_id[0]
    eos_token_id = int(eos_token_id)
    if not 1 <= vocab_size < _INT32_LIMIT:
        raise ConfigError(f"ngram vocab_size must be in [1, 2^31) (int32 token ids), got {vocab_size}")
    if ngram_size < 2 or heads_per_ngram < 1:
        raise ConfigError(f"ngram_size must be >= 2 and heads_per_ngram >= 1, got {ngram_size}, {heads_per_ngram}")
    if not 0 <= eos_token_id < vocab_size:
        raise ConfigError(f"eos_token_id must be a token id below vocab_size {vocab_size}, got {eos_token_id}")
    if vocab_size_base < 1 or divisible_by < 1 or ple_layer_index < 0:
        raise ConfigError(f"ngram_vocab_size_base, make_ngram_vocab_size_divisible_by must be >= 1 and the PLE "
                          f"layer index >= 0, got {vocab_size_base}, {divisible_by}, {ple_layer_index}")
    heads = (ngram_size - 1) * heads_per_ngram
    sizes = _primes_from(vocab_size_base, (ple_layer_index + 1) * heads)[ple_layer_index * heads:]
    offsets = tuple(sum(sizes[:h]) for h in range(heads))
    table_rows = -(-sum(sizes) // divisible_by) * divisible_by
    # ids are int32 on device, and the bit-serial remainder needs every prime < 2^31
    if table_rows >= _INT32_LIMIT:
        raise ConfigError(f"the PLE n-gram table has {table_rows} rows, which int32 ids cannot index "
                          f"(ngram_vocab_size_base {vocab_size_base}, {heads} heads)")
    return NgramSpec(vocab_size=vocab_size, ngram_size=ngram_size, heads_per_ngram=heads_per_ngram,
                     eos_token_id=eos_token_id, multipliers=_multipliers(vocab_size, ngram_size, ple_layer_index, seed),
                     head_sizes=sizes, head_offsets=offsets, table_rows=table_rows)


def ngram_ids_reference(spec: NgramSpec, context, tokens) -> tuple[np.ndarray, np.ndarray]:
    """ids [T, heads] int64 of `tokens` [T] read after `context` [context_len] (the previous tokens, EOS at a
    sequence start), and the next part's context: the last context_len tokens of context + tokens."""
    n_ctx, eos = spec.context_len, spec.eos_token_id
    ctx = np.asarray(context, np.int64).reshape(n_ctx)
    toks = np.asarray(tokens, np.int64).reshape(-1)
    if toks.size and (toks.min() < 0 or toks.max() >= spec.vocab_size):
        raise ValueError(f"token ids must be in [0, {spec.vocab_size})")
    n = toks.shape[0]
    history = np.concatenate([ctx, toks])
    ids = np.zeros((n, spec.heads), np.int64)
    cut = np.zeros(n, bool)      # an EOS lies in tokens t-s .. t-1: token t-s belongs to an earlier sequence
    mixed = toks * spec.multipliers[0]
    for s in range(1, spec.ngram_size):
        back = history[n_ctx - s:n_ctx - s + n]
        cut |= back == eos
        mixed = mixed ^ (np.where(cut, eos, back) * spec.multipliers[s])
        block = slice((s - 1) * spec.heads_per_ngram, s * spec.heads_per_ngram)
        ids[:, block] = mixed[:, None] % np.array(spec.head_sizes[block]) + np.array(spec.head_offsets[block])
    return ids, history[n:]


def _mul_limbs(xp, tok_lo, tok_hi, multiplier: int) -> list:
    """The 16-bit limbs (uint32 arrays, low first) of token * multiplier mod 2^64, the token given as two limbs.
    Every partial product of two limbs fits uint32; a column sums at most four 16-bit halves plus a carry."""
    m_limbs = [(multiplier >> (_LIMB * b)) & _LIMB_MASK for b in range(_HASH_LIMBS)]
    cols = [xp.zeros_like(tok_lo) for _ in range(_HASH_LIMBS)]
    for a, t in enumerate((tok_lo, tok_hi)):
        for b, m in enumerate(m_limbs):
            k = a + b
            if k >= _HASH_LIMBS or m == 0:
                continue
            part = t * xp.uint32(m)
            cols[k] = cols[k] + (part & _LIMB_MASK)
            if k + 1 < _HASH_LIMBS:
                cols[k + 1] = cols[k + 1] + (part >> _LIMB)
    out, carry = [], xp.zeros_like(tok_lo)
    for col in cols:
        col = col + carry
        out.append(col & _LIMB_MASK)
        carry = col >> _LIMB
    return out


def _bit_field(xp, limbs, lo: int, width: int):
    """Bits lo .. lo + width - 1 (width <= 31) of the number held in 16-bit `limbs`, as uint32."""
    out = xp.zeros_like(limbs[0])
    for j, limb in enumerate(limbs):
        first = _LIMB * j
        if first + _LIMB <= lo or first >= lo + width:
            continue
        out = out | (limb << (first - lo) if first >= lo else limb >> (lo - first))
    return out & ((1 << width) - 1)


def ngram_ids(xp, spec: NgramSpec, context, tokens, start, n_valid):
    """`ngram_ids_reference`'s ids as int32 [T, heads], and the next context int32 [context_len], with 32-bit integer
    ops only. `start` (int32 scalar) is tokens[0]'s position: 0 replaces `context` with EOS. Rows >= `n_valid`
    are padding: hashed as EOS, in range, and not read by the real rows or the new context. With n_valid == 0
    the context passes through (EOS if start == 0). Static loops only, so `start` and `n_valid` may be traced."""
    n_ctx, eos = spec.context_len, spec.eos_token_id
    toks = xp.asarray(tokens).astype(xp.int32)
    n = toks.shape[0]
    ctx = xp.where(xp.asarray(start) == 0, eos, xp.asarray(context).astype(xp.int32)).astype(xp.int32)
    n_valid = xp.minimum(xp.maximum(xp.asarray(n_valid, dtype=xp.int32), 0), n)
    toks = xp.where(xp.arange(n, dtype=xp.int32) < n_valid, toks, eos).astype(xp.int32)
    history = xp.concatenate([ctx, toks])
    new_context = history[n_valid + xp.arange(n_ctx, dtype=xp.int32)]

    # the token s back from each row, EOS where an EOS lies in between (the reference's `cut`)
    back = [toks]
    is_eos = history == eos
    cut = None
    for s in range(1, spec.ngram_size):
        window = slice(n_ctx - s, n_ctx - s + n)
        cut = is_eos[window] if cut is None else cut | is_eos[window]
        back.append(xp.where(cut, eos, history[window]))

    # each order's hash as 16-bit limbs: products by the static multipliers, XORed limb by limb
    orders, mixed = [], None
    for s, (tok, mult) in enumerate(zip(back, spec.multipliers)):
        t = tok.astype(xp.uint32)
        prod = _mul_limbs(xp, t & _LIMB_MASK, t >> _LIMB, mult)
        mixed = prod if mixed is None else [x ^ y for x, y in zip(mixed, prod)]
        if s >= 1:
            orders.append(mixed)
    # [T, heads] per limb: an order's hash repeated over its heads_per_ngram heads
    shape = (n, spec.ngram_size - 1, spec.heads_per_ngram)
    limbs = [xp.broadcast_to(xp.stack([o[j] for o in orders], axis=-1)[:, :, None], shape).reshape(n, spec.heads)
             for j in range(_HASH_LIMBS)]

    # exact remainder, high bits first, k bits a step: r < p <= 2^B (B the largest prime's bit length) keeps
    # (r << k) | chunk below 2^32 for k = 32 - B, and uint32 `%` reduces it. (Each step reads r once: a chain of
    # selects reading r twice a step made XLA's CPU compiler take minutes at one row.) The top bits of the hash are a
    # remainder already while they number fewer than every prime's bit length, so they start r.
    primes = xp.asarray(spec.head_sizes, dtype=xp.uint32)
    bits = spec.hash_bits
    top = min(min(p.bit_length() for p in spec.head_sizes) - 1, bits)
    step = 32 - max(p.bit_length() for p in spec.head_sizes)
    r = _bit_field(xp, limbs, bits - top, top) if top else xp.zeros_like(limbs[0])
    at = bits - top                                   # bits below `at` are still to be taken in
    while at > 0:
        k = min(step, at)
        at -= k
        r = ((r << k) | _bit_field(xp, limbs, at, k)) % primes
    ids = (r + xp.asarray(spec.head_offsets, dtype=xp.uint32)).astype(xp.int32)
    return ids, new_context.astype(xp.int32)
