"""The expert cache changes where experts are, never what is computed, for packs in every format (f32, int4, nvfp4)
of the demo model and a tiny Qwen3-Next with 64 experts: test_cache_equivalence.py's arrangements, read from packs
(a file of its own so that the two halves run on different test workers)."""
from __future__ import annotations

import pytest

from strata.experts.pack import write_pack

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

torch = pytest.importorskip("torch")
from tests.experts.test_cache_equivalence import _arrangements, _compare, _run  # noqa: E402


@pytest.fixture(scope="module")
def packs(tmp_path_factory, tiny64):
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for name, src in (("demo", "demo"), ("tiny64", tiny64)):
        for fmt in ("f32", "int4", "nvfp4"):
            out[name, fmt] = write_pack(src, root / f"{name}-{fmt}", fmt)
    return out


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
