"""The layer split on the SYCL backend: the CPU device cut into sub-devices (runtime.sub_devices), one queue each,
stands in for two cards. Greedy tokens identical and logits equal to summation order between the unsplit engine and a
split at every layer boundary of the demo model, with every expert resident and with a small expert cache per stage,
and for a pack of every expert format; each stage's parameters on its own queue; prefill help (seed 004's prompt
part) on vs off for int4 and NVFP4 packs. Three stages need three compute units: the 2-core CI machine has two, so
that case runs where there are more."""
from __future__ import annotations

import numpy as np
import pytest

from strata import Engine
from strata.errors import ConfigError
from strata.experts.pack import write_pack
from strata.sycl_backend import runtime
from tests.experts.test_cache_equivalence import _compare

PROMPT_LEN, PART, GEN = 40, 16, 12
QUIET = {"say": lambda line: None}


def _run(device, source="demo", **options):
    e = Engine.load(source, backend="sycl", device=device, max_context=256, prefill=PART, debug_slots=True,
                    **QUIET, **options)
    prompt = np.random.default_rng(3).integers(0, e.cfg.vocab_size, PROMPT_LEN).tolist()
    return e, e.logits(prompt, part_size=PART), e.generate(prompt, GEN)


def _parts(sycl_device, n: int) -> list:
    if sycl_device.max_compute_units < n:
        pytest.skip(f"{runtime.describe(sycl_device)} has {sycl_device.max_compute_units} compute units: "
                    f"{n} sub-devices need {n}")
    return runtime.sub_devices(sycl_device, n)


@pytest.fixture(scope="module")
def unsplit(sycl_device):
    return _run(sycl_device)


@pytest.mark.parametrize("split", ["1", "2", "3"])
def test_split_matches_unsplit(sycl_device, unsplit, split):
    subs = _parts(sycl_device, 2)
    got = _run(subs[0], layer_split=split)
    e = got[0]
    assert [st.ops.sycl_device for st in e.stages] == subs                      # the same objects: one queue each
    for st in e.stages:
        assert st.ops.queue is runtime.queue_for(st.ops.sycl_device)
        assert all(lp["in_norm"].sycl_queue is st.ops.queue for lp in st.params["layers"])
    _compare(unsplit, got, f"sycl layer_split {split}")


def test_three_stages(sycl_device, unsplit):
    subs = _parts(sycl_device, 3)
    _compare(unsplit, _run(subs[0], layer_split="1,3"), "sycl layer_split 1,3")


@pytest.mark.parametrize("split", ["1", "2"])
def test_split_with_a_small_expert_cache_per_stage(sycl_device, unsplit, split):
    subs = _parts(sycl_device, 2)
    got = _run(subs[0], layer_split=split, expert_cache=4)
    caches = [st.experts.cache for st in got[0].stages if st.experts is not None]
    assert caches and not any(c.all_resident() for c in caches)
    _compare(unsplit, got, f"sycl layer_split {split}, expert_cache 4")
    assert sum(c.stats.misses for c in caches) > 0


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "nvfp4"])
def test_split_matches_unsplit_in_every_expert_format(sycl_device, tmp_path, fmt):
    """A pack of each expert format: split across the two sub-devices, a small cache on the first stage, equals the
    unsplit engine on the same pack."""
    subs = _parts(sycl_device, 2)
    pack = write_pack("demo", tmp_path / fmt, fmt)
    got = _run(subs[0], pack, layer_split="2", expert_cache=6)
    assert got[0].stages[0].experts.layout.fmt == fmt
    _compare(_run(sycl_device, pack), got, f"sycl {fmt} pack, layer_split 2")


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_prefill_help_matches_no_help(sycl_device, tmp_path, fmt):
    """../shared/seeds/004_*.txt on SYCL queues: a 1024-token prompt read in one part, the second sub-device
    computing a share of the first stage's experts through the same expert op, gives what it gives unhelped."""
    subs = _parts(sycl_device, 2)
    pack = write_pack("demo", tmp_path / fmt, fmt)
    options = dict(backend="sycl", device=subs[0], max_context=2048, prefill=1024, layer_split="2",
                   debug_slots=True, **QUIET)
    off = Engine.load(pack, **options)
    on = Engine.load(pack, prefill_help=True, **options)
    assert on.stages[0].path.helped
    prompt = np.random.default_rng(7).integers(0, off.cfg.vocab_size, 1024).tolist()
    ref = (off, off.logits(prompt)[-8:], off.generate(prompt, 3))
    _compare(ref, (on, on.logits(prompt)[-8:], on.generate(prompt, 3)), f"sycl {fmt} prefill help on vs off")
    assert on.stages[0].experts.cache.stats.peer_routes > 0


def test_a_foreign_sub_device_is_refused_by_name(sycl_device):
    if sycl_device.max_compute_units < 2:
        pytest.skip("one compute unit: nothing to cut")
    foreign = sycl_device.create_sub_devices(partition=1)[0]         # not made by runtime.sub_devices
    with pytest.raises(ConfigError, match="siblings are unknown"):
        Engine.load("demo", backend="sycl", device=foreign, max_context=256, layer_split="2", **QUIET)
