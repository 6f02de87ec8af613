"""Engine: load a model, own the backend and the sequence state, read prompts in parts, decode.

The facade tests and the CLI use:
    engine = Engine.load("demo" | checkpoint_dir | file.gguf, backend="jax", **options)
    engine.logits(token_ids) -> np.float32 [T, vocab]
    engine.generate(token_ids, max_tokens, temperature=0.0, seed=None) -> list[int]
    engine.tokenizer
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from strata.backend import get_backend
from strata.errors import ConfigError, ModelLoadError, StrataError
from strata.model.config import ModelConfig
from strata.model.forward import forward, init_state
from strata.model.params import build_params

# Prompt parts are padded up to one of these token counts, so compilations are bounded (one per bucket used).
PART_BUCKETS = (1, 8, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "auto"          # float32 | bfloat16 | auto (bfloat16 on a GPU, float32 on a CPU)
    max_context: int = 4096      # tokens of one sequence (prompt + generated)
    prefill: int = 1024          # prompt part size: a prompt is read in parts of at most this many tokens
    device: str | None = None    # backend device kind ("cpu", "gpu"); None: the backend's default

    @staticmethod
    def from_kwargs(kw: dict) -> "EngineOptions":
        known = {f.name for f in fields(EngineOptions)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        opts = EngineOptions(**kw)
        if opts.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype {opts.dtype!r} is not allowed; allowed: auto, float32, bfloat16")
        for name in ("max_context", "prefill"):
            v = getattr(opts, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, found {v!r}")
        if opts.prefill > PART_BUCKETS[-1]:
            raise ConfigError(f"prefill must be at most {PART_BUCKETS[-1]}, found {opts.prefill}")
        return opts


def bucket_for(n: int) -> int:
    return next(b for b in PART_BUCKETS if b >= n)


def load_source(path_or_name: str | os.PathLike):
    """-> (HF config dict, TensorSource, directory holding the tokenizer or None)."""
    if str(path_or_name) == "demo":
        from strata.demo import demo_model_dir
        path_or_name = demo_model_dir()
    path = Path(path_or_name)
    if path.is_file() and path.suffix == ".gguf":
        from strata.weights.gguf_reader import read_gguf
        config, tensors = read_gguf(path)
        return config, tensors, path.parent
    if path.is_dir():
        from strata.weights.hf_dir import read_hf_dir
        config, tensors = read_hf_dir(path)
        return config, tensors, path
    what = "is a file but not a .gguf file" if path.is_file() else "not found"
    raise ModelLoadError(f"model {str(path_or_name)!r} {what}: pass a Hugging Face checkpoint directory, "
                         f"a .gguf file, or 'demo'")


class Engine:
    def __init__(self, cfg: ModelConfig, params: dict, backend, options: EngineOptions, tokenizer=None):
        self.cfg, self.params, self.backend, self.options = cfg, params, backend, options
        self.tokenizer = tokenizer
        self.dtype = params["embed"].dtype
        # KV rows beyond max_context absorb the padding of the last part, so a write never runs off the cache
        self.capacity = options.max_context + bucket_for(min(options.prefill, options.max_context))
        ops = backend
        self._read = ops.compile(partial(forward, ops, cfg), donate_argnums=(1,), static_argnames=("all_logits",))
        self._decode = ops.compile(partial(_decode_step, ops, cfg), donate_argnums=(1,))
        self._sample = ops.compile(partial(_sample, ops))
        self._compiled: dict = {}

    def compiled(self, name: str, make):
        """One compiled function per engine and name (its shapes are cached inside), so every runner over this
        engine shares its compilations."""
        if name not in self._compiled:
            self._compiled[name] = make()
        return self._compiled[name]

    @classmethod
    def load(cls, path_or_name: str | os.PathLike = "demo", backend: str = "jax", **options) -> "Engine":
        opts = EngineOptions.from_kwargs(options)
        ops = get_backend(backend, **({"device": opts.device} if opts.device else {}))
        config, tensors, tok_dir = load_source(path_or_name)
        cfg = ModelConfig.from_hf(config, source=f"{path_or_name} config")
        dtype = opts.dtype
        if dtype == "auto":
            dtype = "float32" if getattr(getattr(ops, "device", None), "platform", "cpu") == "cpu" else "bfloat16"
        np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        params = ops.to_device(build_params(cfg, tensors, np_dtype))
        tokenizer = None
        if tok_dir is not None and (Path(tok_dir) / "tokenizer.json").exists():
            from strata.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_dir(Path(tok_dir))
        return cls(cfg, params, ops, opts, tokenizer)

    # --- sequences
    def sequence(self) -> "Sequence":
        return Sequence(self)

    def logits(self, token_ids, part_size: int | None = None) -> np.ndarray:
        """Logits at every prompt position, [T, vocab] float32, for a fresh sequence."""
        return self.sequence().read(token_ids, part_size=part_size, all_logits=True)

    def stream(self, token_ids, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               stop_token_ids=None) -> Iterator[int]:
        """Yields generated token ids one at a time; stops after max_tokens or at a stop token (which is yielded)."""
        _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed)
        if max_tokens == 0:
            return
        stops = set(self.eos_token_ids if stop_token_ids is None else stop_token_ids)
        seq = self.sequence()
        if len(token_ids) + max_tokens > self.options.max_context:
            raise StrataError(f"prompt of {len(token_ids)} tokens plus max_tokens {max_tokens} exceeds "
                              f"max_context {self.options.max_context}")
        seed = secrets.randbits(63) if seed is None else seed
        sp = _sampling_arrays(temperature, top_k, top_p, min_p)
        seed_arr = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0x7FFFFFFF], np.uint32)
        logits = seq.read(token_ids, all_logits=False, as_numpy=False)
        token = int(self._sample(logits, *sp, seed_arr, np.int32(0))[0])
        for step in range(1, max_tokens + 1):
            yield token
            if token in stops or step == max_tokens:
                return
            token = seq.decode(token, sp, seed_arr, step)

    def generate(self, token_ids, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 **sampling) -> list[int]:
        return list(self.stream(token_ids, max_tokens, temperature=temperature, seed=seed, **sampling))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return tuple(self.tokenizer.eos_token_ids)
        return self.cfg.eos_token_ids


class Sequence:
    """One sequence's state on the device and its position."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.pos = 0
        self.state = engine.backend.to_device(init_state(engine.cfg, engine.capacity, engine.dtype))

    def read(self, token_ids, part_size: int | None = None, all_logits: bool = False, as_numpy: bool = True):
        """Read prompt tokens in parts; -> logits of every token read [n, V], or of the last one [1, V]."""
        e = self.engine
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise StrataError("a prompt needs at least one token")
        if ids.min() < 0 or ids.max() >= e.cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= e.cfg.vocab_size)][0])
            raise StrataError(f"token id {bad} is outside the vocabulary 0..{e.cfg.vocab_size - 1}")
        if self.pos + n > e.options.max_context:
            raise StrataError(f"{self.pos + n} tokens exceed max_context {e.options.max_context}")
        part = min(part_size or e.options.prefill, e.options.prefill)
        if part < 1:
            raise StrataError(f"part_size must be >= 1, found {part_size}")
        out = []
        for s in range(0, n, part):
            chunk = ids[s:s + part]
            b = bucket_for(len(chunk))
            padded = np.zeros(b, np.int32)
            padded[:len(chunk)] = chunk
            logits, self.state = e._read(e.params, self.state, padded, np.int32(self.pos), np.int32(len(chunk)),
                                         all_logits=all_logits)
            self.pos += len(chunk)
            if all_logits:
                out.append(e.backend.to_host(logits)[:len(chunk)])
        if all_logits:
            return np.concatenate(out, axis=0)
        return e.backend.to_host(logits) if as_numpy else logits

    def decode(self, token: int, sp, seed_arr, step: int) -> int:
        """Feed one token, sample the next (on the device); -> the sampled token id."""
        e = self.engine
        if self.pos + 1 > e.options.max_context:
            raise StrataError(f"{self.pos + 1} tokens exceed max_context {e.options.max_context}")
        nxt, self.state = e._decode(e.params, self.state, np.array([token], np.int32), np.int32(self.pos), *sp,
                                    seed_arr, np.int32(step))
        self.pos += 1
        return int(nxt[0])


def _sample(ops, logits, temperature, top_k, top_p, min_p, seed, step):
    """One sequence's sampling step: seed uint32 [2], step int32 scalar."""
    keys = ops.prng_keys(seed[None], step[None])
    return ops.sample(logits, temperature, top_k, top_p, min_p, keys)


def _decode_step(ops, cfg, params, state, token, pos, temperature, top_k, top_p, min_p, seed, step):
    logits, state = forward(ops, cfg, params, state, token, pos, 1, all_logits=False)
    return _sample(ops, logits, temperature, top_k, top_p, min_p, seed, step), state


def _sampling_arrays(temperature, top_k, top_p, min_p):
    return (np.array([temperature], np.float32), np.array([top_k], np.int32),
            np.array([top_p], np.float32), np.array([min_p], np.float32))


def _check_sampling(max_tokens, temperature, top_k, top_p, min_p, seed):
    def need(ok, msg):
        if not ok:
            raise StrataError(msg)
    need(isinstance(max_tokens, int) and max_tokens >= 0, f"max_tokens must be an integer >= 0, found {max_tokens!r}")
    need(0.0 <= temperature <= 100.0, f"temperature must be in [0, 100], found {temperature}")
    need(isinstance(top_k, int) and top_k >= 0, f"top_k must be an integer >= 0 (0 = off), found {top_k!r}")
    need(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], found {top_p}")
    need(0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], found {min_p}")
    need(seed is None or (isinstance(seed, int) and 0 <= seed < 2 ** 63),
         f"seed must be an integer in [0, 2^63), found {seed!r}")
