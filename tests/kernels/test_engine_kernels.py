"""The engine with the JAX backend's Pallas kernels (kernels="pallas": interpreted on the CPU, compiled on a GPU with
STRATA_TEST_DEVICE=gpu) against plain XLA (kernels="xla"): the same greedy tokens and logits within float32's
rounding, through Engine sequences (prompt parts: the grouped expert op) and through the WindowRunner's decode rows
(the decode attention kernel over the bank, the routing kernel), for float and int8 KV caches; and the backend's
expert op sending int4 decode rows to the decode expert kernel."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.backend import get_backend
from strata.errors import ConfigError
from strata.jax_backend import backend as jb
from strata.jax_backend.kernel_config import KernelConfig
from strata.engine.runner import WindowRunner
from strata.plan import idle_plan
from strata.plan import PromptPart

TOL = 1e-4           # of the logit range, as the parity suite's float32 tolerance


@pytest.fixture(scope="module", params=["auto", "int8"])
def engines(request):
    kw = dict(max_context=240, prefill=64, kv=request.param, dtype="float32")   # float32 on a GPU too
    return Engine.load("demo", kernels="xla", **kw), Engine.load("demo", kernels="pallas", **kw)


def test_the_options_choose_the_kernels():
    assert jb.JaxBackend(kernels="xla").pallas_ops == frozenset()
    assert jb.JaxBackend(kernels="pallas").pallas_ops == jb.PALLAS_AUTO
    assert jb.JaxBackend().pallas_ops == (jb.PALLAS_AUTO if jb.JaxBackend().device.platform == "gpu" else frozenset())
    with pytest.raises(ConfigError, match=r'kernels = "cuda" \(a string\) is not allowed; kernels must be one of '
                                          r'auto, xla, pallas'):
        Engine.load("demo", kernels="cuda")


def counting(monkeypatch, module, name):
    """Count the calls (traces) of module.name from now on that return (one that refuses its shapes with a ValueError
    leaves the op to XLA, and is not counted)."""
    calls = []
    real = getattr(module, name)

    def counted(*a, **k):
        out = real(*a, **k)
        calls.append(1)
        return out

    monkeypatch.setattr(module, name, counted)
    return calls


def test_prompt_parts_and_decode_match_xla(engines, monkeypatch):
    xla, pallas = engines
    grouped = counting(monkeypatch, jb.k_expert_grouped, "experts_grouped")
    ids = list(range(3, 140))                          # parts of 64: the grouped expert op
    ref, got = xla.logits(ids), pallas.logits(ids)
    assert grouped, "the pallas engine's prompt parts did not go through the grouped expert kernels"
    assert np.abs(got - ref).max() <= TOL * (ref.max() - ref.min())
    assert pallas.generate(ids[:30], 10, stop_token_ids=[]) == xla.generate(ids[:30], 10, stop_token_ids=[])


def test_runner_decode_rows_match_xla(engines, monkeypatch):
    """Decode windows of 8 slots at different lengths (some inactive in turn, and windows of 1, 2 and 4 rows, whose
    attention reads the bank's rows in place) through the decode attention kernel and the routing kernel. (The
    demo's float experts stay with XLA's decode form: the decode expert kernel reads int4 blobs;
    test_backend_sends_int4_decode_rows_to_the_decode_kernel covers it.)"""
    calls = spying(monkeypatch, jb.k_attention, "decode_attention")
    routes = counting(monkeypatch, jb.k_route, "route")
    lengths = np.array([5, 16, 9, 3, 12, 7, 20, 4], np.int32)
    s = len(lengths)
    out = []
    for engine in engines:
        runner = WindowRunner(engine, s, 16)
        plan = idle_plan(s)
        for slot, n in enumerate(lengths):             # prompts of different lengths on the slots
            runner.run(replace(plan, part=PromptPart(slot=slot, tokens=np.arange(3, 3 + n, dtype=np.int32),
                                                     start=0, last=True)))
        pos = lengths.copy()
        toks = np.arange(7, 7 + s, dtype=np.int32)
        seen = []
        few = [np.isin(np.arange(s), on) for on in ([2], [0, 5], [1, 3, 6])]
        for step in range(9):
            active = few[step - 6] if step >= 6 else (np.arange(s) + step) % 3 != 0 if step % 2 else np.ones(s, bool)
            r = runner.run(replace(plan, decode_active=active, decode_tokens=toks, decode_pos=pos))
            seen.append(np.where(active, r.decode_next, -1))
            toks = np.where(active, r.decode_next, toks).astype(np.int32)
            pos = pos + active
        out.append(np.stack(seen))
    assert (out[0] == out[1]).all()
    assert calls and routes, "the pallas engine's decode rows did not go through the kernels"
    assert {k["rows"].shape[0] for k in calls if k["rows"] is not None} == {1, 2, 4}, \
        "windows of fewer rows did not read the bank's rows in place"


def test_the_kernel_config_is_frozen_checked_and_given_at_load():
    assert jb.JaxBackend().kernel_config == KernelConfig() and KernelConfig().changed() == {}
    cfg = KernelConfig(gdn_chunk=128, decode_expert_warps=8)
    assert cfg.changed() == {"gdn_chunk": 128, "decode_expert_warps": 8}
    assert get_backend("jax", kernels="xla", kernel_config=cfg).kernel_config is cfg
    with pytest.raises(AttributeError):
        cfg.gdn_chunk = 64                                  # frozen: a backend's settings never change after load
    for bad, match in ((dict(gdn_chunk=96), "gdn_chunk 96 must be a power of two from 16 to 256"),
                       (dict(gdn_chunk=512), "gdn_chunk 512 must be"),
                       (dict(prompt_block_k=24), r"prompt_block_k 24 must be 0 \(the kernel's\) or a power of two"),
                       (dict(prompt_block_k=8), "prompt_block_k 8 must be 0"),
                       (dict(decode_expert_rows=12), "decode_expert_rows 12 must be a power of two"),
                       (dict(decode_expert_warps=0), "decode_expert_warps 0 must be a power of two"),
                       (dict(decode_expert_min_tokens=0), "decode_expert_min_tokens 0 must be an integer >= 1"),
                       (dict(decode_expert_max_routes=0), "decode_expert_max_routes 0 must be an integer >= 1")):
        with pytest.raises(ConfigError, match=match):
            KernelConfig(**bad)
    with pytest.raises(ConfigError, match="kernel_config must be a KernelConfig, not dict"):
        jb.JaxBackend(kernel_config={"gdn_chunk": 128})


def spying(monkeypatch, module, name):
    """Record the keyword arguments of every call of module.name from now on."""
    calls = []
    real = getattr(module, name)

    def spied(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spied)
    return calls


def test_decode_expert_max_routes_moves_windows_off_the_grouped_kernel(monkeypatch):
    """A window of 24 tokens x 4 routes (96, over GATHER_ROUTES_MAX): the grouped kernel when
    decode_expert_max_routes is below 96, the decode kernel from 96 (as by default); both equal the numpy reference."""
    from test_expert_op import LIMIT, poisoned_pool, rel_err, routes

    from strata.weights import quant
    rng = np.random.default_rng(3)
    lay = quant.layout("int4", 256, 128)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    slots, weight = routes(rng, 24, 4, slot_of)
    x = rng.standard_normal((24, 256)).astype(np.float32)
    want = quant.expert_reference(lay, pool, x, slots, weight)
    decode = spying(monkeypatch, jb.k_expert_decode, "experts_decode")
    grouped = spying(monkeypatch, jb.k_expert_grouped, "experts_grouped")
    assert KernelConfig().decode_expert_max_routes >= 96
    for max_routes, kernel in ((95, grouped), (96, decode)):
        cfg = KernelConfig(decode_expert_max_routes=max_routes)
        got = np.asarray(jb.JaxBackend(kernels="pallas", kernel_config=cfg).experts_pool(x, slots, weight, pool, lay,
                                                                                          10))
        assert rel_err(got, want) <= LIMIT["float32"]["int4"]
        assert len(kernel) == 1 and len(decode) + len(grouped) == 1, (max_routes, decode, grouped)
        decode.clear()
        grouped.clear()


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_backend_sends_int4_decode_rows_to_the_decode_kernel(fmt, monkeypatch):
    """JaxBackend(kernels="pallas").experts_pool: decode rows of int4 blobs (power-of-two groups) go through
    kernels/expert_decode.py with the KernelConfig's rows and warps, from its decode_expert_min_tokens tokens; fewer
    tokens and other formats through XLA's op; every result equal to the numpy reference."""
    from test_expert_op import LIMIT, poisoned_pool, rel_err, routes

    from strata.weights import quant
    rng = np.random.default_rng(0)
    lay = quant.layout(fmt, 256, 128)
    pool, slot_of = poisoned_pool(rng, lay, n_experts=10, n_slots=14)
    ops = jb.JaxBackend(kernels="pallas", kernel_config=KernelConfig(decode_expert_rows=4, decode_expert_warps=2,
                                                                      decode_expert_min_tokens=3))
    decode = spying(monkeypatch, jb.k_expert_decode, "experts_decode")
    for tokens in (2, 3):
        slots, weight = routes(rng, tokens, 4, slot_of)
        x = rng.standard_normal((tokens, 256)).astype(np.float32)
        got = np.asarray(ops.experts_pool(x, slots, weight, pool, lay, 10))
        assert rel_err(got, quant.expert_reference(lay, pool, x, slots, weight)) <= LIMIT["float32"][fmt]
        want = [dict(interpret=ops.interpret, block=4, warps=2)] if fmt == "int4" and tokens == 3 else []
        assert decode == want, f"{fmt}, {tokens} tokens: {decode}"
        decode.clear()
