"""The expert cache on the SYCL backend changes where experts are, never what is computed: greedy tokens identical
and logits equal to float-summation order between every expert arrangement (the JAX file:
tests/experts/test_cache_equivalence.py), for the demo model from its checkpoint (f32 blobs) and from an int4 pack.

Arrangements other than "every expert resident" run layer by layer (LayerByLayer, strata/model/forward.py): the backend's
experts_pool over slots, pool_write / pool_read, vmap with None outputs for dense layers, set_row on a bank. Every
run checks each slot it reads against the pack (debug_slots), so a wrong slot fails loudly rather than as a logit
error. Then: prompt parts long enough for the blocked form of the expert op; the int4 pack with 8 slots gives the
same greedy tokens on JAX and on SYCL; and the WindowRunner's slot bank (prompt parts on one slot: set_row; decode
rows: vmap, with None routes from a dense layer) on a tiny model with a dense layer between sparse ones.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.experts.pack import write_pack
from strata.engine.runner import WindowRunner
from strata.plan import idle_plan
from strata.plan import PromptPart
from strata.experts.path import PathKind

PROMPT_LEN, PART, GEN = 40, 16, 12
# Between arrangements only the order of float32 sums changes (a miss computed in its own pass, on the CPU through
# the JAX expert op, a layer run on its own instead of inside the whole window): a few ulps of the logits.
LOGIT_TOL = 2e-5     # of the logit range


def _arrangements(total: int, layers: int):
    half = total // 2
    return {
        "half": dict(expert_cache=half),
        "two-per-layer": dict(expert_cache=2 * layers),
        "cpu-misses": dict(expert_cache=half, miss_policy="cpu"),
        "no-borrow": dict(expert_cache=2 * layers, prefill_borrow=False, staging_slots=3),
        "stream": dict(expert_cache=half, stream_experts=True),
    }


@pytest.fixture(scope="module")
def int4_pack(tmp_path_factory):
    return write_pack("demo", tmp_path_factory.mktemp("packs") / "demo-int4", "int4")


def _prompt(vocab):
    return np.random.default_rng(3).integers(0, vocab, PROMPT_LEN).tolist()


def _run(model, device, backend="sycl", **options):
    if backend == "sycl":
        options["device"] = device
    e = Engine.load(model, backend=backend, max_context=256, prefill=PART, debug_slots=True, say=lambda line: None,
                    **options)
    prompt = _prompt(e.cfg.vocab_size)
    logits = e.logits(prompt, part_size=PART)
    tokens = e.generate(prompt, GEN, stop_token_ids=[])
    return e, logits, tokens


def _compare(ref, got, what):
    _, ref_logits, ref_tokens = ref
    e, logits, tokens = got
    assert tokens == ref_tokens, f"{what}: greedy tokens differ"
    err = np.abs(logits - ref_logits).max() / (ref_logits.max() - ref_logits.min())
    assert err <= LOGIT_TOL, f"{what}: logits differ by {err:.2e} of the range"
    return e


def _missed(e, name):
    st = e.experts.cache.stats
    assert e.path.kind is not PathKind.RESIDENT and st.misses > 0, f"{name}: the arrangement never missed, so it tested nothing"
    assert e.experts.moe.uses_checked > 0, f"{name}: no slot read was checked against the pack"
    return st


@pytest.fixture(scope="module")
def checkpoint_ref(sycl_device):
    ref = _run("demo", sycl_device)
    assert ref[0].backend.name == "sycl"
    assert ref[0].path.kind is PathKind.RESIDENT and ref[0].experts.cache.all_resident()
    return ref


def _checkpoint_arrangement(name, ref, sycl_device):
    layers = ref[0].experts.cache.n_layers
    opts = _arrangements(ref[0].cfg.num_experts * layers, layers)[name]
    e = _compare(ref, _run("demo", sycl_device, **opts), f"demo sycl {name}")
    return _missed(e, name), opts


@pytest.mark.parametrize("name", ["half", "two-per-layer"])
def test_checkpoint_fetch_arrangements_match_all_resident(name, checkpoint_ref, sycl_device):
    st, _ = _checkpoint_arrangement(name, checkpoint_ref, sycl_device)
    assert st.loans > 0 and st.fills > 0             # prompt parts borrowed slots, decode misses were copied in


def test_checkpoint_cpu_misses_match_all_resident(checkpoint_ref, sycl_device):
    st, _ = _checkpoint_arrangement("cpu-misses", checkpoint_ref, sycl_device)
    assert st.cpu_routes > 0                         # decode misses ran through the JAX expert op on the host


def test_checkpoint_staging_slots_match_all_resident(checkpoint_ref, sycl_device):
    st, _ = _checkpoint_arrangement("no-borrow", checkpoint_ref, sycl_device)
    assert st.loans == 3                             # only the staging slots, reserved once


def test_int4_pack_arrangements_match_all_resident(int4_pack, sycl_device):
    ref = _run(int4_pack, sycl_device)
    assert ref[0].path.kind is PathKind.RESIDENT and ref[0].layout.fmt == "int4"
    layers = ref[0].experts.cache.n_layers
    arr = _arrangements(ref[0].cfg.num_experts * layers, layers)
    for name in ("two-per-layer", "stream"):
        e = _compare(ref, _run(int4_pack, sycl_device, **arr[name]), f"demo int4 sycl {name}")
        _missed(e, name)
        if name == "stream":
            assert e.experts.mirror is None and e.experts.store.reads > 0


def test_int4_pack_two_per_layer_jax_and_sycl_greedy_tokens_identical(int4_pack, sycl_device):
    layers_opts = dict(expert_cache=8)
    sycl = _run(int4_pack, sycl_device, **layers_opts)
    jax = _run(int4_pack, None, backend="jax", **layers_opts)
    for e, _, _ in (sycl, jax):
        _missed(e, e.backend.name)
    assert sycl[2] == jax[2], "int4 pack, 8 slots: JAX and SYCL greedy tokens differ"


def test_blocked_expert_op_arrangements_match_all_resident(sycl_device):
    """One 40-token part (bucket 64: 256 routes, the blocked form; padded rows skipped) then decode, with 2 slots
    per layer (misses borrowed, then fetched) and with 3 staging slots (the part's misses in passes)."""
    def run(**opts):
        e = Engine.load("demo", backend="sycl", device=sycl_device, max_context=256, prefill=64, debug_slots=True,
                        say=lambda line: None, **opts)
        prompt = _prompt(e.cfg.vocab_size)
        return e, e.logits(prompt), e.generate(prompt, GEN, stop_token_ids=[])

    ref = run()
    assert ref[0].path.kind is PathKind.RESIDENT
    for name, opts in (("two-per-layer", dict(expert_cache=8)),
                       ("no-borrow", dict(expert_cache=8, prefill_borrow=False, staging_slots=3))):
        _missed(_compare(ref, run(**opts), f"demo sycl blocked {name}"), name)


@pytest.fixture(scope="module")
def dense_between(tmp_path_factory):
    """A tiny Qwen3-Next whose layer 1 is dense (mlp_only_layers): 3 sparse layers of 8 experts, 2 per token."""
    pytest.importorskip("torch", reason="torch builds the tiny checkpoint with a dense layer")
    from oracle import build_hf_model, save_hf_model
    return save_hf_model(build_hf_model("qwen3_next", 5, mlp_only_layers=[1]), tmp_path_factory.mktemp("dense") / "hf")


def _drive_runner(path, device, backend="sycl", **options):
    """Two slots: a 20-token prompt on each in parts of 8 (stepped.slot_part), then 6 decode windows with both rows
    active (stepped.rows) -> (engine, tokens per slot)."""
    if backend == "sycl":
        options["device"] = device
    e = Engine.load(str(path), backend=backend, max_context=128, prefill=8, debug_slots=True, say=lambda line: None,
                    **options)
    runner = WindowRunner(e, 2, 8)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, e.cfg.vocab_size, 20).astype(np.int32) for _ in range(2)]
    plan = idle_plan(2)
    tokens = []
    for s, prompt in enumerate(prompts):
        for start in range(0, len(prompt), 8):
            res = runner.run(replace(plan, part=PromptPart(slot=s, tokens=prompt[start:start + 8], start=start,
                                                           last=start + 8 >= len(prompt))))
        assert res.part_finite
        tokens.append([res.part_next])
    pos = np.full(2, len(prompts[0]), np.int32)
    for _ in range(6):
        res = runner.run(replace(plan, decode_active=np.ones(2, bool), decode_pos=pos,
                                 decode_tokens=np.array([t[-1] for t in tokens], np.int32)))
        assert res.decode_finite.all()
        pos = pos + 1
        for t, nxt in zip(tokens, res.decode_next):
            t.append(int(nxt))
    return e, tokens


def test_window_runner_with_a_dense_layer_matches_all_resident(dense_between, sycl_device):
    ref, want = _drive_runner(dense_between, sycl_device)
    assert ref.path.kind is PathKind.RESIDENT and ref.experts.cache.n_layers == 3
    e, got = _drive_runner(dense_between, sycl_device, expert_cache=4)
    _missed(e, "dense-between, 4 slots")
    assert got == want, "the stepped runner (slot parts, vmapped decode rows) differs from the fused one"
    j, got_jax = _drive_runner(dense_between, None, backend="jax", expert_cache=4)
    _missed(j, "jax dense-between, 4 slots")
    assert got_jax == want, "JAX and SYCL differ on the stepped runner"
