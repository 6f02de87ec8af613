"""The pack format (strata/experts/pack.py) and `strata pack`, on real files: the demo model as the source (per-expert
names, an MTP layer), a fused-layout and a bf16 copy of it, and a tiny transformers checkpoint (plus its GGUF).

Every format stores exactly what quant.encode_expert gives (bit for bit); dense tensors come back in their stored
dtype and bytes; checksums catch a changed byte; truncation and bad manifests are refused at open; an interrupted
write resumes into a byte-identical pack; a mismatched or existing pack is refused unless forced.
"""
from __future__ import annotations

import io
import json
import re
import shutil
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from strata.cli import _ProgressBar, main
from strata.demo import demo_model_dir
from strata.weights.source import load_source
from strata.errors import ConfigError, ModelLoadError, StrataError
from strata.experts import pack as packmod
from strata.experts.pack import PackIndexError, PackReader, is_pack, write_pack
from strata.weights import quant

E, LAYERS = 16, [0, 1, 2, 3, 4]            # the demo: 16 experts in 4 sparse layers + the MTP layer (index 4)
TOTAL = E * len(LAYERS)


class Interrupt(Exception):
    pass


def _prefix(layer: int) -> str:
    return "mtp.layers.0.mlp." if layer == 4 else f"model.layers.{layer}.mlp."


def _source_expert(src, layer: int, e: int):
    p = f"{_prefix(layer)}experts.{e}."
    return tuple(np.asarray(src.get(p + m + "_proj.weight"), np.float32) for m in ("gate", "up", "down"))


def _files(d: Path) -> dict[str, bytes]:
    """Every file of a pack, pack.json without its creation date."""
    out = {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}
    m = json.loads(out.pop("pack.json"))
    m.pop("created")
    out["pack.json"] = json.dumps(m, sort_keys=True).encode()
    return out


def _copy_pack(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _interrupt_at(n: int):
    def progress(done, total):
        if done == n:
            raise Interrupt(f"stopped at {done}")
    return progress


@pytest.fixture(scope="module")
def demo():
    config, src, tok_dir = load_source("demo")
    return config, src, Path(tok_dir)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")
    return {fmt: write_pack("demo", root / fmt, fmt) for fmt in quant.FORMATS}


# ------------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_every_format_stores_exactly_what_encode_expert_gives(fmt, packs, demo):
    _, src, _ = demo
    r = PackReader(packs[fmt])
    lay = quant.layout(fmt, 96, 32)
    assert r.layout == lay and r.format == fmt and r.blob_bytes == lay.nbytes
    buf = np.empty(lay.nbytes + 100, np.uint8)
    for layer in LAYERS:
        for e in range(E):
            tensors = _source_expert(src, layer, e)
            want = quant.encode_expert(lay, *tensors)
            blob = r.blob(layer, e)
            assert blob.dtype == np.uint8 and blob.shape == (lay.nbytes,)
            assert np.array_equal(blob, want), (layer, e)
            assert np.array_equal(r.read_blob(layer, e), want)
            assert np.array_equal(r.read_blob(layer, e, out=buf), want)
            assert r.offset(layer, e) % 4096 == 0
            got = r.expert_tensors(layer, e)
            for g, w, s in zip(got, quant.decode_expert(lay, want), tensors):
                assert g.dtype == np.float32 and np.array_equal(g, w)
                if fmt == "f32":
                    assert np.array_equal(g, s)          # f32 reproduces the source tensors exactly
    assert np.array_equal(buf[:lay.nbytes], r.read_blob(4, 15))
    r.close()


def test_manifest_layout_and_copied_files(packs, demo):
    config, src, tok_dir = demo
    d = packs["int4"]
    m = json.loads((d / "pack.json").read_text())
    assert m["format"] == "strata-pack" and m["version"] == 1
    assert m["config"] == config
    assert m["n_experts"] == E and m["expert_layers"] == LAYERS and m["mtp_layer"] == 4
    assert quant.BlobLayout.from_dict(m["layout"]) == quant.layout("int4", 96, 32)
    assert m["files"]["experts"] == "experts.bin" and m["files"]["checksums"] == "checksums.bin"
    assert m["files"]["dense"] == "dense.safetensors"
    assert m["source"]["path"] == str(demo_model_dir().resolve()) and m["source"]["model"] == "demo"
    assert re.match(r"\d{4}-\d\d-\d\dT", m["created"])
    nb = quant.layout("int4", 96, 32).nbytes
    assert nb % 4096 == 0 and (d / "experts.bin").stat().st_size == TOTAL * nb
    assert (d / "checksums.bin").stat().st_size == TOTAL * 4
    assert not (d / "pack.partial.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / name).read_bytes() == (tok_dir / name).read_bytes()
        assert name in m["files"]["copied"]
    assert not (d / "config.json").exists() and not (d / "model.safetensors").exists()
    assert sorted(p.name for p in d.iterdir() if p.suffix == ".tmp") == []
    r = PackReader(d)
    assert r.config == config and r.n_experts == E and r.expert_layers == tuple(LAYERS) and r.mtp_layer == 4
    assert r.dir == d and r.position(4) == 4
    assert is_pack(d) and not is_pack(tok_dir) and not is_pack(d / "pack.json")


def test_dense_tensors_round_trip_exactly(packs, demo):
    _, src, _ = demo
    dense = PackReader(packs["int8"]).dense()
    names = sorted(dense.names())
    expert = [n for n in src.names() if ".mlp.experts." in n]
    assert len(expert) == TOTAL * 3
    assert names == sorted(set(src.names()) - set(expert))
    assert "mtp.layers.0.mlp.gate.weight" in names and "model.layers.0.mlp.shared_expert.up_proj.weight" in names
    plain = load_file(str(packs["int8"] / "dense.safetensors"))      # the official reader agrees
    assert sorted(plain) == names
    for n in names:
        a, b = src.get(n), dense.get(n)
        assert a.dtype == b.dtype == plain[n].dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes() == plain[n].tobytes(), n
    assert dense.where(names[0]) == str(packs["int8"] / "dense.safetensors")
    with pytest.raises(KeyError):
        dense.get("model.layers.0.mlp.experts.0.up_proj.weight")


def test_bf16_checkpoint_keeps_bf16_dense_and_exact_f32_experts(demo, tmp_path):
    config, src, tok_dir = demo
    ck = tmp_path / "bf16"
    shutil.copytree(tok_dir, ck)
    keep_f32 = ("A_log", "dt_bias", "norm.weight")          # as real checkpoints do: a mix of bf16 and f32
    save_file({n: np.asarray(src.get(n)).astype(np.float32 if n.endswith(keep_f32) else ml_dtypes.bfloat16)
               for n in src.names()}, str(ck / "model.safetensors"), metadata={"format": "pt"})
    _, bsrc, _ = load_source(ck)
    out = write_pack(ck, tmp_path / "pack", "f32")
    r = PackReader(out)
    dense = r.dense()
    emb = dense.get("model.embed_tokens.weight")
    assert emb.dtype == np.dtype(ml_dtypes.bfloat16)
    assert emb.tobytes() == bsrc.get("model.embed_tokens.weight").tobytes()
    assert load_file(str(out / "dense.safetensors"))["lm_head.weight"].dtype.name == "bfloat16"
    plain = load_file(str(out / "dense.safetensors"))
    dtypes = set()
    for n in dense.names():
        a = dense.get(n)
        dtypes.add(a.dtype.name)
        assert a.dtype == bsrc.get(n).dtype == plain[n].dtype and a.tobytes() == bsrc.get(n).tobytes(), n
        assert a.ctypes.data % a.dtype.itemsize == 0                  # every tensor aligned to its element size
    assert dtypes == {"bfloat16", "float32"}
    for layer, e in ((0, 0), (3, 7), (4, 15)):
        for g, s in zip(r.expert_tensors(layer, e), _source_expert(bsrc, layer, e)):
            assert np.array_equal(g, s)                   # bf16 widened to f32 exactly


def test_fused_layout_packs_identically(packs, demo, tmp_path):
    config, src, tok_dir = demo
    ck = tmp_path / "fused"
    shutil.copytree(tok_dir, ck)
    tensors = {n: np.asarray(src.get(n)) for n in src.names() if ".mlp.experts." not in n}
    for layer in LAYERS:
        p = _prefix(layer)
        experts = [_source_expert(src, layer, e) for e in range(E)]
        tensors[p + "experts.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in experts])  # [E, 2I, H]
        tensors[p + "experts.down_proj"] = np.stack([d for _, _, d in experts])                            # [E, H, I]
    save_file(tensors, str(ck / "model.safetensors"), metadata={"format": "pt"})
    out = write_pack(ck, tmp_path / "pack", "int8")
    for name in ("experts.bin", "checksums.bin", "dense.safetensors"):
        assert (out / name).read_bytes() == (packs["int8"] / name).read_bytes(), name


def test_transformers_checkpoint_and_its_gguf(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gguf_writer import write_gguf
    from oracle import build_hf_model
    model = build_hf_model("qwen3_moe", 3, num_hidden_layers=3, mlp_only_layers=[1])
    model.save_pretrained(tmp_path / "hf")                  # transformers writes per-expert names
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd  # its in-memory layout is fused: save that form too
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", fused / "config.json")
    save_file(sd, str(fused / "model.safetensors"), metadata={"format": "pt"})
    a = write_pack(tmp_path / "hf", tmp_path / "pa", "f32")
    b = write_pack(fused, tmp_path / "pb", "f32")
    assert (a / "experts.bin").read_bytes() == (b / "experts.bin").read_bytes()
    r = PackReader(a)
    assert r.expert_layers == (0, 2) and r.mtp_layer is None and r.n_experts == 8
    I = model.config.moe_intermediate_size
    for layer in (0, 2):
        gu = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(8):
            g, u, d = r.expert_tensors(layer, e)
            assert np.array_equal(g, gu[e, :I]) and np.array_equal(u, gu[e, I:]) and np.array_equal(d, down[e])
    with pytest.raises(PackIndexError) as ei:
        r.blob(1, 0)                                        # layer 1 is dense (mlp_only_layers)
    assert "layer 1" in str(ei.value) and "0, 2" in str(ei.value)
    assert "model.layers.1.mlp.gate_proj.weight" in set(r.dense().names())
    # the same model through a GGUF (F32): same experts
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    per_expert = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "g").mkdir()
    gpath = write_gguf(per_expert, cfg, tmp_path / "g" / "m.gguf", "F32")
    c = write_pack(gpath, tmp_path / "pc", "f32")
    assert (c / "experts.bin").read_bytes() == (a / "experts.bin").read_bytes()
    assert torch is not None


# ------------------------------------------------------------------------------------------------- integrity


def test_checksums_match_and_a_changed_byte_is_caught(packs, tmp_path):
    d = _copy_pack(packs["nvfp4"], tmp_path / "p")
    r = PackReader(d)
    sums = np.fromfile(d / "checksums.bin", dtype="<u4")
    for k, (layer, e) in enumerate((layer, e) for layer in LAYERS for e in range(E)):
        assert r.checksum(layer, e) == zlib.crc32(r.blob(layer, e)) == int(sums[k])
        assert r.verify(layer, e, r.blob(layer, e))
    r.close()
    off = (2 * E + 5) * quant.layout("nvfp4", 96, 32).nbytes + 123   # layer 2, expert 5
    raw = bytearray((d / "experts.bin").read_bytes())
    raw[off] ^= 0x10
    (d / "experts.bin").write_bytes(bytes(raw))
    r = PackReader(d)
    assert not r.verify(2, 5, r.blob(2, 5)) and not r.verify(2, 5, r.read_blob(2, 5))
    assert r.verify(2, 4, r.blob(2, 4)) and r.verify(2, 6, r.read_blob(2, 6))
    assert r.verify(2, 4, r.blob(2, 4).tobytes()) and not r.verify(2, 5, bytearray(r.blob(2, 5)))


@pytest.mark.parametrize("name,cut", [("experts.bin", 4096), ("experts.bin", 1), ("checksums.bin", 4)])
def test_truncated_file_is_refused_at_open(packs, tmp_path, name, cut):
    d = _copy_pack(packs["int4"], tmp_path / "p")
    f = d / name
    size = f.stat().st_size
    f.write_bytes(f.read_bytes()[:size - cut])
    with pytest.raises(ModelLoadError) as ei:
        PackReader(d)
    msg = str(ei.value)
    assert "truncated" in msg and str(f) in msg and str(size) in msg and str(size - cut) in msg


def test_truncated_dense_file_is_refused_at_open(packs, tmp_path):
    d = _copy_pack(packs["int4"], tmp_path / "p")
    f = d / "dense.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ModelLoadError) as ei:
        PackReader(d)
    assert "truncated" in str(ei.value) and str(f) in str(ei.value)


@pytest.mark.parametrize("case", ["missing", "not json", "list", "other format", "version 2", "no layout",
                                  "bad layout", "partial", "config disagrees"])
def test_bad_manifest_is_refused(packs, tmp_path, case):
    d = _copy_pack(packs["int8"], tmp_path / "p")
    m = d / "pack.json"
    good = json.loads(m.read_text())
    edits = {
        "not json": lambda: m.write_text("{\"format\": \"strata-pack\", "),
        "list": lambda: m.write_text("[]"),
        "other format": lambda: m.write_text(json.dumps(dict(good, format="gguf"))),
        "version 2": lambda: m.write_text(json.dumps(dict(good, version=2))),
        "no layout": lambda: m.write_text(json.dumps({k: v for k, v in good.items() if k != "layout"})),
        "bad layout": lambda: m.write_text(json.dumps(dict(good, layout=dict(good["layout"], nbytes=4096)))),
        "config disagrees": lambda: m.write_text(json.dumps(dict(good, config=dict(good["config"], num_experts=8)))),
    }
    if case in ("missing", "partial"):
        m.unlink()
        if case == "partial":
            (d / "pack.partial.json").write_text("{}")
    else:
        edits[case]()
    with pytest.raises(ModelLoadError) as ei:
        PackReader(d)
    msg = str(ei.value)
    assert "pack.json" in msg
    words = {"missing": ["no pack.json", "strata pack"], "not json": ["not readable JSON", "strata-pack"],
             "list": ["list", "JSON object"], "other format": ["'gguf'", "strata-pack"],
             "version 2": ["version 2", "version 1"], "no layout": ["layout"], "bad layout": ["layout", "re-pack"],
             "partial": ["unfinished", "pack.partial.json"],
             "config disagrees": ["n_experts 16", "num_experts 8"]}[case]
    for w in words:
        assert w in msg, (w, msg)
    assert not is_pack(d) or case in ("no layout", "bad layout", "version 2", "config disagrees")


def test_bad_index_names_the_allowed_range(packs):
    r = PackReader(packs["int8"])
    for layer, e, words in ((5, 0, ["layer 5", "0..4", "MTP"]), (-1, 0, ["layer -1", "0..4"]),
                            (0, 16, ["expert 16", "0..15"]), (0, -1, ["expert -1", "0..15"]),
                            ("0", 0, ["layer '0'"]), (0, 1.5, ["expert 1.5"])):
        for call in (r.blob, r.read_blob, r.checksum, r.expert_tensors, r.offset):
            with pytest.raises(PackIndexError) as ei:
                call(layer, e)
            for w in words:
                assert w in str(ei.value), (w, str(ei.value))
    assert isinstance(ei.value, StrataError) and isinstance(ei.value, IndexError)
    with pytest.raises(ValueError):
        r.read_blob(0, 0, out=np.empty(10, np.uint8))


# ------------------------------------------------------------------------------------------------- writing


def test_resume_after_interrupt_is_byte_identical(packs, tmp_path):
    out = tmp_path / "p"
    with pytest.raises(Interrupt):
        write_pack("demo", out, "int4", progress=_interrupt_at(40))
    state = json.loads((out / "pack.partial.json").read_text())
    assert state["blobs_done"] == 40 and state["experts"] == "int4" and state["blobs_total"] == TOTAL
    assert not (out / "pack.json").exists() and not is_pack(out)
    with pytest.raises(ModelLoadError, match="unfinished"):
        PackReader(out)
    seen = []
    write_pack("demo", out, "int4", progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (40, TOTAL) and seen[-1] == (TOTAL, TOTAL) and len(seen) == TOTAL - 40 + 1
    assert _files(out) == _files(packs["int4"])
    assert not (out / "pack.partial.json").exists()


def test_resume_after_a_hard_stop_backs_off_to_a_good_blob(packs, tmp_path):
    """A crash can leave half a blob past the record, and the recorded last blob damaged: both are rewritten."""
    out = tmp_path / "p"
    with pytest.raises(Interrupt):
        write_pack("demo", out, "int4", progress=_interrupt_at(37))
    nb = quant.layout("int4", 96, 32).nbytes
    raw = bytearray((out / "experts.bin").read_bytes())
    assert len(raw) == 37 * nb
    raw[36 * nb + 5] ^= 0xFF                                  # the last recorded blob is damaged
    (out / "experts.bin").write_bytes(bytes(raw) + b"\x07" * (nb // 2))   # and half a blob follows it
    seen = []
    write_pack("demo", out, "int4", progress=lambda d, t: seen.append(d))
    assert seen[0] == 36
    assert _files(out) == _files(packs["int4"])


def test_a_blob_changed_after_writing_is_caught_by_the_final_check(packs, tmp_path, monkeypatch):
    out = tmp_path / "p"
    nb = quant.layout("int8", 96, 32).nbytes
    real = packmod._drop_cache

    def corrupt(path):                                        # runs between the writes and the read-back
        with open(path, "r+b") as f:
            f.seek(50 * nb + 7)
            b = f.read(1)
            f.seek(50 * nb + 7)
            f.write(bytes([b[0] ^ 1]))
        real(path)
    monkeypatch.setattr(packmod, "_drop_cache", corrupt)
    with pytest.raises(StrataError) as ei:
        write_pack("demo", out, "int8")
    msg = str(ei.value)
    assert "layer 3 expert 2" in msg and "checksum" in msg and str(out / "experts.bin") in msg
    assert not (out / "pack.json").exists()
    assert json.loads((out / "pack.partial.json").read_text())["blobs_done"] == 50
    monkeypatch.setattr(packmod, "_drop_cache", real)
    seen = []
    write_pack("demo", out, "int8", progress=lambda d, t: seen.append(d))
    assert seen[0] == 50 and _files(out) == _files(packs["int8"])


def test_mismatched_partial_pack_is_refused_unless_forced(packs, tmp_path, demo):
    out = tmp_path / "p"
    with pytest.raises(Interrupt):
        write_pack("demo", out, "int4", progress=_interrupt_at(20))
    with pytest.raises(ConfigError) as ei:
        write_pack("demo", out, "int8")
    msg = str(ei.value)
    assert "unfinished pack" in msg and "'int4'" in msg and "'int8'" in msg and "--force" in msg
    other = tmp_path / "copy"
    shutil.copytree(demo[2], other)
    with pytest.raises(ConfigError) as ei:
        write_pack(other, out, "int4")
    assert "source" in str(ei.value) and str(other) in str(ei.value)
    write_pack("demo", out, "int8", force=True)
    assert _files(out) == _files(packs["int8"])


def test_existing_pack_or_foreign_directory_is_refused_unless_forced(packs, tmp_path):
    d = _copy_pack(packs["bf16"], tmp_path / "p")
    with pytest.raises(ConfigError, match="already holds a pack"):
        write_pack("demo", d, "bf16")
    write_pack("demo", d, "int4", force=True)
    assert PackReader(d).format == "int4" and _files(d) == _files(packs["int4"])
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty") as ei:
        write_pack("demo", foreign, "int4")
    assert "notes.txt" in str(ei.value)
    with pytest.raises(ConfigError, match="nvfp5.*f32, bf16, int8, int4, nvfp4"):
        write_pack("demo", tmp_path / "new", "nvfp5")
    with pytest.raises(ModelLoadError, match="not found"):
        write_pack(tmp_path / "no-such-model", tmp_path / "new", "int4")
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------------------------- the CLI


def test_cli_pack_writes_a_verified_pack(tmp_path, capsys, packs):
    out = tmp_path / "p"
    assert main(["pack", "--model", "demo", "--out", str(out), "--experts", "int4"]) == 0
    err = capsys.readouterr().err
    assert _files(out) == _files(packs["int4"])
    lines = err.strip().splitlines()
    # not a terminal: one line per 10%, then the summary
    assert lines[0] == f"strata pack: 0/{TOTAL} blobs (0%)" and lines[-2] == f"strata pack: {TOTAL}/{TOTAL} blobs (100%)"
    assert len(lines) == 12 and "\r" not in err
    assert re.fullmatch(rf"strata pack: 16 experts x 5 layers in int4 = 0\.62 MiB, written and verified in "
                        rf"\d+\.\d s \(\d+ MiB/s\) to {re.escape(str(out))}", lines[-1]), lines[-1]
    # an existing pack: one error line, exit 2; --force overwrites
    assert main(["pack", "--model", "demo", "--out", str(out), "--experts", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata pack: error:") and "already holds a pack" in err and "--force" in err
    assert main(["pack", "--model", "demo", "--out", str(out), "--experts", "int8", "--force"]) == 0
    assert PackReader(out).format == "int8"


def test_cli_bad_format_exits_2_naming_the_allowed_ones(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["pack", "--model", "demo", "--out", str(out), "--experts", "int3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata pack: error:") and "'int3'" in err
    for fmt in quant.FORMATS:
        assert fmt in err
    assert not out.exists()


def test_cli_resumes_and_says_so(tmp_path, capsys):
    out = tmp_path / "p"
    with pytest.raises(Interrupt):
        write_pack("demo", out, "f32", progress=_interrupt_at(8))
    assert main(["pack", "--model", "demo", "--out", str(out), "--experts", "f32"]) == 0
    assert f"(resumed after 8 of {TOTAL} blobs)" in capsys.readouterr().err


def test_progress_bar_on_a_terminal_is_one_redrawn_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    s = Tty()
    bar = _ProgressBar("strata pack", s)
    for i in range(0, 81):
        bar(i, 80)
    bar.close()
    text = s.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and 2 <= text.count("\r") <= 81   # redrawn <= 10 a second
    assert text.split("\r")[1].startswith("strata pack: [" + "." * 30 + "] 0/80")
    assert text.rstrip("\n").split("\r")[-1].startswith("strata pack: [" + "#" * 30 + "] 80/80")
