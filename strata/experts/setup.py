"""Putting the tiers together at load: plan the device's memory, fill the host mirror, open the cache, place experts
(by profile when one is given), verify, choose the ExpertPath and hand it to the engine.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from strata.errors import ConfigError
from strata.experts.cache import ExpertCache
from strata.experts.moe import MoeRunner
from strata.experts.path import ExpertPath, fetch_possible
from strata.experts.planner import GIB, MIB, MemoryPlan, plan_memory
from strata.experts.profile import load_profile
from strata.experts.stream import AHEAD
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
    window_chunks: list | None = None     # per MoE layer (pinned host chunks, their first experts), when every
                                          # expert is mirrored in pinned memory (HostMirror.window_chunks)

    def __post_init__(self):
        self.window_chunks = self.mirror.window_chunks() if self.mirror is not None else None

    @property
    def window_starts(self) -> tuple:
        """Per MoE layer, the first expert of each host chunk (static for compilation)."""
        return tuple(starts for _, starts in self.window_chunks)

    def fetch_args(self) -> tuple[dict, np.ndarray]:
        """-> (the pool, the slot table and the host chunks for a window-fetch decode, the table it got (host)).
        With --debug-slots every slot of the table is checked against the pack first: the window may read any."""
        c = self.cache
        table = c.table()
        if self.moe.check_uses:
            used = np.flatnonzero(table.reshape(-1) >= 0)
            pairs = [(int(k) // c.n_experts, int(k) % c.n_experts) for k in used]
            if not c.content_matches(c.pool, [int(table.reshape(-1)[k]) for k in used], pairs):
                from strata.experts.moe import SlotMismatch
                raise SlotMismatch("a decode window would read slots whose bytes are not the experts the table "
                                   "names")
            self.moe.uses_checked += len(used)
        args = dict(self.args())
        args["chunks"] = [chunks for chunks, _ in self.window_chunks]
        return args, table

    def record_window(self, table: np.ndarray, counts: np.ndarray, copied: np.ndarray) -> None:
        """What a window-fetch decode did: routing counts [Lp, E] of its real rows, experts it copied [Lp]."""
        c = self.cache
        c.observe_all(counts)
        hits = int(counts[table >= 0].sum())
        c.stats.hits += hits
        c.stats.misses += int(counts.sum()) - hits
        c.stats.window_copies += int(copied.sum())
        c.stats.bytes_copied += int(copied.sum()) * self.layout.nbytes

    def args(self) -> dict:
        """The pool and the slot table by value, for a fused window (the table's device copy is remade only when
        the table changed)."""
        c = self.cache
        if self._table_dev is None or self._table_dev[0] != c.table_version:
            self._table_dev = (c.table_version, c.ops.to_device(c.table()))
        return {"pool": c.pool, "table": self._table_dev[1]}

    def end_window(self, window: int) -> None:
        """Between windows: record streamed parts' routing counts, decay the counts, refill slots freed by loans,
        and every adapt_every windows swap up to adapt_swaps experts."""
        c = self.cache
        self.moe.settle()
        c.end_window()
        if c.all_resident():
            return
        c.refill(verify=self.moe.verify_fills)
        if self.adapt_every and window % self.adapt_every == 0:
            c.adapt(self.adapt_swaps, verify=self.moe.verify_fills)


def build_experts(ops, cfg, store, settings, state_bytes: int, work_bytes: int, compiled, cpu_ops=None,
                  peer_ops=None, say=print) -> ExpertPath:
    """cpu_ops: a CPU backend for miss_policy "cpu" (the misses' expert op runs there); peer_ops: another device's
    backend that computes a share of each prompt part's experts (prefill_help)."""
    opts = settings.experts
    total = store.n_layers * store.n_experts
    slot_bytes = store.layout.nbytes
    staging = 0
    if not opts.prefill_borrow:
        staging = opts.staging_slots or min(cfg.num_experts, 64)
    budget = None if opts.resident_budget_gib is None else int(opts.resident_budget_gib * GIB)
    fetching = fetch_possible(ops, opts)
    if fetching:
        # a window-fetch decode window's staging rows: k experts for each of the runner's rows
        work_bytes += settings.sched.parallel * cfg.num_experts_per_tok * slot_bytes

    def planned(work: int) -> MemoryPlan:
        return plan_memory(ops.free_memory_bytes(), slot_bytes=slot_bytes, total_experts=total,
                           state_bytes=state_bytes, work_bytes=work, expert_cache=opts.expert_cache,
                           vram_reserve_mib=opts.vram_reserve_mib, staging=staging,
                           min_slots=cfg.num_experts_per_tok, host_budget_bytes=budget, stream=opts.stream_experts,
                           device=str(ops.device))
    # prompt parts that stream whole layers hold AHEAD + 1 layers' experts on the device (strata/experts/stream.py),
    # taken from the cache where they fit beside its minimum; else parts copy their misses into borrowed slots
    plan, streams = None, False
    if fetching and opts.stream_parts:
        try:
            plan = planned(work_bytes + (AHEAD + 1) * store.n_experts * slot_bytes)
            streams = plan.slots < total and plan.mirrored == total
        except ConfigError:
            plan = None
    if not streams:
        plan = planned(work_bytes)
    for line in plan.lines():
        say(line)
    priority = None
    if opts.profile:
        priority = load_profile(opts.profile, store.n_layers, store.n_experts)
    mirror = None
    source = store
    # a checkpoint's experts in RAM are their own host tier, but when the cache cannot hold them all, copying them
    # into pinned chunks lets decode windows fetch their misses themselves (at the price of a second copy in RAM)
    if plan.mirrored and (not store.in_memory or (fetching and plan.slots < total and plan.mirrored == total)):
        order = _order(priority, store.n_layers, store.n_experts)
        mirror = HostMirror(store, plan.mirror_bytes, chunk_bytes=opts.host_chunk_mib * MIB, order=order,
                            device=ops.host_fetch)
        source = mirror
    cache = ExpertCache(ops, source, plan.slots, store.n_layers, store.n_experts, decay=opts.adapt_decay)
    moe = MoeRunner(ops, cache, source, store.layout, store.n_experts, compiled, miss_policy=opts.miss_policy,
                    cpu_ops=cpu_ops, borrow=opts.prefill_borrow, staging=plan.staging, check_uses=opts.debug_slots,
                    verify_fills=opts.debug_slots, peer_ops=peer_ops)
    placed = cache.place(priority)
    bad = cache.verify([0])
    if bad:
        raise RuntimeError(f"slot {bad[0]} does not match the pack after it was filled: the copy to the device is "
                           f"broken (checksum mismatch)")
    experts = ExpertSet(store.layout, cache, moe, plan, store, mirror, opts.adapt_every, opts.adapt_swaps)
    path = ExpertPath.choose(ops, experts, cfg.num_experts_per_tok, opts, helped=peer_ops is not None,
                             streams=streams)
    say(f"strata experts: {placed} of {total} experts placed in the cache "
        f"({'by profile' if priority is not None else 'in order'}), slot 0 verified; misses: {path.describe()}; "
        f"prompt parts {_parts(path, opts, plan, cfg)}")
    return path


def _parts(path: ExpertPath, opts, plan: MemoryPlan, cfg) -> str:
    """How prompt parts get the experts they miss, for the start-up line."""
    small = "borrow cache slots" if opts.prefill_borrow else f"use {plan.staging} staging slots"
    if not path.streams_parts:
        return small
    fewest = -(-cfg.num_experts // cfg.num_experts_per_tok)
    return (f"copy each layer's experts whole, the next layer's while one computes (parts under {fewest} tokens "
            f"{small})")


def _order(priority, n_layers: int, n_experts: int):
    """Experts by priority (a profile's counts), highest first; in (layer, expert) order without one."""
    if priority is None:
        return None
    flat = np.asarray(priority, np.float64).reshape(-1)
    order = np.lexsort((np.arange(flat.size), -flat))
    return [(int(k) // n_experts, int(k) % n_experts) for k in order]
