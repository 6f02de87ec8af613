"""Walking traced programs, for the kernel tests' static checks (what interpret mode cannot see)."""
from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr


def walk(jaxpr):
    """Every eqn of `jaxpr`, and of the jaxprs inside its eqns (loops, conds, pallas_call bodies), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for s in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(s, (ClosedJaxpr, Jaxpr)):
                    yield from walk(getattr(s, "jaxpr", s))


def pool_operands(fn, *args):
    """The pool operand (the last input) of every pallas_call in fn's traced program, as abstract values."""
    return [eqn.invars[-1].aval for eqn in walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name == "pallas_call"]
