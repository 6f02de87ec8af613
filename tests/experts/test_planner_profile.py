"""The memory planner against devices that report fixed free memory, and routing profiles (strata profile) placing
experts at start."""
from __future__ import annotations

import json

import numpy as np
import pytest

from strata import Engine
from strata.cli import main
from strata.config import Settings
from strata.weights.source import load_source
from strata.errors import ConfigError
from strata.experts.planner import MIB, plan_memory
from strata.experts.profile import load_profile
from strata.experts.stream import AHEAD
from strata.experts.tiers import MemoryStore
from strata.jax_backend.backend import JaxBackend
from strata.model.config import ModelConfig
from strata.model.params import build_params, read_experts
from strata.weights.quant import layout


class FixedMemoryDevice(JaxBackend):
    """A JAX CPU backend that reports a fixed amount of free memory and records every pool allocation."""

    def __init__(self, free_bytes: int):
        super().__init__()
        self.free, self.pools = free_bytes, []

    def free_memory_bytes(self):
        return self.free

    def pool_alloc(self, n, nbytes):
        self.pools.append(n * nbytes)
        return super().pool_alloc(n, nbytes)


def _engine_on(ops, **options):
    config, tensors, _ = load_source("demo")
    cfg = ModelConfig.from_hf(config)
    engine = Engine(cfg, ops.to_device(build_params(cfg, tensors)), ops, Settings.build(
        **{"max_context": 256, "prefill": 64, **options}))
    lines = []
    lay = layout("f32", cfg.hidden_size, cfg.moe_intermediate_size)
    engine.attach_experts(MemoryStore(lay, read_experts(cfg, tensors)), say=lines.append)
    return engine, lines


def _free_for(slots: int, reserve_mib: int = 0) -> int:
    """Free bytes that leave room for exactly `slots` demo experts beside the state and working buffers."""
    probe, _ = _engine_on(FixedMemoryDevice(1 << 40))
    p = probe.experts.plan
    return p.state_bytes + p.work_bytes + reserve_mib * MIB + slots * p.slot_bytes + p.slot_bytes // 2


@pytest.mark.parametrize("slots,reserve", [(10, 0), (24, 1), (40, 2)])
def test_the_plan_fits_the_device_it_printed_and_allocates_what_it_printed(slots, reserve):
    ops = FixedMemoryDevice(_free_for(slots, reserve))
    e, lines = _engine_on(ops, vram_reserve_mib=reserve, stream_parts=False)
    plan = e.experts.plan
    assert plan.slots == slots
    assert plan.planned_bytes + plan.reserve_bytes <= plan.free_bytes            # never beyond the budget
    assert ops.pools[-1] == plan.slots * plan.slot_bytes == e.experts.cache.n_slots * plan.slot_bytes
    assert f"expert cache {slots} slots" in lines[1] and f"reserve {reserve} MiB" in lines[0]
    ids = list(range(3, 20))
    assert e.generate(ids, 4) == Engine.load("demo", max_context=256, say=lambda line: None).generate(ids, 4)


def test_streamed_parts_take_two_layers_from_the_cache_where_they_fit():
    """Prompt parts that stream whole layers (stream_parts) hold AHEAD + 1 layers' experts on the device: the plan
    takes them from the cache; where they do not fit beside its minimum, parts copy their misses instead."""
    e, _ = _engine_on(FixedMemoryDevice(_free_for(60)))
    assert e.path.streams_parts and e.experts.cache.n_slots == 60 - (AHEAD + 1) * e.cfg.num_experts
    small, _ = _engine_on(FixedMemoryDevice(_free_for(10)))
    assert not small.path.streams_parts and small.experts.cache.n_slots == 10


def test_each_device_is_sized_from_its_own_figure():
    small, large = FixedMemoryDevice(_free_for(12)), FixedMemoryDevice(_free_for(30))
    a, _ = _engine_on(small)
    b, _ = _engine_on(large)
    assert (a.experts.plan.free_bytes, b.experts.plan.free_bytes) == (small.free, large.free)
    assert (a.experts.cache.n_slots, b.experts.cache.n_slots) == (12, 30)


def test_a_device_too_small_for_the_minimum_is_refused_naming_what_to_change():
    with pytest.raises(ConfigError, match=r"cannot hold the minimum expert cache.*Lower max_context, parallel"):
        _engine_on(FixedMemoryDevice(_free_for(3)))                   # the demo routes 4 experts per token
    with pytest.raises(ConfigError, match=r"expert_cache 60 needs .* lower expert_cache"):
        _engine_on(FixedMemoryDevice(_free_for(20)), expert_cache=60)


def test_plan_arithmetic():
    p = plan_memory(100 * MIB, slot_bytes=MIB, total_experts=500, state_bytes=10 * MIB, work_bytes=5 * MIB,
                    vram_reserve_mib=20, staging=4, host_budget_bytes=50 * MIB)
    assert p.slots == 65 and p.staging == 4 and p.mirrored == 50
    assert plan_memory(None, slot_bytes=MIB, total_experts=40, state_bytes=0, work_bytes=0).slots == 40
    assert plan_memory(None, slot_bytes=MIB, total_experts=40, state_bytes=0, work_bytes=0, stream=True).mirrored == 0


def test_profile_command_and_placement_by_profile(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("write a function that parses dates\nexplain the fox\\nand the dog\n")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "demo", "--prompts", str(prompts), "--out", str(out), "--max-tokens", "6"]) == 0
    data = json.loads(out.read_text())
    counts = np.array(data["counts"])
    assert counts.shape == (4, 16) and counts.sum() == data["tokens"] * 4 * 4   # every token routes to 4 of 16
    assert "strata profile: 2 prompts" in capsys.readouterr().err
    # placement: a cache of 2 experts per layer's worth holds the 8 most-routed experts
    e = Engine.load("demo", max_context=256, expert_cache=8, profile=str(out), say=lambda line: None)
    table = e.experts.cache.table()
    flat = counts.reshape(-1)
    held = np.flatnonzero(table.reshape(-1) >= 0)
    assert len(held) == 8 and flat[held].min() >= np.sort(flat)[::-1][7]


def test_bad_profiles_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "strata-profile", "version": 1, "counts": [[1, 2]]}))
    with pytest.raises(ConfigError, match="this model has 4 MoE layers x 16 experts"):
        load_profile(bad, 4, 16)
    bad.write_text("not json")
    with pytest.raises(ConfigError, match="cannot read it as a strata profile"):
        load_profile(bad, 4, 16)
    with pytest.raises(ConfigError, match="not a strata-profile"):
        bad.write_text("{}")
        load_profile(bad, 4, 16)
