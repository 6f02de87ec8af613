"""Settings, declared once: frozen, typed groups (model, experts, sched, serve, backend, ray) gathered in
`Settings`. Each field is a `setting(default, rule, help)`: its one name, default, allowed values and help. From the fields come
the flat TOML keys (the field's name), the CLI flags (`max_context` -> `--max-context`), Engine.load's keywords,
configs/demo.toml and docs/configuration.md (`make docs`). `check` is the one
validation: an unknown key, or a value of the wrong type or outside its range, is a ConfigError naming the key (or
flag), the value and what is allowed. Precedence: flag > config file > environment (Spec.env) > default.
"""
from __future__ import annotations

import difflib
import json
import os
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from strata.builtin import is_builtin
from strata.errors import ConfigError

# The KV cache's formats (ModelSettings.kv): auto is the weights' dtype; int8 keeps a float32 scale per token and
# KV head beside the values (strata/backend.py quantize_kv).
KV_DTYPES = {"auto": None, "int8": np.int8, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}

# Prompt parts are padded up to one of these token counts, so compilations are bounded (one per bucket used).
PART_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def bucket_for(n: int) -> int:
    return next(b for b in PART_BUCKETS if b >= n)


MAX_PREFILL = PART_BUCKETS[-1]

# The numerics paths a guard's retry can run on (SchedSettings.guard_ladder; strata/engine/numerics.py builds them).
NUMERICS_RUNGS = ("reference_ops", "float32", "cpu_experts")
MAX_CONTEXT_LIMIT = 1 << 22
# max_context auto's cap where the device does not report its free memory (a CPU)
AUTO_CONTEXT_CAP = 32768


@dataclass(frozen=True)
class Rule:
    """What a setting allows: ok(value) and the same in words ("an integer in [1, 64]")."""
    ok: Callable[[Any], bool]
    allowed: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


AUTO_DRAFTS = 4                 # spec = "auto": the drafts a slot may offer (the seeds' users run --spec 4)


def _int_range(lo: int, hi: int) -> Rule:
    return Rule(lambda v: _is_int(v) and lo <= v <= hi, f"an integer in [{lo}, {hi}]")


def _choice(*values: str) -> Rule:
    return Rule(lambda v: isinstance(v, str) and v in values, "one of " + ", ".join(values))


def _text(what: str, optional: bool = False) -> Rule:
    return Rule(lambda v: (optional and v is None) or (isinstance(v, str) and v.strip() != "" and "\n" not in v), what)


_BOOL = Rule(lambda v: isinstance(v, bool), "true or false")


def _names(v: Any) -> list[str] | None:
    """A list of names from a string (comma-separated, as a flag gives it) or an array; None when malformed."""
    items = v.split(",") if isinstance(v, str) else v if isinstance(v, list) else None
    if items is None or not items or not all(isinstance(x, str) for x in items):
        return None
    items = [x.strip() for x in items]
    return items if all(x and "\n" not in x for x in items) else None


def _name_list(what: str) -> Rule:
    return Rule(lambda v: v is None or _names(v) is not None, what)


def _ladder(v: Any) -> bool:
    names = _names(v) if v != [] else []
    return names is not None and len(set(names)) == len(names) and all(n in NUMERICS_RUNGS for n in names)


def _is_device(v) -> bool:
    """Unset, a device string, or (from Python, never a file or a flag) a backend's own device object: SYCL
    sub-devices of one device have no string of their own."""
    if v is None or isinstance(v, str):
        return v is None or (v.strip() != "" and "\n" not in v)
    return not isinstance(v, (bool, int, float, list, dict, tuple))


def _layer_split(v: Any) -> bool:
    """Unset, "auto", a layer number or comma-separated layer numbers (their order is checked at load, against the
    model's layers)."""
    if v is None or v == "auto" or (_is_int(v) and v > 0):
        return True
    return isinstance(v, str) and all(x.strip().isdigit() for x in v.split(","))


def setting(default: Any, rule: Rule, help: str, *, example: Any = None, env: str | None = None):
    """A settings field: its default, what it allows, its help (a sentence or more: flag help, TOML comment and docs
    row alike), an example value where the default is unset (configs/demo.toml shows it commented out), and the
    environment variable that fills it below the config file."""
    return field(default=default, metadata={"rule": rule, "help": help, "example": example, "env": env})


class _Group:
    def __post_init__(self):
        for f in fields(self):
            check(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class ModelSettings(_Group):
    """What to serve, in which dtype, and how long one sequence may grow."""
    model: str = setting(
        "demo", _text("a checkpoint directory, a .gguf file, a pack directory, \"demo\" or \"tiny\""),
        "What to serve: a Hugging Face checkpoint directory, a .gguf file, a pack directory (strata pack), or a "
        "built-in model: \"demo\" (random weights: its text is gibberish by design, every code path runs) or "
        "\"tiny\" (trained on Python's documentation: it answers in doc-like English). Responses and /v1/models name "
        "the model by the path's basename.")
    dtype: str = setting(
        "auto", _choice("auto", "float32", "bfloat16"),
        "The weights' dtype: auto is bfloat16 on a GPU and float32 on a CPU.")
    kv: str = setting(
        "auto", _choice(*KV_DTYPES),
        "The attention layers' KV cache: auto is the weights' dtype; int8 keeps one float32 scale per token and KV "
        "head beside the int8 values (about a quarter of float32's bytes, half of bfloat16's).")
    max_context: int | str = setting(
        "auto", Rule(lambda v: v == "auto" or (_is_int(v) and 16 <= v <= MAX_CONTEXT_LIMIT),
                     f"\"auto\" or an integer in [16, {MAX_CONTEXT_LIMIT}]"),
        "Tokens of one sequence, prompt and generated together; the sequence state is sized by it. A longer prompt "
        "gets 400 naming both numbers; a request's max_tokens defaults to what is left of it. auto: the positions "
        "the model supports (max_position_embeddings, times the factor with rope scaling), at most "
        f"{AUTO_CONTEXT_CAP} where the device does not report its free memory, and where it does, at most what "
        "lets the sequence state of every slot take half of the memory left beside the working buffers; the plan's "
        "log line says which. A number above the model's positions is refused.")
    kv_resident: int = setting(
        0, Rule(lambda v: _is_int(v) and 0 <= v <= MAX_CONTEXT_LIMIT,
                f"an integer in [0, {MAX_CONTEXT_LIMIT}] (0: every position on the device)"),
        "Tokens of attention KV each slot keeps on the device: 0 keeps every position there; N gives each slot a "
        "device window of N positions (rounded up to 64; more than a prompt part's padded size) and moves older "
        "positions to host RAM as the window fills (pinned on a GPU, where the decode kernel reads them in place: "
        "the server then runs XLA's default command-buffer mode, whose allocator leaves pinned memory usable); "
        "attention covers both parts. For contexts longer than the device's memory allows (the MTP head's own KV, "
        "with spec, stays on the device). On the sycl backend the host part is USM host memory (float32 or int8 KV) "
        "and each row's positions there are copied to the device to be attended.")
    kv_parked: int | str = setting(
        "auto", Rule(lambda v: v == "auto" or (_is_int(v) and 0 <= v <= 4096), "\"auto\" or an integer in [0, 4096]"),
        "With kv_resident: host-tier rows kept besides each slot's own for parked conversations (a conversation "
        "whose slot another request needs keeps its host KV there, by reference, and only its device window is "
        "written back; with no row free its KV is copied within checkpoint_ram_gib). Each row is pinned host RAM "
        "for max_context positions. auto: one per slot (parallel), at most half the available RAM that the slots' "
        "own rows leave; the plan line says how many.")
    ple_table: str = setting(
        "auto", _choice("auto", "device", "host", "disk"),
        "Where a qwen4_exp model's PLE n-gram table lives (Qwen3.8-Flash-Next's is 47.7 GiB in float8): device; host "
        "(RAM: each window's rows, heads x 160 values a token, are gathered on the host and copied in); disk (the "
        "checkpoint's files memory-mapped, read through the page cache: its own format only). auto: the device when "
        "the table takes at most a quarter of its free memory, else host when it takes at most half the available "
        "RAM, else disk. The plan's log line says where and how big.")
    ple_format: str = setting(
        "auto", _choice("auto", "bfloat16", "float8", "int8"),
        "The PLE table's format: auto keeps the checkpoint's (float8 e4m3 as shipped, with its scale; bfloat16; "
        "another float dtype becomes the weights' dtype); float8 (one scale for the table), int8 (one scale a row) "
        "and bfloat16 convert it at load.")
    rope_scaling: str = setting(
        "auto", _choice("auto", "none", "linear", "dynamic", "yarn"),
        "RoPE scaling, to serve contexts past the model's max_position_embeddings: auto is what the checkpoint's "
        "config says (rope_scaling or rope_parameters); none turns a checkpoint's scaling off; linear, dynamic "
        "(NTK, computed for max_context) or yarn with factor rope_scale over the checkpoint's max_position_embeddings, "
        "as transformers computes them (yarn: Qwen3-Next's model card asks for it past 262,144 tokens).")
    rope_scale: float | None = setting(
        None, Rule(lambda v: v is None or (_is_number(v) and 1 <= v <= 1024), "a number in [1, 1024]"),
        "The factor of rope_scaling (linear, dynamic, yarn): the model then supports max_position_embeddings times "
        "this many positions. With rope_scaling auto it replaces the checkpoint's own factor.", example=4.0)
    control_vector: str | list[str] | None = setting(
        None, _name_list("FILE or FILE:SCALE, or several (an array; comma-separated on the command line)"),
        "A control vector in llama.cpp's GGUF format (float32 tensors direction.N, as repeng and llama.cpp's "
        "cvector-generator write them), loaded at start-up: direction.N times SCALE (default 1) is added to the "
        "residual after layer N (0-based), as llama.cpp's --control-vector-scaled; several files add up. A request's "
        "control_vector_scale multiplies the loaded vector (default 1; 0 turns it off for that request), so rows of "
        "different scales share a window. A file that is not a control vector, or one made for another model (its "
        "size, its layers), is refused at start-up naming what is wrong.", example="happy.gguf:0.8")
    gguf_parts: str | list[str] | None = setting(
        None, _name_list("FILE, or several (an array; comma-separated on the command line)"),
        "More GGUF files whose tensors join those of the .gguf model (its metadata stays the model file's), for "
        "weights kept in files of their own: a PLE table, the token embedding, the dense weights. A gguf-split set "
        "needs none (its first shard names it). A tensor in two files, or a file of another architecture, is refused "
        "at start-up.", example="ple-table.gguf")
    vision: str = setting(
        "auto", _choice("auto", "on", "off"),
        "The vision tower of an image-text checkpoint (qwen3_5_moe, qwen4_exp: model.visual.* beside the language "
        "model): auto loads it when the checkpoint has one; on requires it (a checkpoint without one is refused at "
        "start-up); off leaves it unread, and a request with an image gets 400. Images are encoded once each and "
        "kept by their content hash.")
    max_image_pixels: int = setting(
        4194304, Rule(lambda v: _is_int(v) and 1 <= v <= 1 << 28, "an integer in [1, 268435456]"),
        "The most pixels (width x height) an image of a request may have, as sent; a larger one gets 400 naming its "
        "part. Within it, images are resized to the model's image processor limits (preprocessor_config.json; "
        "Qwen3-VL's: 65,536 to 16,777,216 pixels) as transformers resizes them.")

    @property
    def parts(self) -> tuple[str, ...]:
        """gguf_parts as a tuple of paths."""
        return tuple(_names(self.gguf_parts) or ()) if self.gguf_parts is not None else ()


@dataclass(frozen=True)
class ExpertSettings(_Group):
    """A model's routed experts: device slots, the host mirror in RAM, the pack on SSD, and how misses are served."""
    expert_cache: int | str = setting(
        "auto", Rule(lambda v: v == "auto" or (_is_int(v) and 1 <= v <= 1 << 24),
                     "\"auto\" or a number of experts in [1, 16777216]"),
        "Device expert slots: auto (as many as fit beside the sequence state and working buffers) or a number of "
        "experts.")
    resident_budget_gib: float | None = setting(
        None, Rule(lambda v: v is None or (_is_number(v) and 0 <= v <= 1 << 20), "a number of GiB in [0, 1048576]"),
        "Host RAM for the expert mirror in GiB (pinned on a GPU); unset: every expert. Experts beyond it are read "
        "from the pack on demand.", example=48.0)
    stream_experts: bool = setting(
        False, _BOOL, "No host mirror at all: every miss is one read of one blob from the pack on SSD.")
    vram_reserve_mib: int = setting(
        0, _int_range(0, 1 << 24), "Device memory in MiB that the memory plan leaves untouched.")
    miss_policy: str = setting(
        "fetch", _choice("fetch", "cpu"),
        "A decode row's expert that is not in a slot: fetch copies it in (evicting the lowest decayed routing "
        "count); cpu computes it on the CPU from the host copy.")
    prefill_borrow: bool = setting(
        True, _BOOL,
        "Prompt parts stream the experts they miss through cache slots lent to them (true), or through reserved "
        "staging slots (false: a smaller cache, the same results).")
    window_fetch: bool = setting(
        True, _BOOL,
        "With every expert mirrored in pinned host memory and miss_policy fetch, a decode window copies the experts "
        "it misses by itself, in one compiled function (true); false runs such windows layer by layer (the same "
        "results).")
    stream_parts: bool = setting(
        True, _BOOL,
        "With every expert mirrored in pinned host memory (window fetch), a prompt part whose routes outnumber a "
        "layer's experts copies each MoE layer's experts whole, the next layers' while this one computes (three "
        "layers' experts of device memory, taken from the cache); false: it copies only its misses, into borrowed "
        "slots, layer by layer (the same results).")
    staging_slots: int = setting(
        0, _int_range(0, 1 << 16),
        "With prefill_borrow off: the device slots reserved for prompt parts' experts; 0 takes one layer's experts, "
        "at most 64.")
    adapt_every: int = setting(
        1, _int_range(0, 1 << 20),
        "Windows between adaptive swaps: an absent expert replaces a resident one when its decayed routing count "
        "beats the resident's by more than the counts' noise; 0: never.")
    adapt_swaps: int = setting(8, _int_range(0, 1 << 20), "Experts swapped at most per adaptation.")
    adapt_decay: float = setting(
        0.99, Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "Per-window decay of the routing counts that adaptation follows (1: no decay).")
    profile: str | None = setting(
        None, _text("the path of a profile file", optional=True),
        "A routing profile written by `strata profile`: the initial placement puts the most-routed experts in the "
        "slots. Unset: (layer, expert) order.", example="profile.json")
    host_chunk_mib: int = setting(
        1024, _int_range(1, 2047),
        "The host mirror's largest single pinned allocation in MiB: the mirror is made of chunks of one layer's "
        "experts each, below this (a window's copy kernel addresses a chunk with 32-bit offsets). Lower it where the "
        "driver refuses large pinned allocations.")
    debug_slots: bool = setting(
        False, _BOOL, "Check every slot a computation reads against the pack's checksum (slow: for debugging).")


@dataclass(frozen=True)
class SchedSettings(_Group):
    """The scheduler: how many sequences decode together, and how prompts share windows with them."""
    parallel: int = setting(
        2, _int_range(1, 64),
        "Sequences decoded together (slots); the memory plan makes room for this many sequence states.")
    prefill: int = setting(
        512, _int_range(1, MAX_PREFILL),
        "Prompt part size in tokens: a long prompt is read in parts of at most this many tokens, with the other "
        "slots decoding between the parts.")
    window_tokens: int = setting(
        128, _int_range(1, MAX_PREFILL),
        "Token budget of a window in which slots decode: their rows come first (a token each), then a prompt being "
        "read gets the rest as one part, padded to a compiled part size no larger than the budget, so a decoding "
        "stream waits for at most that much prompt per token. With nothing decoding, prompts are read in parts of "
        "`prefill` tokens (the largest part); a budget of prefill or more leaves parts at prefill. The default is "
        "measured on the demo model on a CPU (docs/performance.md); a GPU's window costs differ (the H200's are an "
        "open measurement).")
    prompt_share: float = setting(
        0.33, Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "The share of the device time of windows in which slots decode that prompt parts may take: after a window "
        "with a part, windows carry decode rows alone until the part's time is paid back at this share, so a stream "
        "keeps most of its rate while another slot reads a long prompt, which then reads slower. 1: a part beside "
        "every window's decode rows (window_tokens alone bounds the wait). The default is measured on the demo model "
        "on a CPU (docs/performance.md); the H200's is an open measurement.")
    queue_limit: int = setting(
        16, _int_range(1, 65536), "Requests waiting for a free slot; beyond it requests get 503 with Retry-After.")
    checkpoint_every: int | str = setting(
        "auto", Rule(lambda v: v == "auto" or (_is_int(v) and 1 <= v <= 1 << 20),
                     "\"auto\" or an integer in [1, 1048576]"),
        "Prompt cache: a checkpoint of the recurrent state (linear layers) every this many tokens of a sequence, "
        "besides the ones at the start of the last assistant header of a prompt and at the end of each reply. A new "
        "prompt that shares a prefix with a stored conversation reads from the nearest checkpoint at or before the "
        "point where they differ: at most this many tokens more than its new ones. Prompt parts end at checkpoint "
        "positions, so a spacing under prefill reads long prompts in smaller parts (slower on a GPU); auto: the "
        "prefill size.")
    checkpoint_ram_gib: float = setting(
        4.0, Rule(lambda v: _is_number(v) and 0 <= v <= 4096, "a number of GiB in [0, 4096]"),
        "Prompt cache: host RAM for checkpoints and parked conversations (a conversation whose slot another request "
        "needs: its KV and checkpoints, resumed later without re-reading), least recently used first out. 0: only "
        "each slot's newest checkpoint, on the device.")
    lookahead: bool = setting(
        True, _BOOL,
        "Steady decoding (no prompt to read, nobody waiting) dispatches the next window before the last one's tokens "
        "reach the host: the tokens stay on the device. A request that stops is computed one token further, then "
        "dropped. Applies where decode windows are compiled (every expert on the device, or window_fetch), on the jax "
        "backend.")
    warm_up: bool = setting(
        True, _BOOL,
        "Compile every window shape before the server says ready, so nothing compiles under load. Off: a shape "
        "compiles the first time a window needs it (a fast start for development and tests; the first requests of "
        "each shape wait for their compilation).")
    row_buckets: bool = setting(
        True, _BOOL,
        "Decode windows are compiled for 1, 2, 4, ... rows besides all `parallel` slots, and each window runs the "
        "smallest that holds its decoding slots: idle slots are computed only to fill a bucket. Applies where "
        "`lookahead` does (compiled decode windows on the jax backend), not to windows that verify drafts (`spec`), "
        "which run every slot. Off: every window runs all slots, with fewer compilations at start-up.")
    spec: int | str = setting(
        0, Rule(lambda v: v == "auto" or (_is_int(v) and 0 <= v <= 8), "\"auto\" or an integer in [0, 8]"),
        "Speculative decoding: each generating slot drafts up to this many tokens with the model's MTP head (needs "
        "`mtp`) and the next window verifies them with the slot's next token, K + 1 positions a row; 0: off. Greedy "
        "rows keep the longest matching prefix, sampled rows the speculative-sampling rule, so the output is the "
        "model's own. A slot whose drafts are rejected drafts fewer, and no slot drafts while the measured windows "
        "say verifying costs more than it saves. Needs compiled decode windows (every expert on the device, or "
        "window_fetch) on the jax backend; windows that verify are not dispatched ahead (lookahead). auto: "
        f"{AUTO_DRAFTS} with the MTP head (mtp on) where the model has one and the windows are compiled, else off; "
        "the load log says which.")
    mtp: bool = setting(
        False, _BOOL,
        "Load the model's multi-token-prediction head (mtp.* tensors; the demo model has one): the draft model of "
        "`spec`.")
    spec_min_p: float = setting(
        0.0, Rule(lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
        "A slot stops drafting at a draft whose probability under the MTP head is below this; 0: drafts up to "
        "`spec` tokens.")
    guard_ladder: str | list[str] = setting(
        ",".join(NUMERICS_RUNGS), Rule(_ladder, "distinct names among " + ", ".join(NUMERICS_RUNGS) + " (an array; "
                                   "comma-separated on the command line), or an empty array"),
        "The numerics guard's retry ladder: a request whose row goes non-finite is retried on the next of these "
        "paths (reference_ops: XLA's ops instead of the Pallas kernels; float32: the activations in float32, the "
        "weights widened as they are read; cpu_experts: every routed expert computed on the CPU from the host tier), "
        "after its expert slots were verified and repaired, from the prompt cache's last checkpoint of its own "
        "prompt at or before the failure (else from the start). A path that would compute exactly what the engine "
        "already does (reference_ops where no Pallas kernel runs, float32 where the dtype is float32) or that this "
        "engine cannot build is left out at load, and the log says so. A second failure at the same position ends "
        "the request with the error code non_finite.")
    guard_storm: int = setting(
        3, _int_range(0, 1 << 16),
        "Non-finite failures of this many different requests within guard_storm_seconds make the engine verify "
        "every expert slot and rebuild its expert device state (0: never).")
    guard_storm_seconds: float = setting(
        600.0, Rule(lambda v: _is_number(v) and 0 < v <= 1 << 24, "a number of seconds in (0, 16777216]"),
        "The window in which guard_storm counts failures.")

    @property
    def ladder(self) -> tuple[str, ...]:
        """guard_ladder as a tuple of names."""
        return tuple(_names(self.guard_ladder) or ()) if self.guard_ladder != [] else ()

    @property
    def checkpoint_tokens(self) -> int:
        """checkpoint_every as a number of tokens (auto: prefill)."""
        return self.prefill if self.checkpoint_every == "auto" else self.checkpoint_every


@dataclass(frozen=True)
class ServeSettings(_Group):
    """The HTTP server: where it listens, what it accepts, and what it keeps across restarts."""
    host: str = setting(
        "127.0.0.1", _text("an IP address or host name, e.g. 127.0.0.1 or 0.0.0.0"),
        "Address to listen on: 127.0.0.1 is this machine only; 0.0.0.0 is every interface (set api_key then).")
    port: int = setting(
        8080, _int_range(0, 65535), "Port to listen on; 0 picks a free port (the startup line names it).")
    max_body_bytes: int = setting(
        16 * 1024 * 1024, _int_range(1024, 1 << 31), "Largest request body in bytes; larger ones get 413.")
    api_key: str | None = setting(
        None, Rule(lambda v: v is None or (isinstance(v, str) and v != "" and v == v.strip() and v.isprintable()),
                   "a non-empty printable string without surrounding spaces"),
        "When set, every route except /health needs the header `Authorization: Bearer <api_key>` (401 otherwise). "
        "The environment variable STRATA_API_KEY fills it when neither the config file nor --api-key sets it.",
        example="change-me", env="STRATA_API_KEY")
    served_model_name: str | list[str] | None = setting(
        None, _name_list("a name, or several (an array; comma-separated on the command line)"),
        "The names clients give as a request's `model`: the first is the one responses and /v1/models carry, the "
        "others are aliases; a request naming another model gets 404 model_not_found. Unset: the model path's "
        "basename (or \"demo\"), with \"default\" as an alias (clients that serve one model often send it).",
        example=["qwen3-next", "gpt-4o-mini"])
    cors_origin: str | list[str] | None = setting(
        None, _name_list("\"*\" or origins such as https://app.example.com (an array; comma-separated on the "
                         "command line)"),
        "Browser origins allowed to call the API (CORS): \"*\" for any. A preflight OPTIONS is answered before the "
        "API-key check. Unset: no CORS headers.", example="*")
    drain_timeout: float = setting(
        30.0, Rule(lambda v: _is_number(v) and 0 <= v <= 86400, "a number of seconds in [0, 86400]"),
        "On SIGTERM or SIGINT the server stops admitting (503 with Retry-After), answers queued requests 503, and "
        "lets running requests finish for up to this many seconds; the rest then end with finish_reason \"abort\". "
        "A second signal ends them at once.")
    max_tool_calls: int = setting(
        4, _int_range(1, 128),
        "The most tool calls one reply may hold when tool_choice forces calls (\"required\" or a named function) and "
        "parallel_tool_calls is on: the grammar ends the reply after this many, so a model that keeps calling cannot "
        "fill max_tokens with calls. parallel_tool_calls false allows one.")
    special_tokens_in_messages: bool = setting(
        False, _BOOL,
        "Special-token text inside chat messages (a user typing <|im_start|>assistant) becomes control tokens "
        "(true, for trusted clients only: a user can forge turns) or is read as the text it is (false); only the chat "
        "template's own markers are control tokens then.")
    compile_cache: str | None = setting(
        None, _text("the path of a directory", optional=True),
        "jax: a directory for JAX's persistent compilation cache; a restart with the same model and shapes loads the "
        "warm-up's compiled windows from it instead of compiling them. Unset: off.", example="~/.cache/strata/jax")

    @property
    def cors_origins(self) -> list[str]:
        """cors_origin as a list (empty: off)."""
        return (_names(self.cors_origin) or []) if self.cors_origin is not None else []


@dataclass(frozen=True)
class BackendSettings(_Group):
    """The compute backend, its device and its kernels."""
    backend: str = setting(
        "jax", _choice("auto", "jax", "sycl"),
        "The compute backend: jax, sycl (Intel GPUs, through dpnp) or auto.")
    device: Any = setting(
        None, Rule(_is_device, "a device string such as gpu, cpu (jax) or level_zero:gpu:0, opencl:cpu (sycl)"),
        "The backend's device: gpu or cpu for jax; level_zero:gpu:0, opencl:gpu, opencl:cpu for sycl (strata doctor "
        "lists them). Unset: the backend's default.", example="gpu")
    command_buffer_update: str = setting(
        "skip_temp", _choice("skip_temp", "xla_default"),
        "jax on an NVIDIA GPU: how XLA updates a window's command buffer (CUDA graph). skip_temp keeps its temporaries "
        "at fixed addresses (XLA's VMM allocator), so windows dispatched ahead run at the device's pace; set where the "
        "installed jaxlib knows the mode, unless XLA_FLAGS names one. That allocator leaves no pinned host memory, so "
        "window fetch is off under it: a GPU that offloads experts should set xla_default (XLA's own mode), which "
        "kv_resident implies.")
    kernels: str = setting(
        "auto", _choice("auto", "xla", "pallas"),
        "The jax backend's kernels: auto (on a GPU, the Pallas kernels that measured faster than XLA; plain XLA on a "
        "CPU), xla (plain XLA everywhere) or pallas (every Pallas kernel; interpreted on a CPU, which is slow: tests "
        "use it).")
    layer_split: Any = setting(
        None, Rule(_layer_split, "auto, or the first layer of each stage after the first (e.g. 24, or 16,32)"),
        "Split the model's layers across devices of the backend's kind (jax GPUs; sycl devices of one backend and "
        "type, or sub-devices made by strata.sycl_backend.runtime.sub_devices): auto balances the layers' bytes by "
        "each device's free memory over every device; K1,K2,... starts stage 2 at layer K1, stage 3 at K2, and so on. "
        "Each stage holds its own layers' weights, expert cache and KV; one hand-off of the hidden rows per window "
        "per boundary. Unset: one device.", example="auto")
    prefill_help: bool = setting(
        False, _BOOL,
        "With layer_split: while a prompt part runs through the first stage, the second stage's device computes a "
        "share of the first stage's routed experts (the ones missing from its cache first, up to half of those the "
        "part routes to), their weights sent from host RAM, through the same expert op. The first stage's prompt "
        "parts then run layer by layer. STRATA_PREFILL_HELP=1 turns it on.", env="STRATA_PREFILL_HELP")
    debug_nan: bool = setting(
        False, _BOOL,
        "Check every layer's output for non-finite values and log the first layer and op that produced one (slow: "
        "for finding where a non-finite row starts). The environment variable STRATA_DBG_NAN=1 turns it on.",
        env="STRATA_DBG_NAN")


@dataclass(frozen=True)
class RaySettings(_Group):
    """Scale-out on Ray Serve (pip install strata[ray]): engine replicas behind one OpenAI ingress, each
    conversation routed back to the replica whose prompt cache holds it."""
    replicas: int = setting(
        0, _int_range(0, 1024),
        "Engine replicas on Ray Serve, each one engine with its own scheduler and prompt cache behind one ingress "
        "(strata serve starts a local Ray instance); 0 serves without Ray.")
    ray_address: str | None = setting(
        None, _text("a Ray address such as auto or ray://head:10001", optional=True),
        "The Ray cluster to join (auto: the one `ray start` began on this machine). Unset: a local instance.",
        example="auto")
    gpus_per_replica: float = setting(
        0.0, Rule(lambda v: _is_number(v) and 0 <= v <= 64, "a number of GPUs in [0, 64]"),
        "GPUs Ray reserves for each engine replica (ray_actor_options num_gpus); 0 on a CPU.")
    cpus_per_replica: float = setting(
        1.0, Rule(lambda v: _is_number(v) and 0 <= v <= 1024, "a number of CPUs in [0, 1024]"),
        "CPUs Ray reserves for each engine replica (ray_actor_options num_cpus).")
    routing: str = setting(
        "affinity", _choice("affinity", "round_robin"),
        "How the ingress picks a replica: affinity (the replica whose earlier prompts share the longest prefix with "
        "this one, else the least loaded) or round_robin (in turn, ignoring the prompt).")
    affinity_block: int = setting(
        64, _int_range(1, 65536),
        "Tokens per hashed block of the affinity router's prefix tree: a prompt matches a replica in whole blocks.")
    affinity_min_tokens: int = setting(
        256, _int_range(0, 1 << 24),
        "The shortest prefix match that routes a request to its replica; a shorter one goes to the least-loaded "
        "replica (counted as an affinity miss).")
    affinity_margin: int = setting(
        4, _int_range(0, 1 << 20),
        "How many more requests in flight than the least-loaded replica the matched replica may have before the "
        "request goes to the least-loaded one instead (a fallback).")
    affinity_blocks: int = setting(
        1 << 20, _int_range(1, 1 << 30),
        "Blocks the router remembers per replica, least recently used dropped first.")


@dataclass(frozen=True)
class Faults:
    """Test-only fault injection, off by default: never from a config file, a flag or an Engine.load keyword (check
    refuses the keys); a test sets them with Settings.build(..., allow_faults=True)."""
    corrupt_slot: int | None = None                   # a device expert slot overwritten after placement (0xFF bytes,
                                                      # NaN in every float format); the host tier stays good
    nonfinite: tuple[int, int] | None = None          # (layer, position): that layer's output row is NaN there, on
                                                      # every numerics path
    replica_exit: str | None = None                   # a file's path: the Ray engine replica that removes it (one
                                                      # replica, once) kills its own process before a reply's first
                                                      # token, as a crash would


FAULT_KEYS = {"fault_corrupt_slot": ("corrupt_slot", Rule(lambda v: _is_int(v) and v >= 0, "a slot index >= 0")),
              "fault_nonfinite": ("nonfinite", Rule(lambda v: isinstance(v, tuple) and len(v) == 2
                                                    and all(_is_int(x) and x >= 0 for x in v),
                                                    "a (layer, position) pair of integers >= 0")),
              "fault_replica_exit": ("replica_exit", Rule(lambda v: isinstance(v, str) and v != "",
                                                          "a file's path"))}


GROUPS: dict[str, type] = {"model": ModelSettings, "experts": ExpertSettings, "sched": SchedSettings,
                           "serve": ServeSettings, "backend": BackendSettings, "ray": RaySettings}


@dataclass(frozen=True)
class Spec:
    """One setting as the generators and the validation see it."""
    key: str
    group: str
    default: Any
    rule: Rule
    help: str
    example: Any
    env: str | None
    types: tuple[type, ...]      # the field's types but None, in the annotation's order

    @property
    def flag(self) -> str:
        return flag_name(self.key)

    @property
    def shown_default(self) -> str:
        return _toml(self.default)

    @property
    def flag_help(self) -> str:
        return f"{self.help} Allowed: {self.rule.allowed}; default: {self.shown_default}."

    def from_text(self, text: str) -> Any:
        """A flag's text as the field's type; text no type takes stays text, for `check` to refuse in words."""
        for t in self.types:
            if t is str or t is Any:
                return text
            try:
                return t(text)
            except (ValueError, TypeError):
                pass
        return text


def _specs() -> dict[str, Spec]:
    out: dict[str, Spec] = {}
    for group, cls in GROUPS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            assert f.name not in out, f"setting {f.name} is declared twice"
            types = tuple(t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None))
            m = f.metadata
            out[f.name] = Spec(f.name, group, f.default, m["rule"], m["help"], m["example"], m["env"], types)
    return out


SPECS = _specs()
KEYS = tuple(SPECS)


@dataclass(frozen=True)
class Settings:
    """Every setting, by group: `settings.sched.parallel`, `settings.experts.miss_policy`."""
    model: ModelSettings = field(default_factory=ModelSettings)
    experts: ExpertSettings = field(default_factory=ExpertSettings)
    sched: SchedSettings = field(default_factory=SchedSettings)
    serve: ServeSettings = field(default_factory=ServeSettings)
    backend: BackendSettings = field(default_factory=BackendSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    faults: Faults = field(default_factory=Faults)

    @classmethod
    def build(cls, allow_faults: bool = False, **flat) -> "Settings":
        """The defaults with flat settings on top: Settings.build(max_context=2048, prefill=64). allow_faults: a test
        may set the fault-injection keys (FAULT_KEYS) too."""
        faults = {}
        if allow_faults:
            for key in [k for k in flat if k in FAULT_KEYS]:
                name, rule = FAULT_KEYS[key]
                value = flat.pop(key)
                if not rule.ok(value):
                    raise ConfigError(f"{key} = {value!r} is not allowed; {key} must be {rule.allowed}")
                faults[name] = value
        return replace(cls().with_values(flat), faults=Faults(**faults))

    def with_values(self, values: Mapping[str, Any], where: str = "", as_flag: bool = False) -> "Settings":
        """A copy with the flat key -> value pairs set, each checked first (`where` prefixes an error; as_flag:
        errors name the flag, as the command line wrote it)."""
        by_group: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            check(key, value, where, as_flag)
            by_group.setdefault(SPECS[key].group, {})[key] = value
        return replace(self, **{g: replace(getattr(self, g), **kv) for g, kv in by_group.items()})

    @property
    def model_name(self) -> str:
        """The name responses and /v1/models carry: served_model_name's first, else the model path's basename, or
        the built-in model's name."""
        return self.served_names[0]

    @property
    def served_names(self) -> list[str]:
        """Every name a request's `model` may give: served_model_name, else the model path's basename (or the
        built-in model's name) and "default"."""
        names = _names(self.serve.served_model_name) if self.serve.served_model_name is not None else None
        if names:
            return list(dict.fromkeys(names))
        model = self.model.model
        name = model if is_builtin(model) else Path(model).name or str(model)
        return [name, "default"]


def check(key: str, value: Any, where: str = "", as_flag: bool = False) -> None:
    """The one validation of a setting's value: a ConfigError naming the key (or its flag), the value and what the
    setting allows."""
    spec = SPECS.get(key)
    if key in FAULT_KEYS:
        raise ConfigError(f"{where}{key} is a test-only fault injection: a config file, a flag or an Engine.load "
                          f"keyword cannot set it (a test sets it with Settings.build(..., allow_faults=True))")
    if spec is None:
        raise ConfigError(f"{where}unknown key {key!r}{_close_key(key)}; allowed keys: {', '.join(KEYS)}")
    if not spec.rule.ok(value):
        if as_flag:
            shown = f"{flag_name(key)} {value if isinstance(value, str) else _toml(value)}"
        else:
            shown = f"{key} = {_toml_value(value)}"
        raise ConfigError(f"{where}{shown} is not allowed; {key} must be {spec.rule.allowed}")


def _toml_value(v: Any) -> str:
    """The value as it is written in TOML, with its type where that is the problem."""
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


def _toml(v: Any) -> str:
    """A value as TOML writes it (None: unset)."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (str, list)):
        return json.dumps(v)
    return repr(v)


def _close_key(key: str) -> str:
    norm = key.replace("-", "_")
    if norm in SPECS:
        return f" (did you mean {norm!r}? keys use underscores)"
    close = difflib.get_close_matches(norm, KEYS, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The key/value pairs of a config file; unknown keys and wrong types are ConfigErrors naming the key."""
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
    for key, value in data.items():
        check(key, value, f"{path}: ")
    return data


def load_settings(path: str | os.PathLike | None = None, flags: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> Settings:
    """Defaults <- environment variables (STRATA_API_KEY, STRATA_DBG_NAN) <- the TOML file at `path` <- `flags` (the command line's
    values; None values are ignored)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for key, spec in SPECS.items():
        if spec.env and env.get(spec.env):
            values[key] = _from_env(spec, env[spec.env])
    if path is not None:
        values.update(load_toml(path))
    for key, value in (flags or {}).items():
        if value is not None:
            check(key, value, as_flag=True)
            values[key] = value
    return Settings().with_values(values)


def _from_env(spec: Spec, text: str) -> Any:
    """An environment variable's text as the setting's type: a boolean is 1/true/yes or 0/false/no."""
    if spec.types == (bool,):
        low = text.strip().lower()
        if low in ("1", "true", "yes", "0", "false", "no"):
            return low in ("1", "true", "yes")
        raise ConfigError(f"{spec.env}={text} is not allowed; {spec.env} must be 1 or 0 (or true, false)")
    return text


# --- generated files: configs/demo.toml and docs/configuration.md

_TOML_HEAD = """\
# strata serve --config configs/demo.toml
# Generated from the settings in strata/config.py by `make docs`: edit them there.
# Every key is also a flag of `strata serve` (max_context <-> --max-context); a flag given on the command line wins
# over the file. An unknown key or a bad value stops the server with exit code 2 and a line naming the key.
# The values below are the defaults; a commented-out key is unset by default and shows an example.
"""

_MD_HEAD = """\
# Configuration

<!-- Generated by `make docs` from the settings in strata/config.py and the commands in strata/cli.py; a test keeps
this file equal to them, so edit them there. -->

Every setting has one name: the key in a TOML file given to `strata serve --config FILE.toml` (configs/demo.toml sets
each), the flag of `strata serve` (the key with `-` for `_`; a boolean also has its `--no-` form), and the keyword of
`Engine.load`. The other commands take the groups that apply to them (see Commands, at the end).

Precedence: command-line flag > config file > environment variable (STRATA_API_KEY for api_key, STRATA_DBG_NAN for
debug_nan) > default. An unknown key, or a value of the wrong type or outside its range, stops `strata serve` with
exit code 2 and one line naming the key (or flag), the value and what is allowed.
"""


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=118, initial_indent="# ", subsequent_indent="# ", break_long_words=False,
                         break_on_hyphens=False)


def demo_toml() -> str:
    """configs/demo.toml: every setting at its default (or an example, commented out), its help as the comment."""
    lines = [_TOML_HEAD.rstrip("\n")]
    for group, cls in GROUPS.items():
        lines += [""] + _comment(f"--- {group}: {cls.__doc__}")
        for spec in (s for s in SPECS.values() if s.group == group):
            lines += [""] + _comment(f"{spec.help} Allowed: {spec.rule.allowed}.")
            if spec.default is None:
                lines.append(f"# {spec.key} = {_toml(spec.example)}")
            else:
                lines.append(f"{spec.key} = {_toml(spec.default)}")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """docs/configuration.md's settings part: a table of every setting per group (strata.cli adds the commands)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [_MD_HEAD.rstrip("\n")]
    for group, cls in GROUPS.items():
        lines += ["", f"## {group}", "", cls.__doc__, "", "| key | flag | default | allowed | help |",
                  "|---|---|---|---|---|"]
        for spec in (s for s in SPECS.values() if s.group == group):
            flag = f"`{spec.flag}`" + (f", `--no-{spec.flag[2:]}`" if spec.types == (bool,) else "")
            default = f"`{spec.shown_default}`" if spec.default is not None else spec.shown_default
            lines.append(f"| `{spec.key}` | {flag} | {default} | {cell(spec.rule.allowed)} | {cell(spec.help)} |")
    lines += ["", "## Test-only fault injection", "", " ".join(Faults.__doc__.split()), "",
              "| key | allowed |", "|---|---|"]
    lines += [f"| `{key}` | {cell(rule.allowed)} |" for key, (_, rule) in FAULT_KEYS.items()]
    return "\n".join(lines) + "\n"
