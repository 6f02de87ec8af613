"""WindowRunner: the Executor (strata/plan.py) over a bank of per-slot sequence states.

The states of all slots are stacked on a leading [S] axis and threaded through every call as one value (donated), so
device order follows data. Decode rows are one token of each slot; a prompt part runs on one slot's state. Inactive
decode rows write their key/value into the scratch row (capacity - 1, beyond max_context, never visible to a real
query) and leave the recurrent state unchanged. One decode function for S, one prompt-part function per bucket, all
compiled at warm-up; the ExpertPath picks CompiledRows or HostRows, CompiledPart or HostPart; a slot on a guard's
numerics path runs that path's rung (engine/numerics.py). In steady decoding the next window can be dispatched before
this one is read (chains): its rows continued on the device, less rows it drops, plus rows that join with the host's
token (merged on the device). Shaped plans sample by Shaping.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from strata.backend import HOST, TIER_BASE, TIER_ROW
from strata.config import PART_BUCKETS, bucket_for
from strata.engine.core import SAMPLING, DeviceArgs, Engine, all_greedy
from strata.engine.images import prompt_rows
from strata.engine.kv_tiers import KvTiers, put_slot_state, slot_state
from strata.engine.sampling import dense_bias, mask_words, sample_shaped
from strata.engine.slot_copies import SlotCopies, put_slot, take_slot
from strata.errors import ConfigError, StrataError
from strata.experts.path import PathKind
from strata.experts.planner import available_ram_bytes
from strata.model.config import LINEAR
from strata.model.forward import finite_rows, forward, forward_hidden, head, row_positions
from strata.plan import (DEFAULT, Capacity, Logprobs, PromptPart, PromptRows, Repair, Saved, WindowPlan, WindowResult,
                         idle_plan)

log = logging.getLogger("strata")


class WindowRunner:
    def __init__(self, engine: Engine, n_slots: int, part_size: int):
        if part_size > engine.settings.sched.prefill:
            raise ValueError(f"part size {part_size} exceeds the engine's prefill {engine.settings.sched.prefill}")
        self.engine, self.n_slots, self.part_size = engine, n_slots, part_size
        self.capacity = Capacity(slots=n_slots, part_size=part_size, max_context=engine.settings.model.max_context,
                                 part_sizes=tuple(self.buckets()), stages=len(engine.stages),
                                 kv_resident=engine.kv_resident)
        ops = engine.backend
        parked = 0
        if engine.kv_resident:
            parked = _host_rows(engine.host_kv_bytes(1), engine.kv_resident, n_slots,
                                engine.settings.model.kv_parked)
        one = engine.init_state(tiers=True)
        bank = [{k: np.broadcast_to(v, (n_slots + (parked if k.endswith(HOST) else 0),) + v.shape)
                 for k, v in layer.items()} for layer in one]
        # per layer {name: [S, ...]} (a two-tier cache's host arrays [S + parked, ...]), each stage's layers on its
        # device; init_state is zeros
        self.states = engine.zeros_state(bank)
        self.scratch_pos = engine.capacity - 1
        self.windows = 0
        self._pending_between = False
        self._args = DeviceArgs(ops)                          # the last stage's (the sampler's)
        self.stage_args = [DeviceArgs(st.ops) for st in engine.stages]
        self._sample = engine.compiled("sample_rows", lambda: ops.compile(partial(_sample_rows, ops)))
        self._copy = [engine.compile_on(st, "copy_slot", _copy_slot, donate_argnums=(0,)) for st in engine.stages]
        # the attention KV's host tier (kv_resident): each slot's window moved before the windows that need it
        self.tiers = KvTiers(self, engine.kv_resident, parked) if engine.kv_resident else None
        self._shaping: Shaping | None = None
        self.copies = SlotCopies(self)
        stages = engine.stages
        self.rows = CompiledRows(self) if all(st.path.compiled_rows for st in stages) else HostRows(self)
        self.part = CompiledPart(self) if all(st.path.compiled_parts for st in stages) else HostPart(self)
        # a decode window can be dispatched before its predecessor is read: a compiled backend whose decode window
        # is one compiled function taking the pool and the slot table by value, so the cache's work between
        # windows, which may then run while two windows are queued, cannot change what a dispatched window reads
        self.chains = isinstance(self.rows, CompiledRows) and not ops.eager
        # such a window may also take its grammar rows' masks after dispatch (give_masks)
        self.capacity = replace(self.capacity, late_masks=self.chains)
        # compiled decode windows of fewer rows than slots (row_slots): 1, 2, 4, ... up to all of them
        if engine.settings.sched.row_buckets and self.chains:
            self.capacity = replace(self.capacity, row_buckets=tuple(1 << i for i in range((n_slots - 1).bit_length())))
        self.spec = None
        if engine.settings.sched.spec:
            from strata.engine.spec import Spec
            self.spec = Spec(self)
            self.capacity = replace(self.capacity, draft=engine.settings.sched.spec)
        from strata.engine.numerics import build
        self.rungs, left = build(engine, engine.settings.sched.ladder)
        self.numerics = tuple(self.rungs)        # the guard's retry ladder (Executor.numerics)
        self._clear = [engine.compile_on(st, "clear_slot", _clear_slot, donate_argnums=(0,)) for st in engine.stages]
        self._clear_after = [engine.compile_on(st, "clear_slot_after", partial(_clear_slot_after,
                                                                               kinds=tuple(st.cfg.layer_types)),
                                               donate_argnums=(0,)) for st in engine.stages]
        if engine.settings.sched.ladder:
            log.info(f"strata guard: retries after a non-finite row run on "
                     f"{', '.join(self.numerics) or 'nothing (no numerics path offered)'}"
                     + (f"; left out: {', '.join(left)}" if left else ""))

    def shaping(self) -> "Shaping":
        """The shaped sampler's state, made at the first window that needs it."""
        if self._shaping is None:
            self._shaping = Shaping(self)
        return self._shaping

    def _between_windows(self) -> None:
        """The cache's work between windows (refill loaned slots, adaptive swaps) for the window that ended last.
        It is deferred to the next run so that, with window fetch, it overlaps the next window on the device."""
        if self._pending_between:
            self._pending_between = False
            for x in self.expert_sets():
                x.end_window(self.windows)

    def expert_sets(self) -> list:
        """Each stage's ExpertSet (one unsplit; none for a model without routed experts)."""
        return [st.experts for st in self.engine.stages if st.experts is not None]

    def metrics(self) -> dict:
        """The expert caches' counters, summed over the stages (none for a model without routed experts); split,
        "stages" lists each stage's (its index, device, layers, counters and the host seconds handing rows to it)."""
        out: dict = {}
        stages = []
        for st in self.engine.stages:
            m = _cache_metrics(st.experts) if st.experts is not None else {}
            for k, v in m.items():
                out[k] = out.get(k, 0) + v
            stages.append(dict(stage=st.index, device=str(st.ops.device), layers=f"{st.layers[0]}-{st.layers[-1]}",
                               handoff_seconds=st.handoff_s, **m))
        if self.engine.split:
            out["stages"] = stages
        if self.tiers is not None:
            out.update(kv_spills=self.tiers.spills, kv_positions_spilled=self.tiers.spilled_positions,
                       kv_reloads=self.tiers.reloads, kv_host_positions=int(self.tiers.base.sum()),
                       kv_parks_by_reference=self.tiers.parks, kv_rows_free=len(self.tiers.free))
        return out

    # --- the prompt cache's copies of a slot's state (Executor; strata/engine/slot_copies.py)
    def snapshot(self, slot: int) -> Saved:
        return self.copies.snapshot(slot)

    def restore(self, slot: int, saved: Saved) -> None:
        self.copies.restore(slot, saved)

    def to_host(self, saved: Saved) -> Saved:
        return self.copies.to_host(saved)

    def save_kv(self, slot: int, n: int) -> Saved:
        return self.copies.save_kv(slot, n)

    def load_kv(self, slot: int, saved: Saved) -> None:
        self.copies.load_kv(slot, saved)

    def drop_kv(self, saved: Saved) -> None:
        self.copies.drop_kv(saved)

    def copy_kv(self, slot: int, n: int, src: int | Saved) -> None:
        self.copies.copy_kv(slot, n, src)

    def host_positions(self, slot: int) -> int:
        return 0 if self.tiers is None else int(self.tiers.base[slot])

    def prompt_rows(self, ids, images: tuple) -> PromptRows | None:
        """A prompt's rotary positions and image rows (its images encoded by the engine's ImageEncoder); None for
        plain text at its cache positions."""
        e = self.engine
        if images and e.split and e.images is not None:
            raise StrataError("images are not supported on a layer split yet: serve the model unsplit")
        return prompt_rows(e.images, ids, images, 0, 0, e.cfg.hidden_size)

    def buckets(self) -> list[int]:
        return [b for b in PART_BUCKETS if b <= bucket_for(self.part_size)]

    def warm_up(self) -> float:
        """Compile every shape the runner will use; -> seconds. Slot states hold garbage afterwards, which is
        harmless: a sequence starting at 0 clears its recurrent state, and keys are written before they are read."""
        t = time.perf_counter()
        s = self.n_slots
        plan = idle_plan(s)
        self.run(replace(plan, decode_active=np.ones(s, bool)))          # the decode rows, every row greedy
        self.run(replace(plan, decode_active=np.ones(s, bool), temperature=np.ones(s, np.float32)))   # or sampled
        for b in self.capacity.row_buckets:       # and windows of fewer rows, plain and shaped
            for temperature in (np.zeros(s, np.float32), np.ones(s, np.float32)):
                for p in (plan, replace(plan, logprobs=np.zeros(s, np.int32))):
                    self.run(replace(p, decode_active=np.arange(s) < b, temperature=temperature))
        for b in self.buckets():
            self.run(replace(plan, part=PromptPart(slot=0, tokens=np.zeros(b, np.int32), start=0, last=True)))
        if self.spec is not None:                 # verify windows, and parts that are not a prompt's last
            k = np.full(s, self.capacity.draft, np.int32)
            for temperature in (np.zeros(s, np.float32), np.ones(s, np.float32)):
                self.run(replace(plan, decode_active=np.ones(s, bool), temperature=temperature, draft_len=k))
            for b in self.buckets():
                self.run(replace(plan, part=PromptPart(slot=0, tokens=np.zeros(b, np.int32), start=0, last=False)))
        # shaped windows (any row with penalties, a bias, a grammar or logprobs) and a part's copies (n > 1)
        shaped = replace(plan, logprobs=np.zeros(s, np.int32))
        one = PromptPart(slot=0, tokens=np.zeros(1, np.int32), start=0, last=True, copies=tuple(range(1, min(s, 2))))
        for temperature in (np.zeros(s, np.float32), np.ones(s, np.float32)):
            self.run(replace(shaped, decode_active=np.ones(s, bool), temperature=temperature))
            self.run(replace(shaped, part=one, temperature=temperature))
        # the prompt cache's copies: a checkpoint out and back (from the device and from the host: the two compile
        # apart), a KV block of each size to the host and back
        self.restore(0, self.snapshot(0))
        held = self.to_host(self.snapshot(0))
        self.restore(0, held)                     # its copy under way, then read into host memory
        self.copies.settle()
        self.restore(0, held)
        spare = self.tiers.free if self.tiers is not None else []
        if self.tiers is not None:                # the copies' own path first (taken with no parked row free)
            self.tiers.free = []
        for n in self.copies.sizes:
            self.load_kv(0, self.save_kv(0, n))
            self.copy_kv(0, n, 0)                 # a branch's prefix from a slot
        if spare:                                 # then a park in place, a copy from it and its resume
            self.tiers.free = spare
            parked = self.save_kv(0, 1)
            for n in self.copies.sizes:
                self.copy_kv(0, n, parked)
            self.load_kv(0, parked)
            self.tiers.parks = 0
        if self.chains and s > 1:                 # a continuing window that a row drops out of (merge_rows)
            full = replace(plan, decode_active=np.ones(s, bool))
            w = self.dispatch(full)
            w_next = self.dispatch(replace(full.continued(), decode_active=np.arange(s) > 0), after=w)
            self.collect(w)
            self.collect(w_next)
        for x in self.expert_sets():              # the warm-up's routes are not traffic: counters start at zero
            x.moe.settle()
            st = x.cache.stats
            st.hits = st.misses = st.cpu_routes = st.window_copies = st.streamed_layers = 0
        return time.perf_counter() - t

    def window_args(self, plan: WindowPlan) -> tuple:
        """A compiled decode window's arguments after the rows: the active mask, the sampling settings (SAMPLING's
        order) and the seeds, each sent to the device only when it changed (DeviceArgs)."""
        a = self._args
        return (a.get("active", plan.decode_active.astype(np.int32)),
                *(a.get(k, v) for k, v in zip(SAMPLING, plan.sampling)),
                a.get("seeds", plan.seeds))

    def control_scales(self, plan: WindowPlan) -> np.ndarray | None:
        """Each slot's control vector scale, float32 [S] (the plan's, else 1); None when the model has none."""
        if self.engine.control is None:
            return None
        if plan.control_scale is None:
            return np.ones(self.n_slots, np.float32)
        return np.asarray(plan.control_scale, np.float32)

    def cv(self, plan: WindowPlan, args: DeviceArgs | None = None, part: bool = False) -> dict:
        """A pass's cv keyword (forward's; none without a control vector): the rows' scales [S], or the part's slot's
        [1] (part), on the device of args' stage (default: the sampler's), sent when they change."""
        scales = self.control_scales(plan)
        if scales is None:
            return {}
        if part:
            scales = scales[plan.part.slot:plan.part.slot + 1]
        return {"cv": (args or self._args).get("cv_part" if part else "cv", scales, device=True)}

    def row_slots(self, plan: WindowPlan) -> np.ndarray | None:
        """The bank rows a compiled decode window computes when that is fewer than all slots: its active rows and
        idle ones up to the smallest bucket holding them, int32 [B] in slot order (an idle row computes nothing
        that is kept: its key goes to the scratch row, its recurrent state is left); None: every slot."""
        on = plan.decode_active
        n = int(on.sum())
        b = next((b for b in self.capacity.row_buckets if b >= n), None)
        if b is None:
            return None
        return np.sort(np.concatenate([np.flatnonzero(on), np.flatnonzero(~on)[:b - n]])).astype(np.int32)

    def decode_rows(self, plan: WindowPlan) -> tuple[np.ndarray, np.ndarray]:
        """-> (positions, active int32) [S] of a plan's decode rows: an inactive row writes to the scratch row."""
        pos = np.where(plan.decode_active, plan.decode_pos, self.scratch_pos).astype(np.int32)
        return pos, plan.decode_active.astype(np.int32)

    def run(self, plan: WindowPlan) -> WindowResult:
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: WindowPlan, after: "Window | None" = None) -> "Window":
        """Start a window; collect() reads its result. With `after` (a decode-only window dispatched last and not
        yet continued), plan continues it (Scheduler._continuation): its rows with token -1 are the ones `after`
        computes on the device, so it is dispatched before `after`'s tokens reach the host; others join with their
        token given, or drop out (_check_continues). Windows are collected in order."""
        w = Window(plan, time.perf_counter())
        if plan.mask_late is not None and not self.capacity.late_masks:
            raise ValueError("mask_late: this runner samples a window's rows with its forward pass (not a compiled "
                             "decode window that can be continued), so every mask is given at dispatch")
        if after is not None:
            _check_continues(after, plan, self.chains)
        if self.tiers is not None:
            self.tiers.fit(plan)
        on_rungs = _rung_rows(plan)                           # the rows of slots on a numerics path
        if on_rungs:
            rest = plan.decode_active.copy()
            for mask in on_rungs.values():
                rest &= ~mask
            base = replace(plan, decode_active=rest)
        else:
            base = plan
        # with window fetch the last window's refills and swaps run on the host while the device runs this one
        # (their copies queue behind it; this window holds the pool and table it was given, by value)
        overlap = bool(base.n_decode) and self.rows.overlaps_cache_work
        if not overlap:
            self._between_windows()
        if base.n_decode and base.draft_len is not None:
            w.decode = self.spec.dispatch(base)          # a verify window (strata/engine/spec.py)
        elif base.n_decode:
            w.decode = self.rows.dispatch(base, after.decode if after is not None else None)
        if self.spec is not None:                        # rows that did not verify left their drafts behind
            self.spec.stale(plan.decode_active & ~base.decode_active if base.draft_len is not None
                            else plan.decode_active)
        if overlap:
            self._between_windows()
        for name, mask in on_rungs.items():
            w.rung_rows.append((mask, self.rungs[name].rows(self, replace(plan, decode_active=mask))))
        if plan.part is not None:
            if plan.penalties is not None:
                self.shaping().read_part(plan)
            t = time.perf_counter()
            numerics = plan.numerics[plan.part.slot] if plan.numerics is not None else DEFAULT
            if numerics != DEFAULT:
                w.part_out = self.rungs[numerics].part(self, plan)
                if self.spec is not None:
                    self.spec.stale(np.isin(np.arange(self.n_slots), (plan.part.slot, *plan.part.copies)))
            else:
                w.part_out = self.part.dispatch(plan) if self.spec is None else self.spec.part(plan)
            w.part_dispatch_s = time.perf_counter() - t
        self.windows += 1
        if self.expert_sets():
            for st in self.engine.stages:
                st.path.count_resident_routes(plan.tokens)
            self._pending_between = True
        w.continues = after is not None
        return w

    def give_masks(self, w: "Window", mask: np.ndarray | None) -> None:
        """Executor.give_masks: the grammar masks [S, W] of a dispatched window's mask_late rows."""
        if w.plan.mask_late is None or not isinstance(w.decode, DeviceRows):
            raise ValueError("give_masks: the window's plan has no mask_late rows")
        self.rows.give_masks(w.decode, None if mask is None else np.asarray(mask, np.int32))

    def collect(self, w: "Window") -> WindowResult:
        """Wait for a dispatched window and read its result (the decode rows' first, then the part's)."""
        t_collect = time.perf_counter()
        to_host = self.engine.backend.to_host
        decode_next = np.zeros(self.n_slots, np.int32)
        decode_finite = np.ones(self.n_slots, bool)
        decode_lp = verified = None
        if w.decode is not None and w.plan.draft_len is not None:
            decode_next, decode_finite, *verified = self.spec.collect(w.decode)
        elif w.decode is not None:
            decode_next, decode_finite, decode_lp = self.rows.collect(w.decode)
        for mask, (nxt, fin, lp) in w.rung_rows:
            decode_next, decode_finite = np.where(mask, nxt, decode_next), np.where(mask, fin, decode_finite)
            decode_lp = _merged_logprobs(decode_lp, lp, mask)
        t1 = time.perf_counter()
        part_next = part_finite = copies_next = part_lp = None
        if w.part_out is not None:
            po = w.part_out
            nxt = np.asarray(to_host(po.next)).reshape(-1)
            fin = np.asarray(to_host(po.finite)).reshape(-1)
            rows = list(po.rows) if po.rows is not None else [0]
            part_next, part_finite = int(nxt[rows[0]]), bool(fin[rows[0]])
            if len(rows) > 1:
                copies_next = nxt[rows[1:]].astype(np.int32)
            if po.logprobs is not None and w.plan.logprobs is not None:
                part_lp = _logprobs_of(to_host, po.logprobs, rows)
        t2 = time.perf_counter()
        # a window is timed from its dispatch; one that continues another from this collect() on, since its
        # dispatch came before its predecessor's result (and is the host's time of that window's turn). A part
        # computed layer by layer runs inside dispatch(): that time is the part's, not the decode rows'.
        start = t_collect if w.continues else w.t0
        spec = dict(zip(("decode_accepted", "decode_n_accepted", "decode_n_drafts"), verified or ()))
        return WindowResult(decode_next, decode_finite, part_next, part_finite, t1 - start - w.part_dispatch_s,
                            t2 - t1 + w.part_dispatch_s,
                            copies_next=copies_next, decode_logprobs=decode_lp, part_logprobs=part_lp, **spec)

    def part_out(self, plan: WindowPlan, nxt, fin, logits, residual) -> "PartOut":
        """A dispatched part's result: its copies (n > 1) take its slot's state, and a shaped plan or copies sample
        from its last row's logits (Shaping.part) instead of the part's own sample (nxt, fin). Its finite flags
        include the part's residual at its end (residual, a device scalar), on the device."""
        p = plan.part
        for c in p.copies:
            self.each_stage(lambda st, states: self._copy[st.index](states, np.int32(p.slot), np.int32(c)))
            if self.tiers is not None:
                self.tiers.copied(p.slot, c)
        if not (plan.shaped or p.copies):
            return PartOut(nxt, fin & residual)
        out = self.shaping().part(plan, logits)
        return replace(out, finite=out.finite & residual)

    def repair(self, slots: tuple[int, ...], rebuild: bool = False, keep: tuple[int, ...] | None = None) -> Repair:
        """Executor.repair: the slots' sequence states (and the MTP head's) zeroed, but the KV of each one's first
        keep[i] positions; every resident expert slot checked against the pack's checksums and the bad ones rewritten
        from the host tier (rebuild: every one rewritten first, and the device copies of window arguments dropped, so
        nothing cached on the device outlives it)."""
        t = time.perf_counter()
        for i, n in zip(slots, keep or (0,) * len(slots)):
            if n:
                if self.tiers is not None:          # the window moved to start at or below n (positions n.. cleared)
                    self.tiers.fit_slot(i, n, n + 1)
                self.each_stage(lambda st, states: self._clear_after[st.index](states, np.int32(i), np.int32(n)))
            else:
                self.each_stage(lambda st, states: self._clear[st.index](states, np.int32(i)))
                if self.tiers is not None:
                    self.tiers.reset(i)
        if self.spec is not None:
            self.spec.clear(slots)
        if rebuild:
            self._args = DeviceArgs(self.engine.backend)
            self.stage_args = [DeviceArgs(st.ops) for st in self.engine.stages]
            self._shaping = None
        sets = self.expert_sets()
        if not sets:
            return Repair(rebuilt=rebuild, seconds=time.perf_counter() - t)
        verified, bad = 0, []
        for x in sets:
            if rebuild:
                x._table_dev = None
            v, b = x.cache.repair(rewrite_all=rebuild)
            verified, bad = verified + v, bad + list(b)
        return Repair(verified, tuple(bad), rebuild, time.perf_counter() - t)

    def each_stage(self, call) -> None:
        """states = call(stage, its layers of the bank) for every stage, written back into the bank."""
        for st in self.engine.stages:
            a, b = st.layers.start, st.layers.stop
            self.states[a:b] = call(st, self.states[a:b])


def rows_before_last(r: WindowRunner, before: list, hidden: list, plan: WindowPlan, rows_in, fetched: list,
                     x=None, handoff: list | None = None, slots=None):
    """A split's stages before the last (`before`, each run by hidden[i], _decode_hidden compiled on it) on a
    window's rows (their copy on each stage's device) -> the hidden rows [S, H] on the last stage's device (None
    unsplit); window fetch: each stage's (ExpertSet, table, counts, copied) appended to fetched. x: the first
    stage's input rows in place of the tokens' embedding (returned as they are, unsplit). handoff: each stage's
    hand-off buffer [S, H], donated to its call (hidden[i] donates its argument 6) and replaced by the output that
    reuses it. slots: the bank rows of a window of fewer rows (row_slots; its hidden rows are the first of x's)."""
    if not before:
        return x
    e = r.engine
    active = plan.decode_active.astype(np.int32)

    def through(st, x):
        a, b = st.layers.start, st.layers.stop
        t = time.perf_counter()
        rows = st.ops.to_device(rows_in)
        act = r.stage_args[st.index].get("active", active)
        st.handoff_s += time.perf_counter() - t
        f = hidden[st.index]
        buf = () if handoff is None else (handoff[st.index],)
        kw = {} if slots is None else {"slots": r.stage_args[st.index].get("slots", slots)}
        kw.update(r.cv(plan, r.stage_args[st.index]))
        if st.path.kind is PathKind.WINDOW_FETCH:
            args, table = st.experts.fetch_args()
            r.states[a:b], x, counts, copied = f(st.params, args, r.states[a:b], rows, act, x, *buf, **kw)
            fetched.append((st.experts, table, counts, copied))
        else:
            r.states[a:b], x = f(st.params, st.path.args(), r.states[a:b], rows, act, x, *buf, **kw)
        if handoff is not None:
            handoff[st.index] = x
        return x
    x = e.hidden(before, x, through)
    last = e.stages[-1]
    t = time.perf_counter()
    x = last.ops.to_device(x)
    last.handoff_s += time.perf_counter() - t
    return x


@dataclass(eq=False)
class Window:
    """A dispatched window, not yet read back (WindowRunner.dispatch -> collect)."""
    plan: WindowPlan
    t0: float                            # when it was dispatched (perf_counter)
    decode: object = None                # the decode rows' handle (the rows strategy's)
    part_out: "PartOut | None" = None    # the prompt part's result on the device
    continues: bool = False              # dispatched to continue another (dispatch(plan, after=...))
    part_dispatch_s: float = 0.0         # host seconds in the part's dispatch (all of it, computed layer by layer)
    rung_rows: list = field(default_factory=list)   # (rows mask [S], (next, finite, logprobs) on the host) of rows
                                                    # on a numerics path, read at dispatch


@dataclass(eq=False)
class PartOut:
    """A prompt part's result on the device: (next, finite) of its one sample, or, sampled by Shaping, [S] each and
    the rows to read (the part's slot, then its copies) with their logprobs."""
    next: object
    finite: object
    rows: tuple | None = None
    logprobs: tuple | None = None


@dataclass(eq=False)
class DeviceRows:
    """A compiled decode window's rows in flight (CompiledRows)."""
    active: np.ndarray                   # [S] int32
    rows: np.ndarray | None              # [3, S] its rows on the host; a continuing window's once its predecessor
                                         # is collected
    out: object                          # device int32 [2, S]: next tokens, finite
    rows_next: object                    # device int32 [ROWS, S]: the rows of a window continuing this one; None
                                         # once a continuing window took them (or on an eager backend)
    fetched: list | None = None          # window fetch, per fetching stage: (its ExpertSet, the slot table it got
                                         # (host), device routing counts [Lp, E], device experts copied [Lp]) until
                                         # collect() records them
    successor: "DeviceRows | None" = None
    logprobs: tuple | None = None        # device (sampled [S], top ids [S, K], top [S, K]) of a plan with logprobs
    given: tuple | None = None           # a continuing window's (rows taken from the host [S] bool, host rows [3, S])
    late: tuple | None = None            # a plan with mask_late until give_masks: (plan, logits, rows_in, greedy,
                                         # slots) of the sampling it waits for


class CompiledRows:
    """Decode rows as one compiled function over the slot table: every expert resident, or window fetch (the
    window copies each layer's misses from pinned host chunks itself; its counts are recorded when it is read).
    A window's outputs are all its donated inputs (the slot states, and the rows [ROWS, S] it hands its successor,
    its next tokens and finite flags in the last two rows), so its buffers keep their addresses from window to
    window (XLA re-records a CUDA graph whose addresses change); the host reads a copy of the result, peeled off
    by a second, tiny call."""

    def __init__(self, runner: WindowRunner):
        self.runner = r = runner
        e, ops = r.engine, r.engine.backend
        *self.before, self.last = e.stages
        self.fetching = self.last.path.kind is PathKind.WINDOW_FETCH
        self.overlaps_cache_work = any(st.path.kind is PathKind.WINDOW_FETCH for st in e.stages)
        self._decode = e._compile("decode_rows", _decode_rows, stage=self.last, donate_argnums=(2, 3),
                                  static_argnames=("greedy",))
        self._logits = e._compile("decode_logits", _decode_logits, stage=self.last, donate_argnums=(2,))
        # a split's stages before the last: their layers of the decode rows, handing on the hidden rows in a buffer
        # of their own that each window donates back (_decode_hidden's buf)
        self._hidden = [e._compile("decode_hidden_into", _decode_hidden, stage=st, donate_argnums=(2, 6))
                        for st in self.before]
        self._handoff = [st.ops.zeros_like(np.zeros((r.n_slots, e.cfg.residual_width), e.dtype))
                         for st in self.before]
        # a window's result rows, copied out of the rows it hands its successor (a fresh [2, S] array)
        self._peel = e.compiled("peel_result", lambda: ops.compile(_result_rows))
        # a continuing window's rows: the predecessor's (donated) with the host's rows where given
        self._merge = e.compiled("merge_rows", lambda: ops.compile(partial(_merged, ops.xp), donate_argnums=(0,)))

    def dispatch(self, plan: WindowPlan, after: DeviceRows | None) -> DeviceRows:
        r = self.runner
        ops = r.engine.backend
        pos, active = r.decode_rows(plan)
        stable = r.window_args(plan)
        rows = np.stack([np.asarray(plan.decode_tokens, np.int32), pos, np.asarray(plan.steps, np.int32)])
        given = None
        if after is not None:          # the predecessor's rows, still on the device (donated to this one)
            rows_in, after.rows_next = after.rows_next, None
            take = _given(after.active, plan)
            if take.any():             # rows that join or drop out take the host's row (a dropped one: scratch)
                rows_in = self._merge(rows_in, _with_result_rows(rows), take.astype(np.int32))
            given, rows = (take, rows), None           # its rows are known once the predecessor is read (collect)
        else:
            # a compiled window takes the rows its predecessor computed (donated) when they are these (an eager
            # backend gets them on the host: DeviceArgs)
            rows_in = r._args.take("rows", _with_result_rows(rows))
        greedy = all_greedy(plan.temperature, plan.decode_active)
        fetched, lp = [], None
        slots = r.row_slots(plan)
        x = self._before_last(plan, rows_in, fetched, slots)
        # a shaped plan's forward pass returns the logits, and Shaping samples from them
        decode, extra = (self._logits, ()) if plan.shaped else (self._decode, stable[1:])
        kw = {} if plan.shaped else {"greedy": greedy}
        if slots is not None:
            kw["slots"] = r._args.get("slots", slots)
        kw.update(r.cv(plan))
        if plan.rope_offset is not None:        # (prompt_rows refuses images on a layer split)
            kw["rope_offset"] = r._args.get("rope_offset", np.asarray(plan.rope_offset, np.int32))
        st = self.last
        a, b = st.layers.start, st.layers.stop
        if self.fetching:
            args, table = st.experts.fetch_args()
            r.states[a:b], counts, copied, out = decode(st.params, args, r.states[a:b], rows_in, stable[0], *extra,
                                                        x=x, **kw)
            fetched.append((st.experts, table, counts, copied))
        else:
            r.states[a:b], out = decode(st.params, st.path.args(), r.states[a:b], rows_in, stable[0], *extra, x=x,
                                        **kw)
        d = DeviceRows(active, rows, None, None, fetched or None, given=given)
        if after is not None:
            after.successor = d
        for y in (c for f in fetched for c in f[2:]):
            ops.start_to_host(y)
        if plan.mask_late is not None:          # sampled once give_masks gives the masks
            d.late = (plan, out, rows_in, greedy, kw.get("slots"))
        else:
            self._sample(d, plan, out, rows_in, greedy, kw.get("slots"))
        return d

    def _sample(self, d: DeviceRows, plan: WindowPlan, out, rows_in, greedy: bool, slots) -> None:
        """A dispatched window's rows: sampled in its compiled function (out), or by Shaping from its logits (out)."""
        ops = self.runner.engine.backend
        rows_out, lp = out, None
        if plan.shaped:
            rows_out, lp = self.runner.shaping().rows(plan, out, rows_in, greedy, slots)
        d.out = rows_out if ops.eager else self._peel(rows_out)                             # [2, S]
        d.rows_next = None if ops.eager else rows_out
        d.logprobs = lp if plan.logprobs is not None else None
        for y in (d.out, *(d.logprobs or ())):                                 # what collect() reads, queued now
            ops.start_to_host(y)

    def give_masks(self, d: DeviceRows, mask: np.ndarray | None) -> None:
        """The grammar masks [S, W] of a window's mask_late rows (its other rows keep the plan's; None: every token
        allowed, their requests ended): it samples now."""
        if d.late is None:
            raise ValueError("give_masks: this window has no rows waiting for masks (mask_late), or got them already")
        (plan, out, rows_in, greedy, slots), d.late = d.late, None
        full = np.array(plan.mask if plan.mask is not None else self.runner.shaping().all_allowed)
        if mask is not None:
            late = np.asarray(plan.mask_late, bool)
            full[late] = mask[late]
        self._sample(d, replace(plan, mask=full), out, rows_in, greedy, slots)

    def _before_last(self, plan: WindowPlan, rows_in, fetched: list, slots=None):
        return rows_before_last(self.runner, self.before, self._hidden, plan, rows_in, fetched,
                                handoff=self._handoff, slots=slots)

    def collect(self, d: DeviceRows) -> tuple[np.ndarray, np.ndarray, Logprobs | None]:
        r = self.runner
        e = r.engine
        if d.rows is None:
            raise RuntimeError("a continuing window was collected before the window it continues")
        if d.late is not None:
            raise RuntimeError("a window with mask_late rows was collected before give_masks gave their masks")
        out = np.asarray(e.backend.to_host(d.out))                                           # [2, S]
        nxt, finite = out[0], out[1].astype(bool)
        if not e.backend.eager:
            rows_after = _rows_after(np, d.rows, nxt, d.active)          # what d.rows_next holds
            if d.rows_next is not None:
                r._args.known("rows", _with_result_rows(rows_after), d.rows_next)
            if d.successor is not None:           # what the successor's rows hold (merged as on the device)
                given, host = d.successor.given
                d.successor.rows = _merged(np, rows_after, host, given)
        if d.fetched is not None:
            # recorded once read (reading them at dispatch made the host wait for the whole window there)
            fetched, d.fetched = d.fetched, None
            for experts, table, counts, copied in fetched:
                experts.record_window(table, np.asarray(e.backend.to_host(counts)),
                                      np.asarray(e.backend.to_host(copied)))
        lp = None if d.logprobs is None else _logprobs_of(e.backend.to_host, d.logprobs)
        return nxt, finite, lp


def _on_host(st, valid, part: bool, owner: str):
    """A stage's routed experts between host-driven layers (strata/experts/moe.py)."""
    return st.path.on_host(valid, part=part, owner=owner)


class HostRows:
    """Decode rows layer by layer, each layer's routes resolved on the host (strata/experts/moe.py); read at once.
    experts_of(stage, valid, part, owner) -> the stage's experts function (default: on_host; the guard's
    cpu_experts path: on the CPU). widen(tokens) -> the first stage's input rows in place of the tokens' embedding
    (the guard's float32 path; None: the embedding)."""

    overlaps_cache_work = False

    def __init__(self, runner: WindowRunner, experts_of=_on_host, widen=None):
        self.runner, self.experts_of, self.widen = runner, experts_of, widen

    def dispatch(self, plan: WindowPlan, after=None) -> tuple:
        r = self.runner
        e = r.engine
        pos, active = r.decode_rows(plan)
        scales = r.control_scales(plan)
        rope = None if plan.rope_offset is None else (pos + np.asarray(plan.rope_offset, np.int32)).astype(np.int32)

        def through(st, x):
            a, b = st.layers.start, st.layers.stop
            experts = self.experts_of(st, active > 0, False, "decode") if st.experts is not None else None
            x, r.states[a:b], _ = st.by_layer.rows_hidden(st.params, r.states[a:b], plan.decode_tokens, pos, active,
                                                           experts, x, cv=scales, rope_pos=rope)
            return x
        last = e.stages[-1]
        x = self.widen(np.asarray(plan.decode_tokens, np.int32)) if self.widen is not None else None
        logits = last.by_layer.head(last.params, e.hidden(e.stages, x, through), len(active), all_logits=True)
        lp = None
        if plan.shaped:
            nxt, fin, lp = r.shaping().sample(plan, logits, active, reset=np.zeros(r.n_slots, np.int32))
        else:
            nxt, fin = r._sample(logits, *plan.sampling, plan.seeds, plan.steps)
        to_host = e.backend.to_host
        lp = _logprobs_of(to_host, lp) if lp is not None and plan.logprobs is not None else None
        return np.asarray(to_host(nxt)), np.asarray(to_host(fin)), lp

    def collect(self, read: tuple) -> tuple[np.ndarray, np.ndarray, Logprobs | None]:
        return read


class CompiledPart:
    """A prompt part as one compiled function on one slot's state (every expert resident)."""

    def __init__(self, runner: WindowRunner, reference: bool = False, widen=None):
        """reference: every stage's compiled with its backend's reference ops (the guard's reference_ops path);
        widen: as HostRows'."""
        self.runner, self.widen = runner, widen
        e = runner.engine
        *self.before, self.last = e.stages
        on, name = (_reference_ops, "reference_") if reference else ((lambda st: {}), "")
        self._part = e._compile(name + "prompt_part", _prompt_part, stage=self.last, donate_argnums=(2,),
                                **on(self.last))
        self._hidden = [e._compile(name + "part_hidden", _part_hidden, stage=st, donate_argnums=(2,), **on(st))
                        for st in self.before]

    def dispatch(self, plan: WindowPlan) -> PartOut:
        return self.run(plan)[0]

    def run(self, plan: WindowPlan) -> tuple[PartOut, object]:
        """-> (the part's result, its last layer's output x [T, H] on the last stage's device: the MTP head's)."""
        r, p = self.runner, plan.part
        e = r.engine
        i = p.slot
        tokens = _padded(p.tokens)
        start, n = np.int32(p.start), np.int32(len(p.tokens))
        rows = _part_rows(e, p, len(tokens))

        def through(st, x):
            a, b = st.layers.start, st.layers.stop
            r.states[a:b], x = self._hidden[st.index](st.params, st.path.args(), r.states[a:b], np.int32(i), tokens,
                                                      start, n, x, **r.cv(plan, r.stage_args[st.index], part=True))
            return x
        x = e.hidden(self.before, self.widen(tokens) if self.widen is not None else None, through)
        st = self.last
        a, b = st.layers.start, st.layers.stop
        x = st.ops.to_device(x) if x is not None else None
        nxt, fin, r.states[a:b], logits, residual, x = self._part(
            st.params, st.path.args(), r.states[a:b], np.int32(i), tokens, start, n, *_sampling_of(plan, i),
            plan.seeds[i], plan.steps[i], x=x, **r.cv(plan, part=True), **rows)
        return r.part_out(plan, nxt, fin, logits, residual), x


class HostPart:
    """A prompt part layer by layer, its misses streamed through staging slots (strata/experts/moe.py);
    experts_of and widen as HostRows'."""

    def __init__(self, runner: WindowRunner, experts_of=_on_host, widen=None):
        self.runner, self.experts_of, self.widen = runner, experts_of, widen

    def dispatch(self, plan: WindowPlan) -> PartOut:
        return self.run(plan)[0]

    def run(self, plan: WindowPlan) -> tuple[PartOut, object]:
        """-> (the part's result, its last layer's output x [T, H]), as CompiledPart.run."""
        r, p = self.runner, plan.part
        e = r.engine
        i, n = p.slot, len(p.tokens)
        padded = _padded(p.tokens)
        valid = np.arange(len(padded)) < n
        rows = _part_rows(e, p, len(padded))
        residual = None
        scales = r.control_scales(plan)
        cv = None if scales is None else scales[i:i + 1]

        def through(st, x):
            nonlocal residual
            a, b = st.layers.start, st.layers.stop
            experts = (self.experts_of(st, valid, len(padded) > 1, f"prompt part of slot {i}")
                       if st.experts is not None else None)
            x, r.states[a:b], residual = st.by_layer.slot_part_hidden(st.params, r.states[a:b], i, padded, p.start,
                                                                       n, experts, x, cv=cv, **rows)
            return x
        last = e.stages[-1]
        x = e.hidden(e.stages, self.widen(padded) if self.widen is not None else None, through)
        logits = last.by_layer.head(last.params, x, n)
        if plan.shaped or p.copies:
            return r.part_out(plan, None, None, logits, residual), x
        nxt, fin = r._sample(logits, *_sampling_of(plan, i), plan.seeds[i:i + 1], plan.steps[i:i + 1])
        return r.part_out(plan, nxt, fin, logits, residual), x


class Shaping:
    """Shaped sampling over a runner's S rows (strata/engine/sampling.py) and its device state: the generated-token
    counts [S, V], updated in the window that samples each token (so chained windows need nothing from the host);
    the prompt tokens of rows with a repetition penalty and the dense logit bias [S, V], kept on the host and sent
    when they change. Made at the first shaped window."""

    def __init__(self, runner: WindowRunner):
        self.runner = r = runner
        e = r.engine
        ops = self.ops = e.backend
        s, v = r.n_slots, e.cfg.vocab_size
        self.counts = ops.zeros_like(np.zeros((s, v), np.int32))
        self.seen = np.zeros((s, v), np.int32)            # host: prompt tokens of rows with a repetition penalty
        self.bias = np.zeros((s, v), np.float32)          # host: each row's dense logit bias
        self._bias_of: list = [None] * s                  # the entries each bias row was built from
        self._sent: dict = {}                             # "seen", "bias": device copies, dropped when changed
        self.neutral = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (s, 1))
        self.all_allowed = np.full((s, mask_words(v)), -1, np.int32)
        self._rows = e.compiled("shaped_rows", lambda: ops.compile(partial(_shaped_rows, ops), donate_argnums=(1, 9),
                                                                   static_argnames=("greedy",)))
        self._sample = e.compiled("shaped_sample", lambda: ops.compile(partial(sample_shaped, ops),
                                                                       donate_argnums=(9,),
                                                                       static_argnames=("greedy",)))

    def read_part(self, plan: WindowPlan) -> None:
        """A part's tokens join its slot's prompt set (a row with a repetition penalty; after a prompt-cache hit, with
        the tokens it reused); its copies get the set."""
        p = plan.part
        if plan.penalties is None or plan.penalties[p.slot, 2] == 1:
            return
        if p.start == 0 or p.reused is not None:
            self.seen[p.slot] = 0
        if p.reused is not None:
            self.seen[p.slot, p.reused] = 1
        self.seen[p.slot, np.asarray(p.tokens)] = 1
        for c in p.copies:
            self.seen[c] = self.seen[p.slot]
        self._sent.pop("seen", None)

    def args(self, plan: WindowPlan, reset: np.ndarray) -> tuple:
        """The shaped samplers' arguments after the sampling settings: penalties, counts, seen, bias, mask, reset."""
        a = self.runner._args
        if plan.bias_ids is not None:
            for i in range(len(self._bias_of)):
                entries = (plan.bias_ids[i].tobytes(), plan.bias_values[i].tobytes())
                if entries != self._bias_of[i]:
                    self.bias[i] = dense_bias(plan.bias_ids[i], plan.bias_values[i], self.bias.shape[1])
                    self._bias_of[i] = entries
                    self._sent.pop("bias", None)
        elif any(b is not None for b in self._bias_of):
            self.bias[:] = 0
            self._bias_of = [None] * len(self._bias_of)
            self._sent.pop("bias", None)
        for name in ("seen", "bias"):
            if name not in self._sent:
                self._sent[name] = self.ops.to_device(getattr(self, name).copy())
        penalties = plan.penalties if plan.penalties is not None else self.neutral
        mask = plan.mask if plan.mask is not None else self.all_allowed
        return (a.get("penalties", penalties, device=True), self.counts, self._sent["seen"], self._sent["bias"],
                a.get("mask", mask, device=True), a.get("reset", reset, device=True))

    def settings(self, plan: WindowPlan, active: np.ndarray, name: str) -> tuple:
        """(active, the sampling settings in SAMPLING's order, seeds) on the device (an eager backend's too)."""
        a = self.runner._args
        return (a.get(name, active, device=True), *(a.get(k, v, device=True) for k, v in zip(SAMPLING, plan.sampling)),
                a.get("seeds", plan.seeds, device=True))

    def rows(self, plan: WindowPlan, logits, rows, greedy: bool, slots=None) -> tuple:
        """A compiled window's decode rows from their logits (of the bank rows `slots`, device [B], when given) ->
        (rows [ROWS, S] as _decode_rows returns them, device logprobs)."""
        active = plan.decode_active.astype(np.int32)
        rows_out, self.counts, lp = self._rows(logits, rows, *self.settings(plan, active, "active"),
                                               *self.args(plan, np.zeros(len(active), np.int32)), greedy=greedy,
                                               slots=slots)
        return rows_out, lp

    def sample(self, plan: WindowPlan, logits, active: np.ndarray, reset: np.ndarray) -> tuple:
        """Rows `active` [S] int32 sample from logits [S, V] or [1, V] -> device (next [S], finite [S], logprobs)."""
        a = self.runner._args
        greedy = all_greedy(plan.temperature, active > 0)
        nxt, fin, self.counts, lp = self._sample(logits, *self.settings(plan, active, "sample_active"),
                                                 a.get("steps", plan.steps, device=True), *self.args(plan, reset),
                                                 greedy=greedy)
        return nxt, fin, lp

    def part(self, plan: WindowPlan, logits) -> PartOut:
        """A last part's first tokens: its slot's and its copies', each from the part's last logits with its own
        settings, seed and a fresh count."""
        p = plan.part
        rows = (p.slot, *p.copies)
        on = np.zeros(self.runner.n_slots, np.int32)
        on[list(rows)] = 1
        nxt, fin, lp = self.sample(plan, logits, on, reset=on)
        return PartOut(nxt, fin, rows, lp)


def _reference_ops(st) -> dict:
    """_compile's ops and path for a stage's reference ops (the backend's plain forms, same device)."""
    return {"ops": st.ops.reference, "path": replace(st.path, ops=st.ops.reference)}


def _part_rows(e: Engine, p: PromptPart, size: int) -> dict:
    """A part's images and rope_pos keywords (forward's), padded to `size` rows: none for plain text at its cache
    positions."""
    if p.rows is None:
        return {}
    part = p.rows.part(0, len(p.tokens), size)
    rows = {"rope_pos": part.rope, "images": None if part.images is None
            else (part.images.astype(e.dtype), part.is_image)}
    return e.backend.to_device(rows) if e.backend.eager else rows      # a compiled backend places them itself


def _padded(tokens) -> np.ndarray:
    out = np.zeros(bucket_for(len(tokens)), np.int32)
    out[:len(tokens)] = tokens
    return out


def _sampling_of(plan: WindowPlan, i: int) -> tuple:
    """Slot i's sampling settings, each [1] (SAMPLING's order)."""
    return tuple(x[i:i + 1] for x in plan.sampling)


def _check_continues(prev: Window, plan: WindowPlan, chains: bool) -> None:
    """plan may continue prev, a decode-only window not continued yet, with a decode-only plan: each row with token -1
    continues a row of prev on the device (one position and one step on); a row with a token given (>= 0) joins, and
    must be inactive in prev (its token is known on the host); rows of prev may drop out (a grammar's next mask needs
    the token prev samples); masks only on rows that join."""
    if not chains:
        raise ValueError("this runner cannot continue a window before reading it (its decode is layer by layer: "
                         "experts not all resident and no window fetch; or an eager backend)")
    d = prev.decode
    if isinstance(d, DeviceRows) and d.late is not None:
        raise ValueError("a window with mask_late rows can be continued only once give_masks gave their masks")
    if (prev.plan.part is not None or plan.part is not None or not plan.n_decode or not isinstance(d, DeviceRows)
            or d.rows_next is None):
        raise ValueError("only a decode-only window can be continued, by a decode-only plan, once")
    if plan.numerics is not None or prev.plan.numerics is not None:
        raise ValueError("a window with rows on a numerics path cannot be continued: those rows are read at once")
    if plan.draft_len is not None or prev.plan.draft_len is not None:
        raise ValueError("a verify window neither continues nor is continued: its rows' positions are known once it "
                         "is read")
    on, active, want = prev.plan.decode_active, plan.decode_active, prev.plan.continued()
    device = active & (plan.decode_tokens < 0)
    if (device & ~on).any():
        raise ValueError(f"rows {np.flatnonzero(device & ~on).tolist()} of a continuing plan have token -1 (from the "
                         f"device) but are inactive in the window it continues")
    if (active & ~device & on).any():
        raise ValueError(f"rows {np.flatnonzero(active & ~device & on).tolist()} of a continuing plan have a token "
                         f"given but are in the window it continues, whose token they need (-1)")
    if not (np.array_equal(plan.decode_pos[device], want.decode_pos[device])
            and np.array_equal(plan.steps[device], want.steps[device])):
        raise ValueError("a continuing plan's rows must be one position and one step past the window it continues")
    if plan.mask is not None and (plan.mask[~(active & ~device)] != -1).any():
        raise ValueError("a continuing plan may have grammar masks only on rows that join (token given): each mask "
                         "follows the token before it")
    if plan.mask_late is not None and (np.asarray(plan.mask_late, bool) & ~device).any():
        raise ValueError("mask_late only on a continuing plan's rows that continue (token -1): a joining row's mask "
                         "is given with it")


def _given(prev_active, plan: WindowPlan) -> np.ndarray:
    """[S] bool: the rows of a plan continuing a window (prev_active [S]) that take the host's row rather than the
    predecessor's: rows that join (token given) and rows that drop out (inactive now, so to the scratch row)."""
    on = np.asarray(prev_active) > 0
    return (plan.decode_active & (plan.decode_tokens >= 0)) | (on & ~plan.decode_active)


def _merged(xp, rows, host, given):
    """rows [R, S] with host [R, S]'s columns where given [S]: a continuing window's rows, computed the same way on
    the device (from the predecessor's rows) and on the host (from what they hold)."""
    return xp.where(given[None, :] > 0, host, rows).astype(xp.int32)


ROWS = 5      # a window's rows array: tokens, positions, steps (in); next tokens, finite (out)


def _with_result_rows(rows):
    """Host rows [3, S] as a window takes them, [ROWS, S]: the result rows zero (a window reads only the first 3;
    DeviceArgs compares these, so a device buffer holding a window's results in them stands for them)."""
    return np.concatenate([rows, np.zeros((ROWS - 3, rows.shape[1]), np.int32)]).astype(np.int32)


def _result_rows(rows):
    """[ROWS, S] -> the window's result, int32 [2, S] (next tokens, finite): a copy, so the rows can be donated."""
    return rows[3:] + 0


def _decode_hidden(ops, cfg, path, layout, params, args, states, rows, active, x, buf=None, taps=None, slots=None,
                   cv=None):
    """A split's stage before the last on a window's decode rows (rows [ROWS, S]: tokens and positions; x [S, W]
    (W: the residual's width) from the stage before, None on the first) -> (its layers' states, x after them);
    window fetch: (states, x, routing counts [Lp, E], experts copied [Lp]). buf [S, W]: x is written into it
    (donated, the hand-off keeps one address window to window, as a command buffer must not see its addresses
    change). slots [B]: as _decode_rows'
    (x: its first B rows in and out); cv: as _decode_rows'."""
    fetching = path.kind is PathKind.WINDOW_FETCH
    counts, copied = ([], []) if fetching else (None, None)
    rows, active, _ = _own_rows(ops, slots, rows, active)
    x, states = forward_hidden(ops, cfg, params, states, rows[0], rows[1], active,
                               path.traced(layout, args, active, counts, copied), taps=taps,
                               x=_first_rows(x, slots), slots=slots, cv=_own_cv(ops, slots, cv))
    if buf is not None:
        x = ops.kv_write(buf, x, 0)
    if fetching:
        return states, x, ops.xp.stack(counts), ops.xp.stack(copied)
    return states, x


def _decode_rows(ops, cfg, path, layout, params, args, states, rows, active, temperature, top_k, top_p, min_p, seeds,
                 greedy: bool = False, taps=None, x=None, slots=None, cv=None, rope_offset=None):
    """rows int32 [ROWS, S]: (tokens, positions, steps) of S rows of one token each (rows 3, 4 ignored) -> (states,
    rows [ROWS, S]: the successor's rows, then this window's next tokens and finite flags; an eager backend's: the
    result [2, S] alone); window fetch: (states, routing counts [Lp, E], experts copied [Lp], rows).
    greedy (static): every active row is greedy (ops.sample's all_greedy). x: as _decode_hidden's (a split's last
    stage). slots [B] (WindowRunner.row_slots): only those rows are computed (every active row among them); the
    others' results are token 0, finite. cv [S]: each row's control vector scale (None: the model has none).
    rope_offset [S]: each row's rotary position minus its position (the text after images; None: 0)."""
    fetching = path.kind is PathKind.WINDOW_FETCH
    counts, copied = ([], []) if fetching else (None, None)
    own, on, sampling = _own_rows(ops, slots, rows, active, (temperature, top_k, top_p, min_p, seeds))
    logits, states = forward(ops, cfg, params, states, own[0], own[1], on,
                             path.traced(layout, args, on, counts, copied), all_logits=True, taps=taps,
                             x=_first_rows(x, slots), slots=slots, cv=_own_cv(ops, slots, cv),
                             rope_pos=_rope_rows(ops, slots, own[1], rope_offset))  # [B, V]
    out = _at_slots(ops, _sampled(ops, logits, *sampling, own[2], greedy), slots, active)
    rows = _rows_out(ops, rows, out, active)
    if fetching:
        return states, ops.xp.stack(counts), ops.xp.stack(copied), rows
    return states, rows


def _own_rows(ops, slots, rows, active, per_row=()):
    """A window's [S] arguments as its computed rows see them: (rows [ROWS, B], active [B], per_row each [B]);
    as given when slots is None."""
    if slots is None:
        return rows, active, per_row
    return (ops.take_rows(rows.T, slots).T, ops.take_rows(active, slots),
            tuple(ops.take_rows(v, slots) for v in per_row))


def _at_slots(ops, out, slots, active):
    """A window's result [2, B] (next tokens, finite) as [2, S]: the rows outside slots token 0, finite (as given when
    slots is None)."""
    if slots is None:
        return out
    xp = ops.xp
    return ops.put_rows(xp.stack([xp.zeros_like(active), xp.ones_like(active)]).T, slots, out.T).T


def _own_cv(ops, slots, cv):
    """A window's control vector scales [S] as its computed rows see them ([B] of slots; None stays None)."""
    return cv if cv is None or slots is None else ops.take_rows(cv, slots)


def _rope_rows(ops, slots, positions, rope_offset):
    """The computed rows' rotary positions: their positions plus their slots' offsets (None: the positions)."""
    if rope_offset is None:
        return None
    return positions + (rope_offset if slots is None else ops.take_rows(rope_offset, slots))


def _first_rows(x, slots):
    """The hidden rows [B, H] handed on to a window of B rows, the first of the hand-off buffer's (x [S, H])."""
    return x if x is None or slots is None else x[:slots.shape[0]]


def _decode_logits(ops, cfg, path, layout, params, args, states, rows, active, taps=None, x=None, slots=None,
                   cv=None, rope_offset=None):
    """_decode_rows's forward pass without its sampler -> (states, logits [S, V], or [B, V] of slots); window fetch:
    (states, routing counts, experts copied, logits). The rows are not donated: the shaped sampler that follows takes
    them."""
    fetching = path.kind is PathKind.WINDOW_FETCH
    counts, copied = ([], []) if fetching else (None, None)
    own, on, _ = _own_rows(ops, slots, rows, active)
    logits, states = forward(ops, cfg, params, states, own[0], own[1], on,
                             path.traced(layout, args, on, counts, copied), all_logits=True, taps=taps,
                             x=_first_rows(x, slots), slots=slots, cv=_own_cv(ops, slots, cv),
                             rope_pos=_rope_rows(ops, slots, own[1], rope_offset))
    if fetching:
        return states, ops.xp.stack(counts), ops.xp.stack(copied), logits
    return states, logits


def _shaped_rows(ops, logits, rows, active, temperature, top_k, top_p, min_p, seeds, penalties, counts, seen, bias,
                 mask, reset, greedy: bool = False, slots=None):
    """Decode rows sampled from their logits with their processing -> (rows as _decode_rows returns them, counts,
    logprobs [S, ...]). slots [B]: logits [B, V] are those bank rows' (as _decode_rows'); the others' counts are
    kept, their logprobs zero."""
    xp = ops.xp
    own, on, per_row = _own_rows(ops, slots, rows, active, (temperature, top_k, top_p, min_p, seeds, penalties,
                                                            counts, seen, bias, mask, reset))
    nxt, fin, counted, lp = sample_shaped(ops, logits, on, *per_row[:5], own[2], *per_row[5:], greedy)
    out = _at_slots(ops, xp.stack([nxt, fin.astype(xp.int32)]), slots, active)
    if slots is not None:
        counted = ops.put_rows(counts, slots, counted)
        lp = tuple(ops.put_rows(xp.zeros(active.shape + x.shape[1:], x.dtype), slots, x) for x in lp)
    return _rows_out(ops, rows, out, active), counted, lp


def _copy_slot(ops, states, src, dst):
    """The slot bank with slot dst's sequence state a copy of slot src's."""
    every = range(len(states))
    return put_slot(ops, states, dst, every, take_slot(ops, states, src, every))


def _logprobs_of(to_host, lp, rows=None) -> Logprobs:
    """Device (sampled [S], top ids [S, K], top [S, K]) -> Logprobs on the host (of `rows` only, when given)."""
    sampled, ids, top = (np.asarray(to_host(x)) for x in lp)
    if rows is not None:
        sampled, ids, top = sampled[rows], ids[rows], top[rows]
    return Logprobs(sampled.astype(np.float32), ids.astype(np.int32), top.astype(np.float32))


def _rows_out(ops, rows, out, active):
    """The successor's rows and this window's result [2, S] in one [ROWS, S] array (the donated rows' buffer); an
    eager backend's window is not continued on the device: its result [2, S] alone."""
    if ops.eager:
        return out
    xp = ops.xp
    return xp.concatenate([_rows_after(xp, rows, out[0], active), out]).astype(xp.int32)


def _rows_after(xp, rows, nxt, active):
    """The rows [3, S] (tokens, positions, steps) of the window that continues every active row of this one: its
    sampled token nxt [S], the next position and step; inactive rows as they were. The same function on the device
    (the successor's rows, kept there) and on the host (what they hold), so the two agree by construction."""
    on = active > 0
    return xp.stack([xp.where(on, nxt, rows[0]), xp.where(on, rows[1] + 1, rows[1]),
                     xp.where(on, rows[2] + 1, rows[2])]).astype(xp.int32)


def _sampled(ops, logits, temperature, top_k, top_p, min_p, seeds, steps, greedy: bool = False):
    """logits [S, V] -> int32 [2, S]: the sampled tokens and whether each row's logits were all finite (one array,
    so one transfer to the host)."""
    nxt, fin = _sample_rows(ops, logits, temperature, top_k, top_p, min_p, seeds, steps, greedy)
    return ops.xp.stack([nxt.astype(ops.xp.int32), fin.astype(ops.xp.int32)])


def _sample_rows(ops, logits, temperature, top_k, top_p, min_p, seeds, steps, greedy: bool = False):
    """logits [B, V] -> (sampled tokens [B], finite [B])."""
    nxt = ops.sample(logits, temperature, top_k, top_p, min_p, ops.prng_keys(seeds, steps), all_greedy=greedy)
    return nxt, ops.xp.all(ops.xp.isfinite(logits), axis=-1)


def _part_hidden(ops, cfg, path, layout, params, args, states, slot, tokens, start, n_valid, x, taps=None, cv=None):
    """A split's stage before the last on a prompt part of one slot: x [T, H] from the stage before (None on the
    first) -> (its layers' states, x after them)."""
    state = slot_state(ops, states, slot)
    x, state = forward_hidden(ops, cfg, params, state, tokens, start, n_valid, path.traced(layout, args, n_valid),
                              taps=taps, x=x, cv=cv)
    return put_slot_state(ops, states, slot, state), x


def _prompt_part(ops, cfg, path, layout, params, args, states, slot, tokens, start, n_valid, temperature, top_k,
                 top_p, min_p, seed, step, taps=None, x=None, cv=None, images=None, rope_pos=None):
    """One prompt part on one slot's state -> (token sampled after its last row, its logits finite, states, its
    last row's logits [1, V] for a shaped sampler, its real rows' residual at the end finite, that residual x [T, H]
    (the MTP head reads it: strata/engine/spec.py)). cv [1]: the slot's control vector scale (None: none). images,
    rope_pos: forward's (a prompt with images)."""
    xp = ops.xp
    state = slot_state(ops, states, slot)
    x, state = forward_hidden(ops, cfg, params, state, tokens, start, n_valid, path.traced(layout, args, n_valid),
                              taps=taps, x=x, cv=cv, images=images, rope_pos=rope_pos)
    logits = head(ops, cfg, params, x, n_valid, all_logits=False)                          # [1, V]
    states = put_slot_state(ops, states, slot, state)
    nxt = ops.sample(logits, temperature, top_k, top_p, min_p, ops.prng_keys(seed[None], step[None]))
    residual = finite_rows(xp, x, row_positions(xp, x.shape[0], start, n_valid)[1])
    return nxt[0], xp.all(xp.isfinite(logits)), states, logits, residual, x


def _cache_metrics(x) -> dict:
    """One ExpertSet's counters, as /metrics names them."""
    x.moe.settle()
    st = x.cache.stats
    return dict(expert_hits=st.hits, expert_misses=st.misses, expert_fills=st.fills,
                expert_layers_streamed=st.streamed_layers, expert_bytes_copied=st.bytes_copied,
                expert_copy_seconds=st.copy_seconds,
                expert_cpu_routes=st.cpu_routes, expert_cpu_seconds=st.cpu_seconds, expert_loans=st.loans,
                expert_swaps=st.swaps, expert_slots_resident=x.cache.n_resident, expert_peer_routes=st.peer_routes,
                expert_peer_seconds=st.peer_seconds)


def _host_rows(row_bytes: int, resident: int, slots: int, parked: int | str, free: int | None = None) -> int:
    """The KV host tier's rows (slots' own + parked) against the RAM the machine has available (free: that figure;
    None: the kernel's MemAvailable, when it reports one): logged, or refused naming what to lower. -> the parked
    rows (auto: one per slot, within half the RAM that the slots' rows leave)."""
    if free is None:
        free = available_ram_bytes()
    if parked == "auto":          # a row a slot, within half the RAM the slots' own rows leave
        parked = slots if free is None else max(0, min(slots, (free - slots * row_bytes) // 2 // row_bytes))
    rows = slots + parked
    line = (f"strata plan: KV host tier: {slots} slots + {parked} parked conversations x {row_bytes / 2**30:.2f} GiB "
            f"of pinned host RAM ({resident} positions a slot on the device)")
    if free is not None and rows * row_bytes > free:
        raise ConfigError(f"{line} needs {rows * row_bytes / 2**30:.2f} GiB, but only {free / 2**30:.2f} GiB of RAM "
                          f"is available: lower max_context, parallel or kv_parked (or kv = int8)")
    log.info(line + (f"; {free / 2**30:.1f} GiB available" if free is not None else ""))
    return parked


def _clear_slot(ops, states, slot):
    """The slot bank with slot's sequence state zeroed (nothing non-finite left in its KV or recurrent state). A
    two-tier cache's host rows are left (and the slot keeps its row): its base goes to 0, and rows at or past base
    are never read."""
    return [{k: v if k.endswith(HOST) or k == TIER_ROW else ops.set_row(v, slot, ops.xp.zeros(v.shape[1:], v.dtype))
             for k, v in layer.items()} for layer in states]


def _clear_slot_after(ops, states, slot, n, kinds=()):
    """_clear_slot but the attention layers' KV of positions 0..n-1 (kinds: the layers' types, static); a two-tier
    cache's window keeps its rows before position n (its base at most n: KvTiers.fit_slot) and its host rows."""
    xp = ops.xp

    def kept(v, first):
        row = ops.take_row(v, slot)
        on = (xp.arange(row.shape[0]) < n - first).reshape((-1,) + (1,) * (row.ndim - 1))
        return ops.set_row(v, slot, xp.where(on, row, xp.zeros((), row.dtype)))

    def cleared(kind, layer):
        if kind == LINEAR:
            return {k: ops.set_row(v, slot, xp.zeros(v.shape[1:], v.dtype)) for k, v in layer.items()}
        first = ops.take_row(layer[TIER_BASE], slot) if TIER_BASE in layer else 0
        return {k: v if k.endswith(HOST) or k in (TIER_BASE, TIER_ROW) else kept(v, first) for k, v in layer.items()}
    return [cleared(kind, layer) for kind, layer in zip(kinds, states)]


def _rung_rows(plan: WindowPlan) -> dict:
    """{numerics path: its active decode rows [S] bool} of the slots on a path other than DEFAULT."""
    if plan.numerics is None:
        return {}
    names = np.asarray(plan.numerics)
    return {n: plan.decode_active & (names == n) for n in dict.fromkeys(plan.numerics) if n != DEFAULT
            and (plan.decode_active & (names == n)).any()}


def _merged_logprobs(base: Logprobs | None, lp: Logprobs | None, mask: np.ndarray) -> Logprobs | None:
    """base's rows with those of `mask` from lp (either may be None)."""
    if lp is None:
        return base
    if base is None:
        return lp
    m = mask[:, None]
    return Logprobs(np.where(mask, lp.sampled, base.sampled), np.where(m, lp.top_ids, base.top_ids),
                    np.where(m, lp.top, base.top))
