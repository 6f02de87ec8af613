"""The engine with the JAX backend's Pallas kernels (kernels="pallas": interpreted on the CPU, compiled on a GPU with
STRATA_TEST_DEVICE=gpu) against plain XLA (kernels="xla"): the same greedy tokens and logits within float32's
rounding, through Engine sequences (prompt parts: the grouped expert op) and through the WindowRunner's decode rows
(the decode attention kernel over the bank, the gated delta rule's decode kernel batched over the rows), for float
and int8 KV caches."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata import Engine
from strata.jax_backend import backend as jb
from strata.runner import WindowRunner, idle_plan
from strata.sched.plan import PromptPart

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
    """Count the calls (traces) of module.name from now on."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_prompt_parts_and_decode_match_xla(engines, monkeypatch):
    xla, pallas = engines
    grouped = counting(monkeypatch, jb.k_expert_grouped, "experts_grouped")
    gdn = counting(monkeypatch, jb.k_gated_delta, "gated_delta_chunked")
    ids = list(range(3, 140))                          # parts of 64: the grouped expert op and chunked delta rule
    ref, got = xla.logits(ids), pallas.logits(ids)
    assert grouped and gdn, "the pallas engine's prompt parts did not go through the kernels"
    assert np.abs(got - ref).max() <= TOL * (ref.max() - ref.min())
    assert pallas.generate(ids[:30], 10, stop_token_ids=[]) == xla.generate(ids[:30], 10, stop_token_ids=[])


def test_runner_decode_rows_match_xla(engines, monkeypatch):
    """Decode windows of 3 slots at different lengths (one inactive) through the decode attention kernel."""
    calls = counting(monkeypatch, jb.k_attention, "decode_attention")
    gdn = counting(monkeypatch, jb.k_gated_delta, "gated_delta_decode")
    out = []
    for engine in engines:
        runner = WindowRunner(engine, 3, 16)
        plan = idle_plan(3)
        for slot, n in ((0, 5), (1, 16), (2, 9)):       # prompts of different lengths on the slots
            runner.run(replace(plan, part=PromptPart(slot=slot, tokens=np.arange(3, 3 + n, dtype=np.int32),
                                                     start=0, last=True)))
        pos = np.array([5, 16, 9], np.int32)
        toks = np.array([7, 8, 9], np.int32)
        seen = []
        for step in range(6):
            active = np.array([True, step % 2 == 0, True])
            r = runner.run(replace(plan, decode_active=active, decode_tokens=toks, decode_pos=pos))
            seen.append(np.where(active, r.decode_next, -1))
            toks = np.where(active, r.decode_next, toks).astype(np.int32)
            pos = pos + active
        out.append(np.stack(seen))
    assert (out[0] == out[1]).all()
    assert calls and gdn, "the pallas engine's decode rows did not go through the decode kernels"
