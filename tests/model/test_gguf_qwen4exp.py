"""llama.cpp's qwen4exp GGUF (weights/gguf_qwen35.py) against the checkpoint it was converted from: the demo-flash
model written as the converter writes it (tests/gguf_qwen4exp_writer.py), whole and as a gguf-split set. Every tensor
comes back as the checkpoint holds it, up to the converter's own arithmetic (norms stored as 1 + w, A_log as
-exp(A_log)), and the engine's logits equal those of the checkpoint with that arithmetic applied, bit for bit, with
the PLE table on the device, in RAM or read from the file (an F16 table dequantized row by row, as a quantized one
is). A file that cannot be served is one clear error naming the file and what is wrong."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf_qwen4exp_writer import write_qwen4exp_gguf
from safetensors.numpy import load_file
from safetensors_writer import edit_tensors

from strata import Engine
from strata.demo import write_demo_flash_model
from strata.demo_tokenizer import write_demo_tokenizer
from strata.errors import ModelLoadError
from strata.weights.gguf_reader import read_gguf

PROMPT = [5, 80, 256, 17, 300, 42, 42, 9, 256, 256, 12, 99] * 3
PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def flash(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("flash")
    write_demo_flash_model(path)
    return path


def _text(flash: Path) -> tuple[dict, dict]:
    cfg = json.loads((flash / "config.json").read_text())["text_config"]
    return cfg, load_file(str(flash / "model.safetensors"))


def _write(flash: Path, out: Path, **kw) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_demo_tokenizer(out)
    cfg, hf = _text(flash)
    return write_qwen4exp_gguf(out / "flash.gguf", cfg, hf, **kw)[0]


def _converted(name: str, w: np.ndarray, table_dtype=np.float32) -> np.ndarray:
    """What the checkpoint's tensor is after the converter's arithmetic and the reader's inverse (float32)."""
    if ".ngram_embedding." in name:
        return w.astype(table_dtype).astype(np.float32)
    if ((name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")) or ".ple.norm_" in name
            or name.startswith("mtp.pre_fc_norm_")):
        return (w + np.float32(1.0)) - np.float32(1.0)
    if name.endswith(".A_log"):
        return np.log(-(-np.exp(w)).astype(np.float64)).astype(np.float32)
    return w


def test_every_tensor_and_the_config_come_back(flash, tmp_path):
    path = _write(flash, tmp_path / "g")
    config, tensors = read_gguf(path)
    cfg, hf = _text(flash)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
                "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size", "hc_count", "hc_lowrank",
                "ple_layer_ids", "ple_embed_dim", "ngram_size", "heads_per_ngram", "indexer_n_heads",
                "indexer_head_dim", "indexer_budget", "indexer_compress_ratio", "eos_token_id"):
        assert config[key] == cfg[key], key
    assert config["rope_parameters"]["mrope_section"] == cfg["rope_parameters"]["mrope_section"]
    want = {}
    for name, w in hf.items():
        if name.startswith(("mtp.", "model.visual.")):      # (llama.cpp keeps the vision tower in an mmproj file)
            continue
        short = name.replace(PREFIX, "model.")
        if ".ngram_embedding.shard_" in name:
            continue
        want[short] = _converted(name, w)
    table = [hf[n] for n in sorted((n for n in hf if ".ngram_embedding.shard_" in n),
                                   key=lambda n: int(n.rsplit("_", 1)[1].split(".")[0]))]
    want["model.layers.1.ple.ple_embedding.ngram_embedding.weight"] = np.concatenate(table)
    assert set(tensors.names()) == set(want)
    for name, w in want.items():
        np.testing.assert_array_equal(tensors.get(name), w, err_msg=name)


def _expected_checkpoint(flash: Path, out: Path, table_dtype=np.float32) -> Path:
    path = shutil.copytree(flash, out)

    def convert(t):
        for name in list(t):
            t[name] = _converted(name, t[name], table_dtype)
    edit_tensors(path, convert)
    return path


@pytest.mark.parametrize("shards, table_dtype, place", [(1, np.float32, "device"), (3, np.float32, "disk"),
                                                        (1, np.float16, "disk"), (1, np.float16, "host")])
def test_the_engine_gives_the_checkpoints_logits(flash, tmp_path, shards, table_dtype, place):
    """Shards: metadata in the first, the PLE table alone in the last; the set is named by its first shard. An F16
    table is read as a quantized one is, each row dequantized when read: gathered from the file (disk) or converted
    into RAM (host)."""
    path = _write(flash, tmp_path / "g", shards=shards, table_dtype=table_dtype)
    assert path.name == ("flash.gguf" if shards == 1 else "flash-00001-of-00003.gguf")
    got = Engine.load(path, max_context=128, ple_table=place).logits(PROMPT)
    want = Engine.load(_expected_checkpoint(flash, tmp_path / "hf", table_dtype), max_context=128,
                       ple_table=place).logits(PROMPT)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


def _error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(path, max_context=128)
    return str(ei.value)


def test_files_that_cannot_be_served_are_refused_with_the_reason(flash, tmp_path):
    three = _write(flash, tmp_path / "s", shards=3)
    second = three.with_name("flash-00002-of-00003.gguf")
    assert "pass the first shard (flash-00001-of-00003.gguf)" in _error(second)
    three.with_name("flash-00003-of-00003.gguf").unlink()
    assert "flash-00003-of-00003.gguf" in _error(three)
    bad = _write(flash, tmp_path / "m", metadata={"ple.layer_multipliers": ([3, 5, 7], "u64[]")})
    msg = _error(bad)
    assert str(bad) in msg and "qwen4exp.ple.layer_multipliers is [3, 5, 7]" in msg and "not the release's" in msg
    zero = _write(flash, tmp_path / "z", metadata={"attention.compress_ratios": ([0, 0, 0, 0], "i32[]")})
    assert "compress_ratios gives the attention layers [0]" in _error(zero)
    missing = _write(flash, tmp_path / "k", metadata={"hyper_connection.low_rank": None})
    assert "required GGUF metadata key 'qwen4exp.hyper_connection.low_rank' is missing" in _error(missing)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "IQ4_NL"])
def test_a_quantized_tables_rows_are_its_dequantized_rows(tmp_path, qtype):
    """The published files' table types: rows gathered by index or read as a slice dequantize to the rows of the
    whole table dequantized (gguf's own dequantize as the reference)."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize, quantize

    from strata.weights.gguf_qwen35 import QuantizedRows
    q = GGMLQuantizationType[qtype]
    table = np.random.default_rng(3).standard_normal((300, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen4exp")
    if q == GGMLQuantizationType.IQ4_NL:        # gguf dequantizes it but cannot quantize: blocks of random codes
        blocks = np.random.default_rng(4).integers(0, 256, (300, 2, 18), dtype=np.uint8)
        blocks[:, :, :2] = np.full((300, 2, 1), 0.05, np.float16).view(np.uint8)      # each block's scale
        data = blocks.reshape(300, 36)
    else:
        data = quantize(table, q)
    w.add_tensor("per_layer_token_embd.weight", data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = GGUFReader(tmp_path / "t.gguf").tensors[0]
    rows = QuantizedRows(t)
    whole = np.asarray(dequantize(t.data, q), np.float32)
    assert rows.shape == (300, 64) and rows.dtype == np.float32 and rows.nbytes < table.nbytes
    ids = np.array([0, 299, 17, 17, 150])
    np.testing.assert_array_equal(rows[ids], whole[ids])
    np.testing.assert_array_equal(rows[100:140], whole[100:140])
    assert q == GGMLQuantizationType.IQ4_NL or np.abs(whole - table).max() < 0.5     # it is the table, quantized


def test_weights_in_files_of_their_own_join_the_model(flash, tmp_path):
    """gguf_parts (the seeds' layout: the PLE table and the token embedding each in a file of its own beside the rest):
    the same logits as one file; a tensor in two files, a part of another architecture, or parts for a model that is
    not a .gguf file are refused naming the file."""
    import gguf
    from gguf import GGUFReader

    from strata.config import ConfigError
    one = _write(flash, tmp_path / "one")
    main = _write(flash, tmp_path / "split")
    reader = GGUFReader(main)
    own = {"per_layer_token_embd.weight": tmp_path / "split" / "ple.gguf", "token_embd.weight": tmp_path / "split" /
           "embd.gguf"}
    for name, path in own.items():       # each tensor moved to a file of its own (no metadata but the architecture)
        t = next(t for t in reader.tensors if t.name == name)
        w = gguf.GGUFWriter(str(path), "qwen4exp")
        w.add_tensor(name, np.array(t.data), raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    rest = tmp_path / "split" / "rest.gguf"
    w = gguf.GGUFWriter(str(rest), "qwen4exp")
    for field in reader.fields.values():
        if field.name.startswith("qwen4exp.") or field.name.startswith("tokenizer."):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name not in own:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = Engine.load(one, max_context=128).logits(PROMPT)
    parts = ",".join(str(p) for p in own.values())
    np.testing.assert_array_equal(Engine.load(rest, max_context=128, gguf_parts=parts).logits(PROMPT), want)
    assert "token_embd.weight is missing (a file of its own joins the model's through gguf_parts)" in _error(rest)
    with pytest.raises(ModelLoadError, match=r"gguf_parts .*embd.gguf: tensor token_embd.weight is in the model's"):
        Engine.load(one, max_context=128, gguf_parts=str(own["token_embd.weight"]))
    for model in ("demo", "random:qwen3.8-flash-next"):
        with pytest.raises(ConfigError, match=f"gguf_parts: more GGUF files join a .gguf model, and '{model}' is not"):
            Engine.load(model, max_context=128, gguf_parts=parts)


def test_strata_pack_of_a_gguf_serves_its_logits(flash, tmp_path):
    """strata pack of a qwen4exp GGUF (an F16 table, read as a quantized one is): the pack with f32 experts gives the
    GGUF's logits exactly (its dense file holds the table dequantized)."""
    from strata.experts.pack import write_pack
    path = _write(flash, tmp_path / "g", table_dtype=np.float16)
    pack = write_pack(path, tmp_path / "pack", "f32")
    np.testing.assert_array_equal(Engine.load(pack, max_context=128).logits(PROMPT),
                                  Engine.load(path, max_context=128).logits(PROMPT))


def test_an_mtp_block_is_read_as_the_checkpoints_head(flash, tmp_path):
    """A file with the MTP block (PR 28243's converter: blk.{n_layer}, nextn.*): every mtp.* tensor comes back, and
    the head's draft logits equal the checkpoint's (with the converter's arithmetic), bit for bit."""
    from strata.engine.spec import sequence_draft_logits
    path = _write(flash, tmp_path / "g", mtp=True)
    _, tensors = read_gguf(path)
    _, hf = _text(flash)
    mtp = {n: _converted(n, w) for n, w in hf.items() if n.startswith("mtp.")}
    got = {n for n in tensors.names() if n.startswith("mtp.")}
    experts = {n for n in mtp if ".experts." in n}
    assert got == set(mtp) and experts
    for name in mtp:
        np.testing.assert_array_equal(tensors.get(name), mtp[name], err_msg=name)
    a = Engine.load(path, max_context=128, mtp=True)
    b = Engine.load(_expected_checkpoint(flash, tmp_path / "hf"), max_context=128, mtp=True)
    want = sequence_draft_logits(b, PROMPT)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(sequence_draft_logits(a, PROMPT), want)


def test_a_tensor_whose_shape_disagrees_with_the_config_names_it_and_the_file(flash, tmp_path):
    cfg, hf = _text(flash)
    name = PREFIX + "layers.0.attn_hyper_connection.input_mix_weight_down.weight"
    hf = {**hf, name: hf[name][:-1]}
    path = tmp_path / "g"
    path.mkdir()
    write_demo_tokenizer(path)
    gguf_path = write_qwen4exp_gguf(path / "flash.gguf", cfg, hf)[0]
    msg = _error(gguf_path)
    assert msg == (f"tensor model.layers.0.attn_hyper_connection.input_mix_weight_down.weight in {gguf_path} has "
                   f"shape [31, 384], expected [32, 384]")
