"""Typed, frozen configuration: `ServeConfig` for `strata serve`, loaded from a TOML file with CLI flags on top.

Every `strata serve` flag has a config-file key of the same name with `-` written as `_` (`--max-context` ->
`max_context`). Precedence: command-line flag > config file > STRATA_* environment variable (only STRATA_API_KEY) >
default. A key that is unknown, or a value of the wrong type or outside its range, is a ConfigError that names the key
and what is allowed.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from strata.errors import ConfigError

# Prompt parts are padded to strata.engine.PART_BUCKETS; the largest bucket bounds the part size.
MAX_PREFILL = 16384
MAX_CONTEXT_LIMIT = 1 << 22
BACKENDS = ("auto", "jax", "sycl")
DTYPES = ("auto", "float32", "bfloat16")
KV_FORMATS = ("auto", "int8", "bfloat16", "float32")
KERNELS = ("auto", "xla", "pallas")
MISS_POLICIES = ("fetch", "cpu")

# Environment variables the serve config reads (the STRATA_* registry of this group).
ENV_VARS = {"api_key": "STRATA_API_KEY"}


@dataclass(frozen=True)
class ServeConfig:
    model: str = "demo"                  # checkpoint directory, .gguf file, or "demo"
    host: str = "127.0.0.1"              # loopback unless told otherwise
    port: int = 8080                     # 0 picks a free port (the startup line names it)
    parallel: int = 2                    # sequences decoded together (slots)
    prefill: int = 512                   # prompt part size: prompts are read in parts of at most this many tokens
    max_context: int = 32768             # tokens of one sequence: prompt + generated
    queue_limit: int = 16                # requests waiting for a slot; beyond it: 503 with Retry-After
    lookahead: bool = True               # steady decoding dispatches the next window before reading this one
    max_body_bytes: int = 16 * 1024 * 1024  # request bodies larger than this get 413
    api_key: str | None = None           # when set, every route but /health needs `Authorization: Bearer KEY`
    backend: str = "jax"                 # jax | sycl | auto
    dtype: str = "auto"                  # auto | float32 | bfloat16
    kv: str = "auto"                     # the KV cache: auto (the weights' dtype) | int8 (+ a scale per token, head)
    device: str | None = None            # the backend's device: e.g. "gpu", "cpu" (jax); "level_zero:gpu:0" (sycl)
    kernels: str = "auto"                # jax: auto (Pallas where it measured faster, on a GPU) | xla | pallas
    # experts (see strata/experts/): device slots, host mirror, misses, prompt-part staging, adaptive placement
    expert_cache: int | str = "auto"     # device slots: "auto" (as many as fit) or a number of experts
    resident_budget_gib: float | None = None  # host RAM for the expert mirror (None: all experts)
    stream_experts: bool = False         # no host mirror: misses are read from the pack on SSD
    vram_reserve_mib: int = 0            # device memory the memory plan leaves untouched
    miss_policy: str = "fetch"           # decode misses: fetch (copy into a slot) | cpu (compute on the CPU)
    prefill_borrow: bool = True          # prompt parts stream experts through borrowed cache slots
    window_fetch: bool = True            # decode windows copy misses from pinned host memory themselves
    adapt_every: int = 1                 # windows between adaptive swaps (0: off)
    adapt_swaps: int = 8                 # experts swapped at most per adaptation
    adapt_decay: float = 0.99            # per-window decay of the routing counts
    profile: str | None = None           # routing profile (strata profile) for the initial placement
    host_chunk_mib: int = 1024           # largest single pinned allocation of the host mirror (seed 002)
    debug_slots: bool = False            # check every slot a computation reads against the pack (slow)
    compile_cache: str | None = None     # jax: directory of the persistent compilation cache (restarts load from it)

    def engine_options(self) -> dict:
        """The Engine.load options this config sets."""
        keys = ("max_context", "prefill", "dtype", "kv", "kernels", "expert_cache", "resident_budget_gib", "stream_experts",
                "vram_reserve_mib", "miss_policy", "prefill_borrow", "window_fetch", "adapt_every", "adapt_swaps", "adapt_decay",
                "profile", "host_chunk_mib", "debug_slots")
        out = {k: getattr(self, k) for k in keys}
        out["sequences"] = self.parallel
        if self.device:
            out["device"] = self.device
        return out

    def __post_init__(self):
        for f in fields(self):
            _check(f.name, getattr(self, f.name))

    @property
    def model_name(self) -> str:
        """The name responses and /v1/models carry: the model path's basename, or "demo"."""
        if self.model == "demo":
            return "demo"
        return Path(self.model).name or str(self.model)

    def describe(self) -> str:
        return ", ".join(f"{f.name}={'***' if f.name == 'api_key' and self.api_key else getattr(self, f.name)!r}"
                         for f in fields(self))


# key -> (type description, check(value) -> bool, allowed description)
def _int_range(lo: int, hi: int):
    return ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
            f"an integer in [{lo}, {hi}]")


def _choice(values: tuple[str, ...]):
    return ("a string", lambda v: isinstance(v, str) and v in values, "one of " + ", ".join(values))


def _nonempty_str(what: str):
    return ("a string", lambda v: isinstance(v, str) and v.strip() != "" and "\n" not in v, what)


def _bool():
    return ("a boolean", lambda v: isinstance(v, bool), "true or false")


def _nonempty_str_or_none(what: str):
    return ("a string", lambda v: v is None or (isinstance(v, str) and v.strip() != "" and "\n" not in v), what)


_RULES: dict[str, tuple[str, Any, str]] = {
    "model": _nonempty_str("a checkpoint directory, a .gguf file, or 'demo'"),
    "host": _nonempty_str("an IP address or host name to listen on, e.g. 127.0.0.1 or 0.0.0.0"),
    "port": _int_range(0, 65535),
    "parallel": _int_range(1, 64),
    "prefill": _int_range(1, MAX_PREFILL),
    "max_context": _int_range(16, MAX_CONTEXT_LIMIT),
    "queue_limit": _int_range(1, 65536),
    "max_body_bytes": _int_range(1024, 1 << 31),
    "api_key": ("a string", lambda v: v is None or (isinstance(v, str) and v != "" and v == v.strip()
                                                     and v.isprintable()),
                "a non-empty printable string without surrounding spaces"),
    "backend": _choice(BACKENDS),
    "dtype": _choice(DTYPES),
    "kv": _choice(KV_FORMATS),
    "kernels": _choice(KERNELS),
    "device": ("a string", lambda v: v is None or (isinstance(v, str) and v.strip() != "" and "\n" not in v),
               "a device string such as gpu, cpu (jax) or level_zero:gpu:0, opencl:cpu (sycl)"),
    "expert_cache": ("an integer or \"auto\"", lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool)
                                                                          and 1 <= v <= 1 << 24),
                     "\"auto\" or a number of experts in [1, 16777216]"),
    "resident_budget_gib": ("a number", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                and 0 <= v <= 1 << 20),
                            "a number of GiB >= 0"),
    "stream_experts": _bool(),
    "vram_reserve_mib": _int_range(0, 1 << 24),
    "miss_policy": _choice(MISS_POLICIES),
    "prefill_borrow": _bool(),
    "lookahead": _bool(),
    "window_fetch": _bool(),
    "adapt_every": _int_range(0, 1 << 20),
    "adapt_swaps": _int_range(0, 1 << 20),
    "adapt_decay": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1,
                    "a number in (0, 1]"),
    "profile": _nonempty_str_or_none("a profile file written by strata profile"),
    "host_chunk_mib": _int_range(1, 2047),
    "debug_slots": _bool(),
    "compile_cache": _nonempty_str_or_none("a directory for JAX's persistent compilation cache"),
}
KEYS = tuple(f.name for f in fields(ServeConfig))
assert set(KEYS) == set(_RULES)


def _check(key: str, value: Any, where: str = "") -> None:
    _, ok, allowed = _RULES[key]
    if not ok(value):
        raise ConfigError(f"{where}{key} = {_toml_value(value)} is not allowed; {key} must be {allowed}")


def _toml_value(v: Any) -> str:
    """The value as it is written in TOML, with its type where that is the problem."""
    import json
    if isinstance(v, bool):
        return f"{str(v).lower()} (a boolean)"
    if isinstance(v, str):
        return f"{json.dumps(v)} (a string)"
    if isinstance(v, float):
        return f"{v!r} (a float)"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list):
        return "an array"
    return f"{v!r} ({type(v).__name__})"


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value pairs of a serve config file; unknown keys and wrong types are ConfigErrors naming the key."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    where = f"{path}: "
    for key, value in data.items():
        if key not in _RULES:
            hint = _close_key(key)
            raise ConfigError(f"{where}unknown key {key!r}{hint}; allowed keys: {', '.join(KEYS)}")
        _check(key, value, where)
    return data


def _close_key(key: str) -> str:
    import difflib
    norm = key.replace("-", "_")
    if norm in _RULES:
        return f" (did you mean {norm!r}? keys use underscores)"
    close = difflib.get_close_matches(norm, KEYS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_serve_config(path: str | os.PathLike | None = None, overrides: Mapping[str, Any] | None = None,
                      env: Mapping[str, str] | None = None) -> ServeConfig:
    """Defaults <- STRATA_API_KEY <- the TOML file at `path` <- `overrides` (CLI flags; None values are ignored)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for key, var in ENV_VARS.items():
        if env.get(var):
            values[key] = env[var]
    if path is not None:
        values.update(load_toml(path))
    for key, value in (overrides or {}).items():
        if key not in _RULES:
            raise ConfigError(f"unknown setting {key!r}; allowed: {', '.join(KEYS)}")
        if value is not None:
            _, ok, allowed = _RULES[key]
            if not ok(value):
                raise ConfigError(f"{flag_name(key)} {value} is not allowed; {key} must be {allowed}")
            values[key] = value
    return ServeConfig(**values)


# The KV cache's formats (EngineOptions.kv): auto is the weights' dtype; int8 keeps a float32 scale per token and
# KV head beside the values (strata/backend.py quantize_kv).
KV_DTYPES = {"auto": None, "int8": np.int8, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}

# Prompt parts are padded up to one of these token counts, so compilations are bounded (one per bucket used).
PART_BUCKETS = (1, 8, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "auto"          # float32 | bfloat16 | auto (bfloat16 on a GPU, float32 on a CPU)
    kv: str = "auto"             # the attention layers' KV cache: auto (the weights' dtype) | int8 | bfloat16 | float32
    max_context: int = 4096      # tokens of one sequence (prompt + generated)
    prefill: int = 1024          # prompt part size: a prompt is read in parts of at most this many tokens
    device: str | None = None    # backend device kind ("cpu", "gpu"); None: the backend's default
    kernels: str = "auto"        # jax: auto (Pallas where it measured faster, on a GPU) | xla | pallas
    sequences: int = 1           # sequence states the memory plan makes room for (the server's parallel slots)
    # --- experts (strata/experts/): where they live and how misses are served
    expert_cache: int | str = "auto"     # device slots: "auto" (as many as fit) or a number of experts
    resident_budget_gib: float | None = None   # host RAM for the expert mirror; None: every expert
    stream_experts: bool = False         # no host mirror: misses are read from the pack
    vram_reserve_mib: int = 0            # device memory the plan leaves untouched
    miss_policy: str = "fetch"           # decode misses: "fetch" (copy into a slot) | "cpu" (compute on the CPU)
    prefill_borrow: bool = True          # prompt parts stream experts through borrowed cache slots
    window_fetch: bool = True            # decode windows copy misses from pinned host memory themselves
    staging_slots: int = 0               # with prefill_borrow off: slots reserved for prompt parts (0: auto)
    adapt_every: int = 1                 # windows between adaptive swaps (0: off)
    adapt_swaps: int = 8                 # swaps at most per adaptation
    adapt_decay: float = 0.99            # per-window decay of routing counts
    profile: str | None = None           # routing profile (strata profile) for the initial placement
    host_chunk_mib: int = 1024           # largest single host allocation of the mirror
    debug_slots: bool = False            # check every slot a computation reads against the pack (slow)

    @staticmethod
    def from_kwargs(kw: dict) -> "EngineOptions":
        known = {f.name for f in fields(EngineOptions)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        opts = EngineOptions(**kw)
        if opts.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype {opts.dtype!r} is not allowed; allowed: auto, float32, bfloat16")
        if opts.kv not in KV_DTYPES:
            raise ConfigError(f"kv {opts.kv!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")
        for name in ("max_context", "prefill"):
            v = getattr(opts, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, found {v!r}")
        if opts.prefill > PART_BUCKETS[-1]:
            raise ConfigError(f"prefill must be at most {PART_BUCKETS[-1]}, found {opts.prefill}")
        _check_expert_options(opts)
        return opts


def bucket_for(n: int) -> int:
    return next(b for b in PART_BUCKETS if b >= n)


def _check_expert_options(o: EngineOptions) -> None:
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    ec = o.expert_cache
    need(ec == "auto" or (isinstance(ec, int) and not isinstance(ec, bool) and ec >= 1),
         f"expert_cache must be 'auto' or a positive number of experts, found {ec!r}")
    need(o.resident_budget_gib is None or o.resident_budget_gib >= 0,
         f"resident_budget_gib must be >= 0, found {o.resident_budget_gib!r}")
    need(isinstance(o.vram_reserve_mib, int) and o.vram_reserve_mib >= 0,
         f"vram_reserve_mib must be an integer >= 0, found {o.vram_reserve_mib!r}")
    need(o.miss_policy in MISS_POLICIES, f"miss_policy {o.miss_policy!r} is not allowed; allowed: "
         f"{', '.join(MISS_POLICIES)}")
    for name in ("staging_slots", "adapt_every", "adapt_swaps"):
        v = getattr(o, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{name} must be an integer >= 0, found {v!r}")
    need(isinstance(o.sequences, int) and o.sequences >= 1, f"sequences must be an integer >= 1, found {o.sequences!r}")
    need(isinstance(o.host_chunk_mib, int) and 1 <= o.host_chunk_mib <= 2047,
         f"host_chunk_mib must be an integer in 1 .. 2047 (a window's copy kernel addresses a chunk with 32-bit "
         f"offsets), found {o.host_chunk_mib!r}")
    for name in ("stream_experts", "prefill_borrow", "window_fetch", "debug_slots"):
        need(isinstance(getattr(o, name), bool), f"{name} must be true or false, found {getattr(o, name)!r}")
    need(0.0 < o.adapt_decay <= 1.0, f"adapt_decay must be in (0, 1], found {o.adapt_decay!r}")
