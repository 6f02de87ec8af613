"""The engine with the JAX backend's Pallas kernels (kernels="pallas": interpreted on the CPU, compiled on a GPU with
STRATA_TEST_DEVICE=gpu) against plain XLA (kernels="xla"): the same greedy tokens and logits within float32's
rounding, through Engine sequences (prompt parts: the grouped expert op) and through the WindowRunner's decode rows
(the decode attention kernel over the bank, the decode expert kernel, the routing kernel), for float and int8 KV
caches."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.jax_backend import backend as jb
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
    assert jb.JaxBackend(kernels="pallas").pallas_ops >= jb.PALLAS_AUTO
    assert jb.JaxBackend().pallas_ops == (jb.PALLAS_AUTO if jb.JaxBackend().device.platform == "gpu" else frozenset())
    with pytest.raises(Exception, match="kernels 'cuda' is not allowed; allowed: auto, xla, pallas"):
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
    """Decode windows of 8 slots at different lengths (some inactive in turn) through the decode attention kernel,
    the decode expert kernel (8 rows: at least DECODE_EXPERTS_MIN_TOKENS; the demo's float experts by its tiles
    variant) and the routing kernel."""
    calls = counting(monkeypatch, jb.k_attention, "decode_attention")
    experts = counting(monkeypatch, jb.k_expert_decode, "experts_decode")
    routes = counting(monkeypatch, jb.k_route, "route")
    lengths = np.array([5, 16, 9, 3, 12, 7, 20, 4], np.int32)
    s = len(lengths)
    assert s >= jb.DECODE_EXPERTS_MIN_TOKENS
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
        for step in range(6):
            active = (np.arange(s) + step) % 3 != 0 if step % 2 else np.ones(s, bool)
            r = runner.run(replace(plan, decode_active=active, decode_tokens=toks, decode_pos=pos))
            seen.append(np.where(active, r.decode_next, -1))
            toks = np.where(active, r.decode_next, toks).astype(np.int32)
            pos = pos + active
        out.append(np.stack(seen))
    assert (out[0] == out[1]).all()
    assert calls and experts and routes, "the pallas engine's decode rows did not go through the kernels"
