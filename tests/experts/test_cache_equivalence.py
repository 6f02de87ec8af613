"""The expert cache changes where experts are, never what is computed: greedy tokens identical and logits equal to
float-summation order between every expert arrangement, for the demo model (16 experts per layer) and a tiny
Qwen3-Next with 64 experts per layer, from a checkpoint (f32 blobs) and from packs in every format.

Arrangements: all experts resident (one compiled window), half of them, 2 slots per MoE layer (decode misses copied
by the compiled window from pinned host chunks), half with decode layer by layer (misses copied into slots between
layers), read from the pack on every miss (--stream-experts), decode misses on the CPU, prompt parts with and
without borrowed slots. Every run
checks each slot it reads against the pack (debug_slots), so a wrong slot fails loudly rather than as a logit error.
"""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine
from strata.experts.pack import write_pack
from strata.experts.path import PathKind

torch = pytest.importorskip("torch")
from oracle import build_hf_model, save_hf_model  # noqa: E402

PROMPT_LEN, PART, GEN = 40, 16, 12
# Between arrangements only the order of float32 sums changes (a miss computed in its own pass, a layer compiled on
# its own instead of inside the whole window): differences are a few ulps of the logits.
LOGIT_TOL = 2e-5     # of the logit range


def _arrangements(total: int, layers: int):
    half = total // 2
    return {
        "half": dict(expert_cache=half),
        "layer-by-layer": dict(expert_cache=half, window_fetch=False),
        "two-per-layer": dict(expert_cache=2 * layers),
        "cpu-misses": dict(expert_cache=half, miss_policy="cpu"),
        "no-borrow": dict(expert_cache=2 * layers, prefill_borrow=False, staging_slots=3),
        "stream": dict(expert_cache=half, stream_experts=True),
    }


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny64")
    model = build_hf_model("qwen3_next", 5, num_experts=64, num_experts_per_tok=4, hidden_size=64,
                           moe_intermediate_size=32)
    return save_hf_model(model, d / "hf")


@pytest.fixture(scope="module")
def packs(tmp_path_factory, tiny64):
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for name, src in (("demo", "demo"), ("tiny64", tiny64)):
        for fmt in ("f32", "int4", "nvfp4"):
            out[name, fmt] = write_pack(src, root / f"{name}-{fmt}", fmt)
    return out


def _run(model, **options):
    e = Engine.load(model, max_context=256, prefill=PART, debug_slots=True, say=lambda line: None, **options)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, e.cfg.vocab_size, PROMPT_LEN).tolist()
    logits = e.logits(prompt, part_size=PART)
    tokens = e.generate(prompt, GEN)
    return e, logits, tokens


def _compare(ref, got, what):
    _, ref_logits, ref_tokens = ref
    e, logits, tokens = got
    assert tokens == ref_tokens, f"{what}: greedy tokens differ"
    err = np.abs(logits - ref_logits).max() / (ref_logits.max() - ref_logits.min())
    assert err <= LOGIT_TOL, f"{what}: logits differ by {err:.2e} of the range"
    return e


@pytest.mark.parametrize("model", ["demo", "tiny64"])
def test_checkpoint_arrangements_match_all_resident(model, tiny64):
    src = "demo" if model == "demo" else tiny64
    ref = _run(src)
    assert ref[0].path.kind is PathKind.RESIDENT and ref[0].experts.cache.all_resident()
    c = ref[0].cfg
    layers = ref[0].experts.cache.n_layers
    for name, opts in _arrangements(c.num_experts * layers, layers).items():
        if opts.get("stream_experts"):
            continue                                   # a checkpoint has no pack to stream from (see below)
        e = _compare(ref, _run(src, **opts), f"{model} {name}")
        st = e.experts.cache.stats
        assert e.path.kind is not PathKind.RESIDENT and st.misses > 0, f"{name}: the arrangement never missed, so it tested nothing"
        assert e.experts.moe.uses_checked > 0
        if opts.get("miss_policy") == "cpu":
            assert st.cpu_routes > 0
        # decode misses: copied by the compiled window itself, unless it is off or misses run on the CPU
        fetching = opts.get("window_fetch", True) and opts.get("miss_policy", "fetch") == "fetch"
        assert (e.path.kind is PathKind.WINDOW_FETCH) == fetching and (st.window_copies > 0) == fetching, name
        if opts.get("prefill_borrow") is False:
            assert st.loans == 3                       # only the staging slots, reserved once
        else:
            assert st.loans > 0


@pytest.mark.parametrize("model", ["demo", "tiny64"])
@pytest.mark.parametrize("fmt", ["f32", "int4", "nvfp4"])
def test_pack_arrangements_match_all_resident(model, fmt, packs, tiny64):
    pack = packs[model, fmt]
    ref = _run(pack)
    if fmt == "f32":   # an f32 pack is the checkpoint itself, bit for bit
        src = "demo" if model == "demo" else tiny64
        _compare(_run(src), ref, f"{model} f32 pack vs checkpoint")
    layers = ref[0].experts.cache.n_layers
    arr = _arrangements(ref[0].cfg.num_experts * layers, layers)
    names = list(arr) if fmt == "int4" else ["two-per-layer", "stream"]
    for name in names:
        e = _compare(ref, _run(pack, **arr[name]), f"{model} {fmt} {name}")
        assert e.experts.cache.stats.misses > 0
        if name == "stream":
            assert e.experts.mirror is None and e.experts.store.reads > 0
