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
from strata.experts.path import PathKind

pytestmark = pytest.mark.heavy      # minutes on 2 CPU cores: started first (tests/conftest.py)

torch = pytest.importorskip("torch")


PROMPT_LEN, PART, GEN = 40, 16, 12
# Between arrangements only the order of float32 sums changes (a miss computed in its own pass, a layer compiled on
# its own instead of inside the whole window): differences are a few ulps of the logits.
LOGIT_TOL = 2e-5     # of the logit range


def _arrangements(total: int, layers: int):
    half = total // 2
    return {
        "half": dict(expert_cache=half),
        "half, misses borrow": dict(expert_cache=half, stream_parts=False),
        "layer-by-layer": dict(expert_cache=half, window_fetch=False),
        "two-per-layer": dict(expert_cache=2 * layers),
        "cpu-misses": dict(expert_cache=half, miss_policy="cpu"),
        "no-borrow": dict(expert_cache=2 * layers, prefill_borrow=False, staging_slots=3),
        "stream": dict(expert_cache=half, stream_experts=True),
    }


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
        # prompt parts: whole layers streamed where every expert is in pinned chunks (window fetch), else their
        # misses through borrowed (or reserved) slots
        assert e.path.streams_parts == (fetching and opts.get("stream_parts", True)), name
        assert (st.streamed_layers > 0) == e.path.streams_parts, name
        if opts.get("prefill_borrow") is False:
            assert st.loans == 3                       # only the staging slots, reserved once
        elif not e.path.streams_parts:
            assert st.loans > 0, name                  # (streaming, a last part too small to stream may borrow)
