"""The attention KV's host tier (kv_resident) on the SYCL backend, as seed 000's users run it (`--kv int8
--kv-resident N`): host arrays in USM host memory, attended by the composition (each row's positions copied to the
device); conversations that spill and are parked in place give the text of the one-tier SYCL engine, and a bfloat16
cache is refused naming what to set."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sched"))

from strata import Engine  # noqa: E402
from strata.engine.runner import WindowRunner  # noqa: E402
from strata.errors import ConfigError  # noqa: E402
from test_prompt_cache import converse  # noqa: E402

CONTEXT, PREFILL, RESIDENT = 1024, 32, 128


def test_conversations_over_the_host_tier_match_the_one_tier_engine(sycl_device):
    """Two conversations of 3 turns on one slot, int8 KV: each turn parks the other conversation in place (its host
    row kept) and resumes its own; the windows spill to USM host memory."""
    kw = dict(backend="sycl", device=sycl_device, max_context=CONTEXT, prefill=PREFILL, kv="int8")
    cold = Engine.load("demo", **kw)
    tiered = Engine.load("demo", kv_resident=RESIDENT, kv_parked=1, **kw)
    sched, rows = converse(cold, 2, 3, 1, user_words=60, max_tokens=12, together=False, cached_engine=tiered)
    assert len(rows[-1][0]) > 2 * RESIDENT, len(rows[-1][0])
    m = sched.metrics()
    assert m["kv_spills"] > 0 and m["kv_parks_by_reference"] > 0 and m["conversations_resumed"] > 0
    assert m["prompt_cache_hits"] == 4
    host = [a for layer in sched.executor.states for k, a in layer.items() if k.endswith("_host")]
    assert host and all(a.usm_type == "host" for a in host)


def test_a_bfloat16_cache_is_refused(sycl_device):
    e = Engine.load("demo", backend="sycl", device=sycl_device, max_context=CONTEXT, prefill=PREFILL,
                    kv="bfloat16", kv_resident=RESIDENT)
    with pytest.raises(ConfigError, match="not bfloat16: set kv = int8"):
        WindowRunner(e, 1, PREFILL)
    assert np.dtype(e.kv_dtype).name == "bfloat16"
