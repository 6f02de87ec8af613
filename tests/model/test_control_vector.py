"""Control vectors (strata/model/control.py) against transformers with the vector added to the residual by hand: a
forward hook on decoder layer N adds scale x direction.N to its output (in every stream of qwen4_exp), as llama.cpp's
cvec adds it after layer N. Logits within test_parity's tolerance, greedy tokens equal, scale 0 equal to no vector
bit for bit; files llama.cpp would not load (or made for another model) are refused naming what is wrong."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gguf_writer import write_control_vector  # noqa: E402
from oracle import build_hf_model  # noqa: E402
from strata import Engine  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from strata.model.control import entries, load_control_vector  # noqa: E402

TOL = 1e-4           # of the logit range, float32 (test_parity's)
NEAR_TIE = 1e-4
PROMPT_LEN = 40
GEN = 12
ARCHS = ("qwen3_next", "qwen3_moe", "qwen4_exp")


def steered(model, directions: dict, scale: float):
    """Forward hooks adding scale x direction.N to decoder layer N's output (every hyper-connection stream) -> the
    handles to remove."""
    hc = getattr(model.config, "hc_count", 1) if model.config.model_type.startswith("qwen4_exp") else 1

    def hook(d):
        t = torch.tensor(np.tile(d, hc)) * scale
        return lambda m, i, o: o + t if torch.is_tensor(o) else (o[0] + t, *o[1:])
    return [model.model.layers[n].register_forward_hook(hook(d)) for n, d in directions.items()]


def oracle(model, directions, scale, prompt):
    """transformers with the vector added by hand: greedy continuation, logits over prompt + continuation, routers."""
    handles = steered(model, directions, scale)
    try:
        with torch.no_grad():
            gen = model.generate(torch.tensor(prompt)[None], max_new_tokens=GEN, do_sample=False,
                                 min_new_tokens=GEN)[0, len(prompt):].tolist()
            out = model(torch.tensor(prompt + gen)[None], output_router_logits=True)
    finally:
        for h in handles:
            h.remove()
    routers = [torch.softmax(r.float(), dim=-1).numpy() for r in (out.router_logits or ())]
    return gen, out.logits[0].float().numpy(), routers


def _near_tie(k, logits, routers, n) -> bool:
    for p in routers:
        top = -np.sort(-p, axis=-1)
        if (top[:, k - 1] - top[:, k]).min() < NEAR_TIE:
            return True
    top2 = -np.sort(-logits[n - 1:-1], axis=-1)[:, :2]
    return (top2[:, 0] - top2[:, 1]).min() < NEAR_TIE * (logits.max() - logits.min())


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    """A tiny random model and two control vector files (summed, each times its scale: llama.cpp's rule), the oracle
    at request scales 1 and -0.5 free of router and greedy near-ties."""
    arch = request.param
    tmp = tmp_path_factory.mktemp(arch)
    for seed in range(20):
        model = build_hf_model(arch, seed)
        H, L = model.config.hidden_size, model.config.num_hidden_layers
        rng = np.random.default_rng(seed)
        a = {n: rng.standard_normal(H).astype(np.float32) for n in range(1, L)}           # every layer it may
        b = {L - 1: rng.standard_normal(H).astype(np.float32)}                            # after the last layer
        total = {n: 0.7 * a[n] + (-1.5 * b[n] if n in b else 0) for n in a}
        prompt = rng.integers(0, model.config.vocab_size, PROMPT_LEN).tolist()
        runs = {s: oracle(model, total, s, prompt) for s in (1.0, -0.5)}
        if not any(_near_tie(model.config.num_experts_per_tok, lg, r, PROMPT_LEN) for _, lg, r in runs.values()):
            break
    else:
        pytest.fail("no tie-free model in 20 seeds")
    path = tmp / "model"
    model.save_pretrained(path)
    files = f"{write_control_vector(tmp / 'a.gguf', a)}:0.7,{write_control_vector(tmp / 'b.gguf', b)}:-1.5"
    return dict(engine=Engine.load(path, max_context=256, control_vector=files), path=path, prompt=prompt,
                runs=runs, model=model, total=total, arch=arch)


def _assert_close(ours, ref, what):
    span = float(ref.max() - ref.min())
    err = float(np.abs(ours - ref).max())
    assert err <= TOL * span, f"{what}: max |diff| {err:.3e} > {TOL} x logit range {span:.3f}"


@pytest.mark.parametrize("scale", [1.0, -0.5])
def test_logits_and_greedy_tokens_equal_the_vector_added_by_hand(case, scale):
    gen, logits, _ = case["runs"][scale]
    e = case["engine"]
    full = case["prompt"] + gen
    _assert_close(e.logits(full, control_scale=scale), logits, f"{case['arch']} scale {scale}, one pass")
    seq = e.sequence(control_scale=scale)           # parts of 7, then the decode form one token at a time
    pieces = [seq.read(full[:PROMPT_LEN], part_size=7, all_logits=True)]
    pieces += [seq.read([t], all_logits=True) for t in full[PROMPT_LEN:]]
    _assert_close(np.concatenate(pieces), logits, f"{case['arch']} scale {scale}, parts of 7 + decode")
    assert e.generate(case["prompt"], GEN, control_scale=scale, stop_token_ids=()) == gen


def test_scale_zero_is_no_vector_and_the_vector_changes_the_logits(case):
    plain = Engine.load(case["path"], max_context=256)
    e, prompt = case["engine"], case["prompt"]
    off = plain.logits(prompt)
    assert np.array_equal(e.logits(prompt, control_scale=0.0), off)
    assert np.abs(e.logits(prompt) - off).max() > 0.1 * (off.max() - off.min())


def test_entries_parse_files_and_scales():
    assert entries("a.gguf") == [("a.gguf", 1.0)]
    assert entries("a.gguf:0.5, dir:x/b.gguf:-2") == [("a.gguf", 0.5), ("dir:x/b.gguf", -2.0)]
    assert entries(["c:/x.gguf"]) == [("c:/x.gguf", 1.0)]          # no number after the colon: part of the path
    with pytest.raises(ConfigError, match="finite"):
        entries("a.gguf:nan")


@pytest.mark.parametrize("directions, extra, dtype, match", [
    ({0: np.ones(8)}, None, np.float32, r"direction\.0 is outside this model.*N must be in 1\.\.3"),
    ({4: np.ones(8)}, None, np.float32, r"direction\.4 is outside this model.*layers 0\.\.3"),
    ({1: np.ones(6)}, None, np.float32, r"direction\.1 has 6 values .* hidden size is 8: the file was made for "
                                        r"another model"),
    ({1: np.ones(8)}, None, np.float16, r"direction\.1 is F16; control vectors are float32"),
    ({1: np.ones(8)}, {"token_embd.weight": np.ones((2, 8))}, np.float32,
     r"tensor 'token_embd\.weight' is not a control vector's: .* direction\.1 \.\. direction\.3"),
    ({}, {"output.weight": np.ones(8)}, np.float32, r"is not a control vector's"),
    ({}, None, np.float32, r"holds no tensor direction\.N: not a control vector file"),
    ({1: np.full(8, np.inf)}, None, np.float32, r"direction\.1 holds non-finite values"),
])
def test_a_file_llama_cpp_would_refuse_or_made_for_another_model_is_refused(tmp_path, directions, extra, dtype,
                                                                            match):
    f = write_control_vector(tmp_path / "cv.gguf", directions, dtype, extra)
    with pytest.raises(ConfigError, match=match):
        load_control_vector(str(f), num_layers=4, hidden_size=8)


def test_missing_and_foreign_files_are_refused_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"control_vector .*nope\.gguf: no such file"):
        Engine.load("demo", max_context=256, control_vector=str(tmp_path / "nope.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match=r"junk\.gguf: not a GGUF file"):
        load_control_vector(f"{junk}:2", num_layers=4, hidden_size=8)
    good = write_control_vector(tmp_path / "wide.gguf", {1: np.ones(8)})
    with pytest.raises(ConfigError, match=r"has 8 values .* this model's hidden size is"):
        Engine.load("demo", max_context=256, control_vector=str(good))


def test_files_add_up_each_times_its_scale(tmp_path):
    a = write_control_vector(tmp_path / "a.gguf", {1: np.arange(8), 2: np.ones(8)})
    b = write_control_vector(tmp_path / "b.gguf", {2: np.full(8, 3.0)})
    cv = load_control_vector([f"{a}:2", str(b)], num_layers=4, hidden_size=8)
    assert sorted(cv.directions) == [1, 2]
    np.testing.assert_array_equal(cv.directions[1], 2 * np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(cv.directions[2], np.full(8, 5.0, np.float32))
    assert cv.files == ((str(a), 2.0), (str(b), 1.0))
