"""The numerics paths a guard's retry runs a slot on (WindowPlan.numerics), besides the engine's own; each computes
that slot's prompt parts and decode rows differently, so a retry never repeats the computation that failed.

  reference_ops  the backend's reference ops (XLA) in place of its own kernels (Pallas), one compiled function per
                 part or window as usual: offered where some kernel of its own runs and every expert is resident
  float32        the engine's own strategies on float32 activations (its embedding widened; the weights widened as
                 read, the state in its own dtypes): offered where the engine's dtype is not float32
  cpu_experts    every routed expert computed on the CPU from the host tier, layer by layer (no device slot is read)
`build(engine, ladder)` -> the rungs of the ladder this engine runs, in order, and why each other one is left out.
Rows on a rung run after the window's other rows, on the same slot bank, and are read at once (never chained).
"""
from __future__ import annotations

import numpy as np

from strata.engine.runner import (CompiledPart, HostPart, HostRows, _decode_hidden, _decode_logits, _logprobs_of,
                                  _reference_ops, _with_result_rows, rows_before_last)
from strata.experts.path import PathKind
from strata.model.forward import embed
from strata.plan import WindowPlan


def build(engine, ladder) -> tuple[dict, list[str]]:
    """-> ({name: rung} in ladder order, [why each rung left out was left out])."""
    rungs, left = {}, []
    for name in ladder:
        why = _not_offered(engine, name)
        if why:
            left.append(f"{name} ({why})")
        else:
            rungs[name] = {"reference_ops": ReferenceOps, "float32": Float32, "cpu_experts": CpuExperts}[name](engine)
    return rungs, left


def _not_offered(engine, name: str) -> str | None:
    if name == "reference_ops":
        if engine.backend.reference is None:
            return f"the {engine.backend.name} backend runs no kernel of its own here"
        if any(st.path.kind is not PathKind.RESIDENT for st in engine.stages):
            return "experts are not all resident: windows run layer by layer"
        return None
    if name == "float32":
        if np.dtype(engine.dtype) == np.float32:
            return "the engine computes in float32 already"
        return None
    if name == "cpu_experts":
        if engine.experts is None:
            return "the model has no routed experts"
        if engine.experts.moe.cpu_ops is None:
            return "no CPU backend"
        return None
    return "unknown"


def _on_cpu(st, valid, part: bool, owner: str):
    return st.path.on_cpu(valid)


class CpuExperts:
    """Every routed expert on the CPU from the host tier, the rest on the device, layer by layer (the runner's
    layer-by-layer strategies with the CPU's experts, on every stage of a split)."""

    def __init__(self, engine):
        self.engine = engine

    def part(self, r, plan: WindowPlan):
        return HostPart(r, experts_of=_on_cpu).dispatch(plan)

    def rows(self, r, plan: WindowPlan):
        nxt, fin, lp = HostRows(r, experts_of=_on_cpu).dispatch(plan)
        return nxt, np.asarray(fin).astype(bool), lp


class Float32:
    """The engine's own strategies with float32 activations: its compiled part function where every stage's parts
    are compiled, its compiled decode logits where every expert is resident (each traced again for float32 input
    rows), else layer by layer (experts resolved on the host as the engine's own windows resolve them)."""

    def __init__(self, engine):
        self.engine = e = engine
        first = e.stages[0]
        embed = e.compile_on(first, "embed_float32", _embed_float32)
        self.widen = lambda tokens: embed(first.params, np.asarray(tokens, np.int32))
        *self.before, self.last = e.stages
        self.compiled_rows = all(st.path.kind is PathKind.RESIDENT for st in e.stages)
        if self.compiled_rows:
            self._logits = e._compile("decode_logits", _decode_logits, stage=self.last, donate_argnums=(2,))
            self._hidden = [e._compile("decode_hidden", _decode_hidden, stage=st, donate_argnums=(2,))
                            for st in self.before]
        self._part = self._rows = None           # the strategies, made with the first runner

    def part(self, r, plan: WindowPlan):
        if self._part is None or self._part.runner is not r:
            compiled = all(st.path.compiled_parts for st in self.engine.stages)
            self._part = CompiledPart(r, widen=self.widen) if compiled else HostPart(r, widen=self.widen)
        return self._part.dispatch(plan)

    def rows(self, r, plan: WindowPlan):
        if not self.compiled_rows:
            if self._rows is None or self._rows.runner is not r:
                self._rows = HostRows(r, widen=self.widen)
            nxt, fin, lp = self._rows.dispatch(plan)
            return nxt, np.asarray(fin).astype(bool), lp
        return _compiled_rows(r, plan, self.before, self._hidden, self.last, self._logits,
                              self.widen(np.asarray(plan.decode_tokens, np.int32)))


def _embed_float32(ops, params, tokens):
    """The tokens' embedding rows widened to float32 (the float32 path's input rows)."""
    return embed(params, tokens).astype(ops.xp.float32)


class ReferenceOps:
    """The engine's compiled part and decode window, traced with the backend's reference ops (each stage's)."""

    def __init__(self, engine):
        self.engine = e = engine
        *self.before, self.last = e.stages
        self._logits = e._compile("reference_logits", _decode_logits, stage=self.last, donate_argnums=(2,),
                                  **_reference_ops(self.last))
        self._hidden = [e._compile("reference_decode_hidden", _decode_hidden, stage=st, donate_argnums=(2,),
                                   **_reference_ops(st)) for st in self.before]
        self._part = None                        # CompiledPart(reference=True), made with the first runner

    def part(self, r, plan: WindowPlan):
        if self._part is None or self._part.runner is not r:
            self._part = CompiledPart(r, reference=True)
        return self._part.dispatch(plan)

    def rows(self, r, plan: WindowPlan):
        return _compiled_rows(r, plan, self.before, self._hidden, self.last, self._logits)


def _compiled_rows(r, plan: WindowPlan, before: list, hidden: list, last, logits_of, x=None) -> tuple:
    """A rung's decode rows through its compiled functions (hidden: each stage's before the last, logits_of: the
    last's; x: the first stage's input rows, None: the embedding), read at once -> as _sampled_rows."""
    pos, active = r.decode_rows(plan)
    rows = _with_result_rows(np.stack([np.asarray(plan.decode_tokens, np.int32), pos,
                                       np.asarray(plan.steps, np.int32)]))
    x = rows_before_last(r, before, hidden, plan, rows, [], x=x)
    a, b = last.layers.start, last.layers.stop
    r.states[a:b], logits = logits_of(last.params, last.path.args(), r.states[a:b], rows, active, x=x, **r.cv(plan))
    return _sampled_rows(r, plan, logits, active)


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
