"""Putting the tiers together at load: plan the device's memory, fill the host mirror, open the cache, place experts
(by profile when one is given), verify, and hand the engine an ExpertSet.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from strata.experts.cache import ExpertCache
from strata.experts.moe import MoeRunner
from strata.experts.planner import GIB, MIB, MemoryPlan, plan_memory
from strata.experts.profile import load_profile
from strata.experts.tiers import HostMirror

log = logging.getLogger("strata")


@dataclass
class ExpertSet:
    layout: object
    cache: ExpertCache
    moe: MoeRunner
    plan: MemoryPlan
    store: object
    mirror: HostMirror | None
    adapt_every: int
    adapt_swaps: int
    _table_dev: tuple | None = None

    @property
    def fused(self) -> bool:
        """Every expert resident: windows run as one compiled function over the slot table (no host round trips)."""
        return self.cache.all_resident()

    def args(self) -> dict:
        """The pool and the slot table by value, for a fused window (the table's device copy is remade only when
        the table changed)."""
        c = self.cache
        if self._table_dev is None or self._table_dev[0] != c.table_version:
            self._table_dev = (c.table_version, c.ops.to_device(c.table()))
        return {"pool": c.pool, "table": self._table_dev[1]}

    def end_window(self, window: int) -> None:
        """Between windows: decay the routing counts, refill slots freed by loans, and every adapt_every windows
        swap up to adapt_swaps experts."""
        c = self.cache
        c.end_window()
        if self.fused:
            return
        c.refill(verify=self.moe.verify_fills)
        if self.adapt_every and window % self.adapt_every == 0:
            c.adapt(self.adapt_swaps, verify=self.moe.verify_fills)


def build_experts(ops, cfg, store, opts, state_bytes: int, work_bytes: int, compiled, say=print) -> ExpertSet:
    total = store.n_layers * store.n_experts
    slot_bytes = store.layout.nbytes
    staging = 0
    if not opts.prefill_borrow:
        staging = opts.staging_slots or min(cfg.num_experts, 64)
    budget = None if opts.resident_budget_gib is None else int(opts.resident_budget_gib * GIB)
    plan = plan_memory(ops.free_memory_bytes(), slot_bytes=slot_bytes, total_experts=total,
                       state_bytes=state_bytes, work_bytes=work_bytes, expert_cache=opts.expert_cache,
                       vram_reserve_mib=opts.vram_reserve_mib, staging=staging,
                       min_slots=cfg.num_experts_per_tok, host_budget_bytes=budget, stream=opts.stream_experts,
                       device=str(getattr(ops, "device", "the device")))
    for line in plan.lines():
        say(line)
    priority = None
    if opts.profile:
        priority = load_profile(opts.profile, store.n_layers, store.n_experts)
    mirror = None
    source = store
    if _is_memory(store) and hasattr(store, "pin") and hasattr(ops, "host_tier"):
        store.pin(ops.host_tier)              # an in-memory source gets its pinned copies from the backend too
    if plan.mirrored and not _is_memory(store):
        order = _order(priority, store.n_layers, store.n_experts)
        mirror = HostMirror(store, plan.mirror_bytes, chunk_bytes=opts.host_chunk_mib * MIB, order=order,
                            pin=getattr(ops, "host_tier", None))
        source = mirror
    cache = ExpertCache(ops, source, plan.slots, store.n_layers, store.n_experts, decay=opts.adapt_decay)
    moe = MoeRunner(ops, cache, source, store.layout, store.n_experts, compiled, miss_policy=opts.miss_policy,
                    borrow=opts.prefill_borrow, staging=plan.staging, check_uses=opts.debug_slots,
                    verify_fills=opts.debug_slots)
    placed = cache.place(priority)
    bad = cache.verify([0])
    if bad:
        raise RuntimeError(f"slot {bad[0]} does not match the pack after it was filled: the copy to the device is "
                           f"broken (checksum mismatch)")
    say(f"strata experts: {placed} of {total} experts placed in the cache "
        f"({'by profile' if priority is not None else 'in order'}), slot 0 verified; misses "
        f"{'are copied in' if opts.miss_policy == 'fetch' else 'run on the CPU'}, prompt parts "
        f"{'borrow cache slots' if opts.prefill_borrow else f'use {plan.staging} staging slots'}")
    return ExpertSet(store.layout, cache, moe, plan, store, mirror, opts.adapt_every, opts.adapt_swaps)


def _is_memory(store) -> bool:
    """A store already in RAM (a checkpoint's experts) is its own host tier: no mirror to fill."""
    return bool(getattr(store, "in_memory", False))


def _order(priority, n_layers: int, n_experts: int):
    """Experts by priority (a profile's counts), highest first; in (layer, expert) order without one."""
    if priority is None:
        return None
    flat = np.asarray(priority, np.float64).reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    return [(int(k) // n_experts, int(k) % n_experts) for k in order]
