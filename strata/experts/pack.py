"""The pack: a model rewritten for serving experts from SSD, as one directory.

pack.json (the manifest), experts.bin (every routed expert as one blob of a strata.weights.quant layout, (layer position
p, expert e) at (p * n_experts + e) * nbytes, aligned for direct I/O so one read moves one expert), checksums.bin (a
crc32 per blob), dense.safetensors (every other tensor, under its Hugging Face name and stored dtype) and the tokenizer
files copied from the source. `write_pack` is resumable (pack.partial.json records its progress), re-reads every blob
against its checksum, and writes pack.json last: a directory holds a pack exactly when it holds pack.json. `PackReader`
reads one. The files, the manifest's keys and the write protocol: docs/formats.md.
"""
from __future__ import annotations

import json
import operator
import os
import re
import shutil
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from strata.builtin import builtin_dir
from strata.errors import ConfigError, ModelLoadError, StrataError
from strata.weights import quant
from strata.weights.dequant import Dequantized
from strata.weights.hf_dir import SafetensorsFile

PACK_FORMAT = "strata-pack"
PACK_VERSION = 1
MANIFEST = "pack.json"
PARTIAL = "pack.partial.json"
EXPERTS = "experts.bin"
CHECKSUMS = "checksums.bin"
DENSE = "dense.safetensors"
PACK_FILES = (MANIFEST, PARTIAL, EXPERTS, CHECKSUMS, DENSE)
BLOB_ALIGN = 4096

# a routed expert's weight, in either layout (per expert, or transformers' fused [E, ...] tensors)
_EXPERT_NAME = re.compile(r"^(?:model|mtp)\.layers\.\d+\.mlp\.experts\.")
# files of a checkpoint directory that are its weights or its config (not copied: the pack holds them its own way)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz")
_WEIGHT_NAMES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
# beside a .gguf file (a folder that may hold anything), only these are copied
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
                    "added_tokens.json", "preprocessor_config.json")

_ST_DTYPES = {np.dtype(v): k for k, v in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}.items()}

Progress = Callable[[int, int], None]


class PackIndexError(StrataError, IndexError):
    """A (layer, expert) the pack does not hold; the message names the allowed ones."""


# ------------------------------------------------------------------------------------------------------ writing


class _Plan:
    """Which tensors are experts, where each layer's experts come from, and in what order they are stored."""

    def __init__(self, config: dict, names: set[str], source: str):
        from strata.model.config import ModelConfig
        from strata.model.params import expert_layer_prefixes, text_prefix
        cfg = ModelConfig.from_hf(config, source=f"{source} config")
        self.E, self.I, self.H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.layers: list[int] = [i for i in range(cfg.num_layers) if cfg.is_sparse_layer(i)]
        self.prefixes = expert_layer_prefixes(cfg, text_prefix(names.__contains__))
        self.mtp_layer = None
        mtp = "mtp.layers.0.mlp."
        if self.E and (mtp + "experts.gate_up_proj" in names or mtp + "experts.0.gate_proj.weight" in names):
            self.mtp_layer = cfg.num_layers
            self.layers.append(cfg.num_layers)
            self.prefixes.append(mtp)
        self.fused = [p + "experts.gate_up_proj" in names for p in self.prefixes]
        self.expert_names: set[str] = set()
        for p, fused in zip(self.prefixes, self.fused):
            if fused:
                self.expert_names |= {p + "experts.gate_up_proj", p + "experts.down_proj"}
            else:
                self.expert_names |= {f"{p}experts.{e}.{m}_proj.weight" for e in range(self.E)
                                      for m in ("gate", "up", "down")}
        stray = sorted(n for n in names if _EXPERT_NAME.match(n) and n not in self.expert_names)
        if stray:
            raise ModelLoadError(f"{source}: tensor {stray[0]} looks like a routed expert weight, but the config "
                                 f"gives experts only to layers {self.layers} ({self.E} experts each, per-expert "
                                 f"gate/up/down_proj.weight or fused gate_up_proj + down_proj)"
                                 + (f"; {len(stray) - 1} more like it" if len(stray) > 1 else ""))
        self.dense = sorted(n for n in names if n not in self.expert_names)

    @property
    def total(self) -> int:
        return len(self.layers) * self.E


class _LayerExperts:
    """The routed experts of one layer, read from the source one at a time (float32, shapes checked)."""

    def __init__(self, src, prefix: str, fused: bool, plan: _Plan):
        self.src, self.p, self.plan = src, prefix, plan
        E, I, H = plan.E, plan.I, plan.H
        if fused:
            self.gate_up = self._get(prefix + "experts.gate_up_proj", (E, 2 * I, H))
            self.down = self._get(prefix + "experts.down_proj", (E, H, I))
        else:
            self.gate_up = None

    def _get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        try:
            a = self.src.get(name)
        except KeyError:
            raise ModelLoadError(f"tensor {name} is missing (looked in {self.src.where(name)}); "
                                 f"expected shape {list(shape)}") from None
        if tuple(a.shape) != tuple(shape):
            raise ModelLoadError(f"tensor {name} in {self.src.where(name)} has shape {list(a.shape)}, "
                                 f"expected {list(shape)}")
        return a

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        I, H = self.plan.I, self.plan.H
        if self.gate_up is not None:
            gate, up, down = self.gate_up[e, :I], self.gate_up[e, I:], self.down[e]
        else:
            q = f"{self.p}experts.{e}."
            gate = self._get(q + "gate_proj.weight", (I, H))
            up = self._get(q + "up_proj.weight", (I, H))
            down = self._get(q + "down_proj.weight", (H, I))
        return tuple(np.asarray(w, np.float32) for w in (gate, up, down))

    def stored_nvfp4(self, e: int) -> list | None:
        """Expert e's three matrices as an NVFP4 checkpoint stores them (quant.nvfp4_blob's parts), or None."""
        if self.gate_up is not None or not isinstance(self.src, Dequantized):
            return None
        q = f"{self.p}experts.{e}."
        parts = [self.src.nvfp4_parts(q + f"{m}_proj.weight") for m in quant.MATRICES]
        return None if any(part is None for part in parts) else parts


def _source_identity(model) -> dict:
    """What a partial pack was made from: the resolved path and the size and mtime of its weight files."""
    path = (builtin_dir(model) or Path(model)).resolve()
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file()
                       and (p.name in _WEIGHT_NAMES or p.suffix in _WEIGHT_SUFFIXES))
    return {"path": str(path),
            "files": {p.name: {"bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files}}


def _extra_files(model, tok_dir) -> list[Path]:
    """The files beside the weights that the pack carries over (tokenizer, chat template, generation config...)."""
    if tok_dir is None:
        return []
    tok_dir = Path(tok_dir)
    src = builtin_dir(model) or Path(model)
    gguf = src.is_file()
    out = []
    for p in sorted(tok_dir.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.name in PACK_FILES:
            continue
        if gguf:
            if p.name in _TOKENIZER_FILES:
                out.append(p)
        elif p.name not in _WEIGHT_NAMES and p.suffix not in _WEIGHT_SUFFIXES:
            out.append(p)
    return out


def _write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(value, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_json(path: Path, what: str) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not readable JSON ({type(e).__name__}: {e}); expected {what}") from None
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(d).__name__}; expected {what} (a JSON object)")
    return d


def _partial_mismatch(old: dict, new: dict) -> list[str]:
    diffs = []
    if old.get("experts") != new["experts"]:
        diffs.append(f"expert format {old.get('experts')!r} there, {new['experts']!r} asked for")
    old_src, new_src = old.get("source") or {}, new["source"]
    if old_src.get("path") != new_src["path"]:
        diffs.append(f"source {old_src.get('path')!r} there, {new_src['path']!r} asked for")
    elif old_src.get("files") != new_src["files"]:
        changed = sorted(set(old_src.get("files") or {}) ^ set(new_src["files"])) or \
            sorted(n for n in new_src["files"] if (old_src.get("files") or {}).get(n) != new_src["files"][n])
        diffs.append(f"the source's weight files changed since ({', '.join(changed)})")
    for key in ("layout", "n_experts", "expert_layers", "blob_bytes"):
        if not diffs and old.get(key) != new[key]:
            diffs.append(f"{key} {old.get(key)!r} there, {new[key]!r} now")
    return diffs


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"pack output {out} exists and is not a directory")
    if (out / MANIFEST).exists() and not force:
        raise ConfigError(f"{out} already holds a pack ({MANIFEST}); pass --force (force=True) to overwrite it")
    if force:
        for name in PACK_FILES:
            for p in (out / name, out / (name + ".tmp")):
                if p.exists():
                    p.unlink()
    elif out.is_dir() and not (out / PARTIAL).exists():
        others = sorted(p.name for p in out.iterdir())
        if others:
            raise ConfigError(f"pack output {out} is not empty and holds no pack ({', '.join(others[:5])}"
                              f"{', ...' if len(others) > 5 else ''}); choose a new or empty directory, or pass "
                              f"--force (force=True) to write into it")
    out.mkdir(parents=True, exist_ok=True)


def write_pack(model, out, fmt: str, progress: Progress | None = None, force: bool = False,
               workers: int | None = None) -> Path:
    """Write the pack of `model` (anything strata.engine.load_source accepts) to directory `out` with routed experts
    in format `fmt` (one of strata.weights.quant.FORMATS). Resumes an interrupted write of the same source and
    format; `force` overwrites an existing or mismatched (partial) pack. `progress(done, total)` is called once at
    the start and after each blob is written. Returns the pack directory."""
    from strata.weights.source import load_source
    if fmt not in quant.FORMATS:
        raise ConfigError(f"unknown expert format {fmt!r}; allowed: {', '.join(quant.FORMATS)}")
    out = Path(out)
    config, src, tok_dir = load_source(model)
    plan = _Plan(config, set(src.names()), str(model))
    if not plan.layers:
        raise ModelLoadError(f"{model} has no routed experts (num_experts {plan.E}, no sparse layer): there is "
                             f"nothing to pack")
    lay = quant.layout(fmt, plan.H, plan.I)
    nb = lay.nbytes
    if nb % BLOB_ALIGN:
        raise AssertionError(f"blob stride {nb} is not a multiple of {BLOB_ALIGN}")
    _prepare_out(out, force)
    state = {
        "format": PACK_FORMAT + "-partial", "version": PACK_VERSION, "experts": fmt,
        "source": _source_identity(model), "layout": lay.describe(), "n_experts": plan.E,
        "expert_layers": plan.layers, "blob_bytes": nb, "blobs_total": plan.total, "blobs_done": 0,
    }
    partial = out / PARTIAL
    done = 0
    if partial.exists():
        old = _read_json(partial, "the record of an unfinished pack")
        diffs = _partial_mismatch(old, state)
        if diffs:
            raise ConfigError(f"{out} holds an unfinished pack that does not match this one: {'; '.join(diffs)}. "
                              f"Rerun with the same model and format to finish it, or pass --force (force=True) to "
                              f"start over")
        done = int(old.get("blobs_done", 0))
    done = _resume_point(out, done, nb)
    state["blobs_done"] = done
    _write_json_atomic(partial, state)

    _write_experts(out, src, plan, lay, state, progress, workers)
    _verify_all(out, plan, lay, state)
    _write_dense(out / DENSE, src, plan.dense)
    extra = []
    for p in _extra_files(model, tok_dir):
        shutil.copyfile(p, out / p.name)
        extra.append(p.name)
    manifest = {
        "format": PACK_FORMAT, "version": PACK_VERSION,
        "config": config,
        "experts": fmt,
        "layout": lay.describe(),
        "n_experts": plan.E,
        "expert_layers": plan.layers,
        "mtp_layer": plan.mtp_layer,
        "blob_bytes": nb,
        "experts_bytes": plan.total * nb,
        "files": {"experts": EXPERTS, "checksums": CHECKSUMS, "dense": DENSE, "copied": extra},
        "dense_tensors": len(plan.dense),
        "source": dict(state["source"], model=str(model)),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "strata_version": _version(),
    }
    _write_json_atomic(out / MANIFEST, manifest)
    partial.unlink()
    _fsync_dir(out)
    return out


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("strata")
    except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return "unknown"


def _resume_point(out: Path, done: int, nb: int) -> int:
    """How many blobs of an unfinished pack can be kept: at most what the record says and the files hold, and only
    up to the last one that still matches its checksum (the last is re-read; earlier ones are checked at the end)."""
    if done <= 0:
        return 0
    eb, cb = out / EXPERTS, out / CHECKSUMS
    if not eb.exists() or not cb.exists():
        return 0
    done = min(done, eb.stat().st_size // nb, cb.stat().st_size // 4)
    sums = np.fromfile(cb, dtype="<u4", count=done)
    with open(eb, "rb") as f:
        while done > 0:
            f.seek((done - 1) * nb)
            if zlib.crc32(f.read(nb)) == int(sums[done - 1]):
                break
            done -= 1
    return done


def _write_experts(out: Path, src, plan: _Plan, lay, state: dict, progress: Progress | None,
                   workers: int | None) -> None:
    E, nb, total = plan.E, lay.nbytes, plan.total
    done = state["blobs_done"]
    partial = out / PARTIAL
    mode = "r+b" if done and (out / EXPERTS).exists() else "wb"
    with open(out / EXPERTS, mode) as fb, open(out / CHECKSUMS, mode) as fc:
        fb.truncate(done * nb)
        fc.truncate(done * 4)
        fb.seek(done * nb)
        fc.seek(done * 4)

        def record():
            fb.flush()
            fc.flush()
            os.fsync(fb.fileno())
            os.fsync(fc.fileno())
            state["blobs_done"] = done
            _write_json_atomic(partial, state)

        if progress:
            progress(done, total)
        workers = workers or min(8, os.cpu_count() or 1)
        pending: deque = deque()

        def write_one():
            nonlocal done
            blob, crc = pending.popleft().result()
            if blob.dtype != np.uint8 or blob.nbytes != nb:
                raise AssertionError(f"encode_expert gave {blob.nbytes} bytes, the layout says {nb}")
            fb.write(memoryview(blob))
            fc.write(struct.pack("<I", crc))
            done += 1
            if progress:
                progress(done, total)

        try:
            with ThreadPoolExecutor(workers) as pool:
                for p, (prefix, fused) in enumerate(zip(plan.prefixes, plan.fused)):
                    if (p + 1) * E <= done:
                        continue
                    experts = _LayerExperts(src, prefix, fused, plan)

                    def encode(e, experts=experts):
                        stored = experts.stored_nvfp4(e) if lay.fmt == "nvfp4" else None
                        blob = quant.nvfp4_blob(lay, stored) if stored is not None else \
                            quant.encode_expert(lay, *experts.expert(e))
                        return blob, zlib.crc32(blob)

                    try:
                        for e in range(max(done - p * E, 0), E):
                            pending.append(pool.submit(encode, e))
                            if len(pending) >= 2 * workers:
                                write_one()
                        while pending:
                            write_one()
                    finally:
                        for f in pending:
                            f.cancel()
                        pending.clear()
                    record()
        except BaseException:
            # keep what is complete: blobs [0, done) and their checksums are written; a rerun continues there
            try:
                record()
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise


def _drop_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so the verification reads what the disk holds."""
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _verify_all(out: Path, plan: _Plan, lay, state: dict) -> None:
    """Re-read every blob and check it against its checksum; a bad one is recorded as the resume point."""
    nb, total, E = lay.nbytes, plan.total, plan.E
    eb = out / EXPERTS
    size = eb.stat().st_size
    if size != total * nb or (out / CHECKSUMS).stat().st_size != total * 4:
        raise StrataError(f"{eb} has {size} bytes after writing, expected {total * nb}: rerun to finish the pack")
    _drop_cache(eb)
    sums = np.fromfile(out / CHECKSUMS, dtype="<u4")
    buf = bytearray(nb)
    with open(eb, "rb", buffering=0) as f:
        for k in range(total):
            n = f.readinto(buf)
            if n != nb or zlib.crc32(buf) != int(sums[k]):
                state["blobs_done"] = k
                _write_json_atomic(out / PARTIAL, state)
                raise StrataError(f"{eb}: the blob of layer {plan.layers[k // E]} expert {k % E} (offset {k * nb}) "
                                  f"does not match its checksum when read back: the disk or filesystem changed it. "
                                  f"Rerun to rewrite it and what follows")


def _write_dense(path: Path, src, names: Iterable[str]) -> None:
    """A safetensors file of `names` in their stored dtypes. Each tensor is read once and written at once to a side
    file per element size; the file is then header + those side files, widest elements first (safetensors wants
    the data contiguous; this order keeps every tensor aligned to its element size)."""
    tmp = path.with_name(path.name + ".tmp")
    groups: dict[int, tuple[Path, list, list[int]]] = {}     # itemsize -> (side file, entries, [bytes so far])
    handles = {}
    try:
        for name in names:
            a = np.ascontiguousarray(src.get(name))
            if a.dtype not in _ST_DTYPES:
                raise ModelLoadError(f"tensor {name} in {src.where(name)} has dtype {a.dtype}, which a pack cannot "
                                     f"store; storable: {', '.join(sorted(_ST_DTYPES.values()))}")
            size = a.dtype.itemsize
            if size not in groups:
                side = path.with_name(f"{path.name}.{size}.tmp")
                handles[size] = open(side, "wb")
                groups[size] = (side, [], [0])
            side, entries, used = groups[size]
            handles[size].write(memoryview(a.reshape(-1).view(np.uint8)))
            entries.append((name, _ST_DTYPES[a.dtype], list(a.shape), used[0], used[0] + a.nbytes))
            used[0] += a.nbytes
        for f in handles.values():
            f.close()
        header: dict = {"__metadata__": {"format": "pt"}}
        base = 0
        for size in sorted(groups, reverse=True):
            side, entries, used = groups[size]
            for name, dt, shape, a, b in entries:
                header[name] = {"dtype": dt, "shape": shape, "data_offsets": [base + a, base + b]}
            base += used[0]
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-(8 + len(hb)) % 8)
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for size in sorted(groups, reverse=True):
                with open(groups[size][0], "rb") as d:
                    shutil.copyfileobj(d, f, 16 << 20)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        for f in handles.values():
            f.close()
        for side, _, _ in groups.values():
            side.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------ reading


def is_pack(path) -> bool:
    """A directory holding pack.json with "format": "strata-pack"."""
    m = Path(path) / MANIFEST
    try:
        return Path(path).is_dir() and json.loads(m.read_text()).get("format") == PACK_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class PackDense:
    """TensorSource over a pack's dense.safetensors (every tensor but the routed experts)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = SafetensorsFile(path)

    def names(self):
        return self.file.header.keys()

    def get(self, name: str) -> np.ndarray:
        return self.file.get(name)

    def where(self, name: str) -> str:
        return str(self.path)


class PackReader:
    """A written pack, opened and checked: the manifest is validated and every file's size checked at open."""

    def __init__(self, path):
        self.dir = Path(path)
        m = self.dir / MANIFEST
        want = f"a Strata pack manifest ({MANIFEST} with \"format\": \"{PACK_FORMAT}\", \"version\": {PACK_VERSION})"
        if not m.exists():
            hint = (f"it holds an unfinished pack ({PARTIAL}): rerun `strata pack` to finish it"
                    if (self.dir / PARTIAL).exists() else "write one with `strata pack`")
            raise ModelLoadError(f"{self.dir} is not a Strata pack: no {MANIFEST} in it; {hint}")
        d = _read_json(m, want)
        if d.get("format") != PACK_FORMAT:
            raise ModelLoadError(f"{m} has format {d.get('format')!r}; expected {want}")
        if d.get("version") != PACK_VERSION:
            raise ModelLoadError(f"{m} is pack version {d.get('version')!r}; this Strata reads version "
                                 f"{PACK_VERSION}: re-pack the model with this version's `strata pack`")
        for key, kind in (("config", dict), ("layout", dict), ("n_experts", int), ("expert_layers", list),
                          ("files", dict)):
            if not isinstance(d.get(key), kind) or isinstance(d.get(key), bool):
                raise ModelLoadError(f"{m}: key '{key}' must be a JSON {kind.__name__}, found {d.get(key)!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in d["expert_layers"]):
            raise ModelLoadError(f"{m}: expert_layers must list layer indices, found {d['expert_layers']!r}")
        mtp = d.get("mtp_layer")
        if mtp is not None and (not isinstance(mtp, int) or mtp not in d["expert_layers"]):
            raise ModelLoadError(f"{m}: mtp_layer must be null or one of expert_layers, found {mtp!r}")
        self.manifest = d
        try:
            self.layout = quant.BlobLayout.from_dict(d["layout"])
        except ModelLoadError as e:
            raise ModelLoadError(f"{m}: {e}") from None
        from strata.model.config import ModelConfig
        cfg = ModelConfig.from_hf(d["config"], source=f"{m} config")
        if (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size) != \
                (d["n_experts"], self.layout.hidden, self.layout.inter):
            raise ModelLoadError(f"{m}: n_experts {d['n_experts']} and the blob layout (hidden {self.layout.hidden}, "
                                 f"inter {self.layout.inter}) disagree with its config (num_experts "
                                 f"{cfg.num_experts}, hidden_size {cfg.hidden_size}, moe_intermediate_size "
                                 f"{cfg.moe_intermediate_size})")
        self.config: dict = d["config"]
        self.n_experts: int = d["n_experts"]
        self.expert_layers: tuple[int, ...] = tuple(d["expert_layers"])
        self.mtp_layer: int | None = mtp
        self.format: str = self.layout.fmt
        self.blob_bytes: int = self.layout.nbytes
        self._pos = {layer: p for p, layer in enumerate(self.expert_layers)}
        files = d["files"]
        self.experts_path = self.dir / str(files.get("experts", EXPERTS))
        self.checksums_path = self.dir / str(files.get("checksums", CHECKSUMS))
        self.dense_path = self.dir / str(files.get("dense", DENSE))
        n = len(self.expert_layers) * self.n_experts
        self.n_blobs = n
        for path, want_size, what in ((self.experts_path, n * self.blob_bytes, f"{n} blobs of {self.blob_bytes}"),
                                      (self.checksums_path, n * 4, f"{n} uint32 checksums")):
            if not path.exists():
                raise ModelLoadError(f"{path} is missing: the pack {self.dir} needs it ({what} bytes)")
            size = path.stat().st_size
            if size != want_size:
                state = "truncated" if size < want_size else "larger than its manifest says"
                raise ModelLoadError(f"{path} is {state}: expected {want_size} bytes ({what} bytes), found "
                                     f"{size}; re-pack the model")
        if not self.dense_path.exists():
            raise ModelLoadError(f"{self.dense_path} is missing: the pack {self.dir} needs it")
        self._dense = PackDense(self.dense_path)          # reads the header: a truncated file is refused here
        self._sums = np.fromfile(self.checksums_path, dtype="<u4")
        self._map = None
        self._fd = None

    # --- indexing
    def position(self, layer: int) -> int:
        """The position p of model layer `layer` among the layers with experts (the blob row)."""
        try:
            return self._pos[operator.index(layer)]
        except (KeyError, TypeError):
            raise PackIndexError(f"layer {layer!r} has no experts in the pack {self.dir}; layers with experts: "
                                 f"{_ranges(self.expert_layers)}"
                                 + (f" ({self.mtp_layer} is the MTP layer)" if self.mtp_layer is not None else "")
                                 ) from None

    def index(self, layer: int, expert: int) -> int:
        """The blob number of (layer, expert): p * n_experts + expert."""
        p = self.position(layer)
        try:
            e = operator.index(expert)
        except TypeError:
            e = None
        if e is None or not 0 <= e < self.n_experts:
            raise PackIndexError(f"expert {expert!r} is out of range: the pack {self.dir} has experts "
                                 f"0..{self.n_experts - 1} per layer")
        return p * self.n_experts + e

    def offset(self, layer: int, expert: int) -> int:
        """Byte offset of the blob in experts.bin (a multiple of 4096)."""
        return self.index(layer, expert) * self.blob_bytes

    # --- blobs
    def blob(self, layer: int, expert: int) -> np.ndarray:
        """The blob as a read-only uint8 view into a memory map of experts.bin."""
        off = self.offset(layer, expert)
        if self._map is None:
            self._map = np.memmap(self.experts_path, dtype=np.uint8, mode="r")
        return self._map[off:off + self.blob_bytes]

    def read_blob(self, layer: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """The blob read with pread into `out` (uint8, contiguous, at least blob_bytes) or a fresh array; returns
        the filled uint8 [blob_bytes] array."""
        off = self.offset(layer, expert)
        nb = self.blob_bytes
        if out is None:
            out = np.empty(nb, np.uint8)
        else:
            if out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable or out.size < nb:
                raise ValueError(f"read_blob needs a writable contiguous uint8 buffer of at least {nb} bytes, got "
                                 f"{out.dtype} {out.shape}")
            out = out.reshape(-1)[:nb]
        if self._fd is None:
            self._fd = os.open(self.experts_path, os.O_RDONLY)
        mv = memoryview(out)
        got = 0
        while got < nb:
            n = os.preadv(self._fd, [mv[got:]], off + got)
            if n <= 0:
                raise ModelLoadError(f"{self.experts_path}: read of layer {layer} expert {expert} ended after "
                                     f"{got} of {nb} bytes at offset {off}: the file was truncated")
            got += n
        return out

    def checksum(self, layer: int, expert: int) -> int:
        """The blob's recorded zlib.crc32."""
        return int(self._sums[self.index(layer, expert)])

    def verify(self, layer: int, expert: int, data) -> bool:
        """Whether `data` (the blob's bytes) matches the recorded checksum."""
        want = self.checksum(layer, expert)
        return zlib.crc32(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data) == want

    def expert_tensors(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, H], up [I, H], down [H, I]) float32, decoded from the blob."""
        return quant.decode_expert(self.layout, self.blob(layer, expert))

    def dense(self) -> PackDense:
        """TensorSource over dense.safetensors."""
        return self._dense

    # --- lifetime
    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._map = None

    def __enter__(self) -> "PackReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        return (f"PackReader({str(self.dir)!r}: {self.n_experts} experts x {len(self.expert_layers)} layers in "
                f"{self.format}, {self.blob_bytes} bytes each)")


def _ranges(xs: Iterable[int]) -> str:
    xs = sorted(xs)
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ", ".join(parts) or "none"
