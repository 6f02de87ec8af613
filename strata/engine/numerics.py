"""The numerics paths a guard's retry runs a slot on (WindowPlan.numerics), besides the engine's own; each computes
that slot's prompt parts and decode rows differently, so a retry never repeats the computation that failed.

  reference_ops  the backend's reference ops (XLA) in place of its own kernels (Pallas), one compiled function per
                 part or window as usual: offered where some kernel of its own runs and every expert is resident
  cpu_experts    every routed expert computed on the CPU from the host tier, layer by layer (no device slot is read)
`build(engine, ladder)` -> the rungs of the ladder this engine runs, in order, and why each other one is left out.
Rows on a rung run after the window's other rows, on the same slot bank, and are read at once (never chained).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from strata.engine.runner import _decode_logits, _logprobs_of, _padded, _prompt_part, _sampling_of, _with_result_rows
from strata.experts.path import PathKind
from strata.plan import WindowPlan


def build(engine, ladder) -> tuple[dict, list[str]]:
    """-> ({name: rung} in ladder order, [why each rung left out was left out])."""
    rungs, left = {}, []
    for name in ladder:
        why = _not_offered(engine, name)
        if why:
            left.append(f"{name} ({why})")
        else:
            rungs[name] = {"reference_ops": ReferenceOps, "cpu_experts": CpuExperts}[name](engine)
    return rungs, left


def _not_offered(engine, name: str) -> str | None:
    if engine.split:
        return "not built for the layer split yet"
    if name == "reference_ops":
        if engine.backend.reference is None:
            return f"the {engine.backend.name} backend runs no kernel of its own here"
        if engine.path.kind is not PathKind.RESIDENT:
            return "experts are not all resident: windows run layer by layer"
        return None
    if name == "cpu_experts":
        if engine.experts is None:
            return "the model has no routed experts"
        if engine.experts.moe.cpu_ops is None:
            return "no CPU backend"
        return None
    return "unknown"


class CpuExperts:
    """Every routed expert on the CPU from the host tier, the rest on the device, layer by layer."""

    def __init__(self, engine):
        self.engine = engine

    def part(self, r, plan: WindowPlan):
        e, p = self.engine, plan.part
        padded = _padded(p.tokens)
        experts = e.path.on_cpu(np.arange(len(padded)) < len(p.tokens))
        logits, r.states, residual = e.by_layer.slot_part(e.params, r.states, p.slot, padded, p.start,
                                                          len(p.tokens), experts)
        return _part_out(r, plan, logits, residual)

    def rows(self, r, plan: WindowPlan):
        e = self.engine
        pos, active = r.decode_rows(plan)
        logits, r.states = e.by_layer.rows(e.params, r.states, plan.decode_tokens, pos, active,
                                           e.path.on_cpu(active > 0))
        return _sampled_rows(r, plan, logits, active)


class ReferenceOps:
    """The engine's compiled part and decode window, traced with the backend's reference ops."""

    def __init__(self, engine):
        self.engine = e = engine
        self.ops = ops = engine.backend.reference
        path = replace(engine.path, ops=ops)
        self._part = e._compile("reference_part", _prompt_part, ops=ops, path=path, donate_argnums=(2,))
        self._logits = e._compile("reference_logits", _decode_logits, ops=ops, path=path, donate_argnums=(2,))

    def part(self, r, plan: WindowPlan):
        e, p = self.engine, plan.part
        i = p.slot
        nxt, fin, r.states, logits, residual, _ = self._part(
            e.params, e.path.args(), r.states, np.int32(i), _padded(p.tokens), np.int32(p.start),
            np.int32(len(p.tokens)), *_sampling_of(plan, i), plan.seeds[i], plan.steps[i])
        return r.part_out(plan, nxt, fin, logits, residual)

    def rows(self, r, plan: WindowPlan):
        e = self.engine
        pos, active = r.decode_rows(plan)
        rows = _with_result_rows(np.stack([np.asarray(plan.decode_tokens, np.int32), pos,
                                           np.asarray(plan.steps, np.int32)]))
        r.states, logits = self._logits(e.params, e.path.args(), r.states, rows, active)
        return _sampled_rows(r, plan, logits, active)


def _part_out(r, plan: WindowPlan, logits, residual):
    """A part's result from its last logits, sampled as a layer-by-layer part samples them (HostPart)."""
    p = plan.part
    if plan.shaped or p.copies:
        return r.part_out(plan, None, None, logits, residual)
    nxt, fin = r._sample(logits, *_sampling_of(plan, p.slot), plan.seeds[p.slot:p.slot + 1],
                         plan.steps[p.slot:p.slot + 1])
    return r.part_out(plan, nxt, fin, logits, residual)


def _sampled_rows(r, plan: WindowPlan, logits, active) -> tuple:
    """Decode rows' (next [S], finite [S], Logprobs or None) on the host, sampled as HostRows samples them."""
    lp = None
    if plan.shaped:
        nxt, fin, lp = r.shaping().sample(plan, logits, active, reset=np.zeros(r.n_slots, np.int32))
    else:
        nxt, fin = r._sample(logits, *plan.sampling, plan.seeds, plan.steps)
    to_host = r.engine.backend.to_host
    lp = _logprobs_of(to_host, lp) if lp is not None and plan.logprobs is not None else None
    return np.asarray(to_host(nxt)), np.asarray(to_host(fin)).astype(bool), lp
