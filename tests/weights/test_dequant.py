"""Quantized checkpoints (strata/weights/dequant.py): block FP8 and NVFP4 weights dequantize to their numpy
definitions; the demo checkpoint with its linear weights in block FP8 and its experts in NVFP4 gives exactly the
logits and text of the same checkpoint with the dequantized values stored as float; missing or misshapen scales are
one error naming the tensors."""
from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from safetensors_writer import save

from strata import Engine
from strata.demo import write_demo_model
from strata.errors import ModelLoadError
from strata.weights.dequant import Dequantized
from strata.weights.quant import E2M1_LUT

PROMPT = [5, 70, 101, 33, 9, 200, 17, 42] * 3


class Source:
    """A TensorSource over a dict (this unit's own test)."""

    def __init__(self, tensors):
        self.t = tensors

    def names(self):
        return self.t.keys()

    def get(self, name):
        return self.t[name]

    def where(self, name):
        return "memory"


def fp8_blocks(w: np.ndarray, block: tuple[int, int]):
    """w -> (float8 values, float32 scale_inv [ceil(N/bn), ceil(K/bk)]): each block's largest magnitude at 448."""
    n, k = w.shape
    bn, bk = block
    scale = np.ones((-(-n // bn), -(-k // bk)), np.float32)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            b = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = max(float(np.abs(b).max()), 1e-12) / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (b / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def nvfp4_parts(w: np.ndarray, rng):
    """w's shape in NVFP4 with random codes: (packed uint8 [N, K/2], block scales float8 [N, K/16], global)."""
    n, k = w.shape
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scales = (rng.random((n, k // 16)) * 2 + 0.25).astype(ml_dtypes.float8_e4m3fn)
    return packed, scales, np.array(0.01 / (1 + rng.random()), np.float32), codes


def test_block_fp8_is_each_value_times_its_blocks_scale():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    q, s = fp8_blocks(w, (128, 128))
    got = Dequantized(Source({"a.weight": q, "a.weight_scale_inv": s})).get("a.weight")
    want = np.empty_like(w)
    for r in range(200):
        for c in range(300):
            want[r, c] = float(q[r, c]) * s[r // 128, c // 128]
    assert np.array_equal(got, want) and np.abs(got - w).max() <= np.abs(w).max() / 16


def test_nvfp4_is_each_code_times_its_block_scale_and_the_global_scale():
    rng = np.random.default_rng(1)
    packed, scales, g, codes = nvfp4_parts(np.zeros((8, 64)), rng)
    src = Source({"a.weight": packed, "a.weight_scale": scales, "a.weight_scale_2": g,
                  "a.input_scale": np.array(1.0, np.float32)})
    d = Dequantized(src)
    assert sorted(d.names()) == ["a.weight"]                   # the scales it consumed are hidden
    f32 = np.float32
    want = np.array([[f32(E2M1_LUT[codes[r, c]]) * f32(scales[r, c // 16]) * f32(g) for c in range(64)]
                     for r in range(8)], np.float32)      # in float32, left to right
    assert np.array_equal(d.get("a.weight"), want)


def test_a_one_value_scale_over_a_large_table_is_the_tables_own():
    """A float8 PLE table keeps its bytes and its scale (strata/model/ple_table.py reads them)."""
    table = np.ones((300, 8), ml_dtypes.float8_e4m3fn)
    d = Dequantized(Source({"t.weight": table, "t.weight_scale_inv": np.ones(1, np.float32)}))
    assert d.get("t.weight").dtype == ml_dtypes.float8_e4m3fn and "t.weight_scale_inv" in set(d.names())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo")
    write_demo_model(path)
    return path


def _quantized_pair(demo, tmp_path, block):
    """(the demo with linears in block FP8 and experts in NVFP4, the demo with those weights' dequantized values)."""
    rng = np.random.default_rng(2)
    tensors = dict(load_file(str(demo / "model.safetensors")))
    quant, plain = {}, {}
    for name, w in tensors.items():
        base = name.removesuffix("weight")
        if w.ndim == 2 and ".experts." in name:
            packed, scales, g, codes = nvfp4_parts(w, rng)
            quant.update({name: packed, base + "weight_scale": scales, base + "weight_scale_2": g})
            plain[name] = (E2M1_LUT[codes] * np.repeat(scales.astype(np.float32), 16, axis=1) * g).astype(np.float32)
        elif w.ndim == 2 and "_proj" in name:
            q, s = fp8_blocks(w, block)
            quant.update({name: q, base + "weight_scale_inv": s})
            plain[name] = q.astype(np.float32) * np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:w.shape[0],
                                                                                                     :w.shape[1]]
        else:
            quant[name] = plain[name] = w
    qdir, pdir = shutil.copytree(demo, tmp_path / "quant"), shutil.copytree(demo, tmp_path / "plain")
    save(quant, qdir / "model.safetensors")
    save_file(plain, str(pdir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (qdir / "config.json").write_text(json.dumps(cfg))
    return qdir, pdir, sum(".experts." in n for n in quant if n.endswith("weight_scale_2"))


def test_a_block_fp8_and_nvfp4_checkpoint_equals_its_dequantized_values(demo, tmp_path):
    qdir, pdir, n_nvfp4 = _quantized_pair(demo, tmp_path, (16, 32))
    assert n_nvfp4 > 0
    q, p = Engine.load(qdir, max_context=128), Engine.load(pdir, max_context=128)
    a, b = q.logits(PROMPT), p.logits(PROMPT)
    assert np.isfinite(a).all() and np.array_equal(a, b)
    assert q.generate(PROMPT[:5], 8) == p.generate(PROMPT[:5], 8)


def test_a_misshapen_block_scale_names_both_tensors(demo, tmp_path):
    qdir, _, _ = _quantized_pair(demo, tmp_path, (16, 32))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 32]           # the scales are for 16 x 32 blocks
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv in .* has shape \[\d+, \d+\], expected .* one scale "
                                             r"per 32x32 block of .*\.weight"):
        Engine.load(qdir, max_context=128)


def test_a_float8_weight_without_its_scale_names_it(demo, tmp_path):
    tensors = dict(load_file(str(demo / "model.safetensors")))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    path = shutil.copytree(demo, tmp_path / "noscale")
    save(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=rf"{name} in .* is float8 but has no scale"):
        Engine.load(path, max_context=128)


def test_a_pack_of_nvfp4_experts_keeps_their_bytes(demo, tmp_path):
    """strata pack --experts nvfp4 of an NVFP4 checkpoint: each blob holds the checkpoint's codes, block scales and
    global scale as they are, so it decodes to exactly the checkpoint's dequantized values (quantising those again
    would not in general give them back); other formats quantise the dequantized values."""
    from strata.experts.pack import PackReader, write_pack
    from strata.weights.quant import decode_expert
    qdir, pdir, _ = _quantized_pair(demo, tmp_path, (16, 32))
    pack = PackReader(write_pack(qdir, tmp_path / "pack", "nvfp4"))
    plain = dict(load_file(str(pdir / "model.safetensors")))
    again = PackReader(write_pack(pdir, tmp_path / "again", "nvfp4"))      # the same values, quantised anew
    differs = 0
    for p, layer in enumerate(pack.expert_layers):
        for e in (0, pack.n_experts - 1):
            got = decode_expert(pack.layout, pack.blob(p, e))
            q = ("mtp.layers.0" if layer == pack.mtp_layer else f"model.layers.{layer}") + f".mlp.experts.{e}."
            for m, w in zip(("gate", "up", "down"), got):
                assert np.array_equal(w, plain[q + f"{m}_proj.weight"]), (p, e, m)
            differs += not all(np.array_equal(a, b) for a, b in zip(got, decode_expert(again.layout,
                                                                                         again.blob(p, e))))
    assert differs > 0
