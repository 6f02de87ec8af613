"""WindowRunner: runs WindowPlans on the backend over a bank of per-slot sequence states.

The states of all slots are stacked on a leading [S] axis and threaded through every call as one value (donated),
so device order follows data. Decode rows are the single-sequence forward pass mapped over the slots; a prompt part
runs the same forward pass on one slot's state. Inactive decode rows write their key/value into the scratch row
(capacity - 1, beyond max_context, never visible to a real query) and leave the recurrent state unchanged (n_valid 0).
Compilation: one decode function for S, one prompt-part function per bucket; all of them at warm-up.

When the expert cache holds every expert, each call is one compiled function over the slot table (fused). Otherwise
decode rows are still one compiled function when every expert is mirrored in pinned host memory (the device copies
each layer's misses itself: window fetch), and the rest runs the layers one at a time, the routed experts resolved
on the host between them (strata/model/stepped.py); between windows the cache refills loaned slots and makes its
adaptive swaps (at the start of the next run, or, with window fetch, right after its decode is dispatched, so the
host's work overlaps the device's).

Host <-> device traffic per decode window: one int32 [2, S] array (next tokens, finite) comes back, its copy queued
when the window is dispatched. In: one int32 [ROWS, S] array (tokens, positions, steps, and two rows that only carry
results out), which the window also computes for its successor (every active row continued: its token, position + 1,
step + 1; inactive rows unchanged) into the same buffer (donated), with its next tokens and finite flags in the last
two rows: when the next plan asks for exactly those rows, as steady decoding does, nothing is sent. So a compiled
window's outputs are all its donated inputs, at the same addresses every window; the [2, S] result read by the host
is peeled off by a second, tiny call. Why: XLA updates a window's command buffer (CUDA graph) when a buffer's
address changes, and updating one still running made the call wait for it, so windows dispatched ahead ran no
faster than one by one. With windows dispatched ahead each window's fresh result array took a new address, and so
did XLA's temporary buffer unless XLA_FLAGS has --xla_gpu_command_buffer_update_mode=SKIP_TEMP: with both, the
48-layer window at batch 1 took 3.62 ms ahead against 7.51 (bench/dispatch_probe.py --ahead-only, README). The
sampling settings and the active mask are sent only when they
change (strata/engine/core.py DeviceArgs). On the H200 (8 layers, batch 1) the window took ~2.2 ms of which the device was busy
~0.93; sending the rows cost ~0.2-0.3 ms and reading the result ~0.5-0.8 (bench/dispatch_probe.py), while windows
dispatched back to back without reads ran at ~1.0 ms each.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from strata.config import PART_BUCKETS, bucket_for
from strata.engine.core import SAMPLING, DeviceArgs, Engine, all_greedy
from strata.model.forward import forward, forward_rows
from strata.model.stepped import rows_fetching
from strata.plan import Capacity, PromptPart, WindowPlan, WindowResult, idle_plan


class WindowRunner:
    def __init__(self, engine: Engine, n_slots: int, part_size: int):
        if part_size > engine.settings.sched.prefill:
            raise ValueError(f"part size {part_size} exceeds the engine's prefill {engine.settings.sched.prefill}")
        self.engine, self.n_slots, self.part_size = engine, n_slots, part_size
        self.capacity = Capacity(slots=n_slots, part_size=part_size, max_context=engine.settings.model.max_context)
        ops, cfg = engine.backend, engine.cfg
        one = engine.init_state()
        bank = [{k: np.broadcast_to(v, (n_slots,) + v.shape) for k, v in layer.items()} for layer in one]
        self.states = ops.zeros_like(bank)                    # per layer {name: [S, ...]}; init_state is zeros
        self.scratch_pos = engine.capacity - 1
        self.windows = 0
        self._pending_between = False
        self.between_s = 0.0              # host seconds spent on the cache's work between windows, in total
        self._args = DeviceArgs(ops)
        lay = engine.layout
        self._decode = engine.compiled(("decode_rows", lay), lambda: ops.compile(
            partial(_decode_rows, ops, cfg, lay), donate_argnums=(2, 3), static_argnames=("greedy",)))
        self._part = engine.compiled(("prompt_part", lay), lambda: ops.compile(
            partial(_prompt_part, ops, cfg, lay), donate_argnums=(2,)))
        self._sample = engine.compiled("sample_rows", lambda: ops.compile(partial(_sample_rows, ops)))
        # a window's result rows, copied out of the rows it hands its successor (a fresh [2, S] array)
        self._peel = engine.compiled("peel_result", lambda: ops.compile(_result_rows))
        self._decode_fetch = None
        if engine.experts is not None and engine.experts.window_fetch:
            starts = engine.experts.window_starts
            self._decode_fetch = engine.compiled(("decode_rows_fetching", lay, starts), lambda: ops.compile(
                partial(_decode_rows_fetching, ops, cfg, lay, starts), donate_argnums=(2, 3),
                static_argnames=("greedy",)))

    def _between_windows(self) -> None:
        """The cache's work between windows (refill loaned slots, adaptive swaps) for the window that ended last.
        It is deferred to the next run so that, with window fetch, it overlaps the next window on the device."""
        if self._pending_between:
            self._pending_between = False
            t = time.perf_counter()
            self.engine.experts.end_window(self.windows)
            self.between_s += time.perf_counter() - t

    def metrics(self) -> dict:
        """The expert cache's counters (none for a model without routed experts)."""
        x = self.engine.experts
        if x is None:
            return {}
        st = x.cache.stats
        return dict(expert_hits=st.hits, expert_misses=st.misses, expert_fills=st.fills,
                    expert_bytes_copied=st.bytes_copied, expert_copy_seconds=st.copy_seconds,
                    expert_cpu_routes=st.cpu_routes, expert_cpu_seconds=st.cpu_seconds, expert_loans=st.loans,
                    expert_swaps=st.swaps, expert_slots_resident=x.cache.n_resident)

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
        for b in self.buckets():
            self.run(replace(plan, part=PromptPart(slot=0, tokens=np.zeros(b, np.int32), start=0, last=True)))
        if self.engine.experts is not None:       # the warm-up's routes are not traffic: counters start at zero
            st = self.engine.experts.cache.stats
            st.hits = st.misses = st.cpu_routes = st.window_copies = 0
        return time.perf_counter() - t

    @property
    def chains(self) -> bool:
        """Whether a decode window can be dispatched before its predecessor is read (dispatch(plan, after=...)): a
        compiled backend whose decode window is one compiled function, with nothing decided on the host between
        layers: every expert resident, or window fetch (the window copies its misses itself). Either takes the pool
        and the slot table by value, so the cache's work between windows, which may then run while two windows are
        queued, cannot change what a dispatched window reads."""
        e = self.engine
        return not e.backend.eager and (e.fused or self._decode_fetch is not None)

    def window_args(self, plan: WindowPlan) -> tuple:
        """A compiled decode window's arguments after the rows: the active mask, the sampling settings (SAMPLING's
        order) and the seeds, each sent to the device only when it changed (DeviceArgs)."""
        a = self._args
        sp = (plan.temperature, plan.top_k, plan.top_p, plan.min_p)
        return (a.get("active", plan.decode_active.astype(np.int32)), *(a.get(k, v) for k, v in zip(SAMPLING, sp)),
                a.get("seeds", plan.seeds))

    def run(self, plan: WindowPlan) -> WindowResult:
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: WindowPlan, after: "Window | None" = None) -> "Window":
        """Start a window; collect() reads its result. With `after` (a decode-only window dispatched last and not
        yet continued), plan continues it (Scheduler._continuation): its rows are the ones `after` computes on
        the device, so it is dispatched before `after`'s tokens reach the host. Windows are collected in order."""
        e = self.engine
        sp = (plan.temperature, plan.top_k, plan.top_p, plan.min_p)
        w = Window(plan, time.perf_counter())
        fetching = bool(plan.n_decode) and not e.fused and e.experts.window_fetch    # the decode copies its misses
        if after is not None:
            _check_continues(after, plan, self.chains)
        if not fetching:
            self._between_windows()
        if plan.n_decode:
            pos = np.where(plan.decode_active, plan.decode_pos, self.scratch_pos).astype(np.int32)
            w.active = active = plan.decode_active.astype(np.int32)
            if e.fused or fetching:
                a = self._args
                stable = self.window_args(plan)
                if after is not None:            # the predecessor's rows, still on the device (donated to this one)
                    rows_in, after.rows_next, after.successor, w.continues = after.rows_next, None, w, True
                else:
                    w.rows = np.stack([np.asarray(plan.decode_tokens, np.int32), pos,
                                       np.asarray(plan.steps, np.int32)])                     # [3, S]
                    # a compiled window takes the rows its predecessor computed (donated) when they are these
                    # (an eager backend gets them on the host: DeviceArgs)
                    rows_in = a.take("rows", _with_result_rows(w.rows))
                greedy = all_greedy(plan.temperature, plan.decode_active)
                if e.fused:
                    self.states, rows_out = self._decode(e.params, e.expert_args(), self.states, rows_in, *stable,
                                                         greedy=greedy)
                else:
                    args, table = e.experts.fetch_args()
                    self.states, counts, copied, rows_out = self._decode_fetch(e.params, args, self.states, rows_in,
                                                                               *stable, greedy=greedy)
                    w.fetched = (table, counts, copied)
                w.out = rows_out if e.backend.eager else self._peel(rows_out)                        # [2, S]
                w.rows_next = None if e.backend.eager else rows_out
                # what collect() reads (the result; window fetch's counts, which it records), before the host's
                # cache work below
                for x in (w.out, *(w.fetched or ())[1:]):
                    e.backend.start_to_host(x)
                if not e.fused:
                    # the last window's refills and swaps, on the host while the device runs this one (their
                    # copies queue behind it; this window holds the pool and table it was given, by value)
                    self._between_windows()
            else:
                logits, self.states = e.stepped.rows(e.params, self.states, plan.decode_tokens, pos, active)
                nxt, fin = self._sample(logits, *sp, plan.seeds, plan.steps)
                w.decode_read = (np.asarray(e.backend.to_host(nxt)), np.asarray(e.backend.to_host(fin)))
        if plan.part is not None:
            p = plan.part
            n = len(p.tokens)
            padded = np.zeros(bucket_for(n), np.int32)
            padded[:n] = p.tokens
            i = p.slot
            one = [x[i:i + 1] for x in sp]
            if e.fused:
                nxt, fin, self.states = self._part(e.params, e.expert_args(), self.states, np.int32(i), padded,
                                                   np.int32(p.start), np.int32(n), *one, plan.seeds[i],
                                                   plan.steps[i])
            else:
                logits, self.states = e.stepped.slot_part(e.params, self.states, i, padded, p.start, n)
                nxt, fin = self._sample(logits, *one, plan.seeds[i:i + 1], plan.steps[i:i + 1])
            w.part_out = (nxt, fin)
        self.windows += 1
        if e.experts is not None:
            if e.fused:     # every expert resident: every route of the window's real rows was a hit
                rows = plan.n_decode + (len(plan.part.tokens) if plan.part is not None else 0)
                e.experts.cache.stats.hits += rows * e.cfg.num_experts_per_tok * e.experts.cache.n_layers
            self._pending_between = True
        return w

    def collect(self, w: "Window") -> WindowResult:
        """Wait for a dispatched window and read its result (the decode rows' first, then the part's)."""
        t_collect = time.perf_counter()
        e, to_host = self.engine, self.engine.backend.to_host
        decode_next = np.zeros(self.n_slots, np.int32)
        decode_finite = np.ones(self.n_slots, bool)
        if w.out is not None:
            if w.rows is None:
                raise RuntimeError("a continuing window was collected before the window it continues")
            out = np.asarray(to_host(w.out))                                                 # [2, S]
            decode_next, decode_finite = out[0], out[1].astype(bool)
            if not e.backend.eager:
                after = _rows_after(np, w.rows, decode_next, w.active)       # what w.rows_next holds
                if w.rows_next is not None:
                    self._args.known("rows", _with_result_rows(after), w.rows_next)
                if w.successor is not None:
                    w.successor.rows = after
        elif w.decode_read is not None:
            decode_next, decode_finite = w.decode_read
        if w.fetched is not None:
            # a window-fetch decode's routing counts and copies, recorded once it is read (reading them at dispatch
            # made the host wait for the whole window there, and no window could be dispatched ahead)
            table, counts, copied = w.fetched
            w.fetched = None
            e.experts.record_window(table, np.asarray(to_host(counts)), np.asarray(to_host(copied)))
        t1 = time.perf_counter()
        part_next = part_finite = None
        if w.part_out is not None:
            nxt, fin = w.part_out
            part_next = int(np.asarray(to_host(nxt)).reshape(-1)[0])
            part_finite = bool(np.asarray(to_host(fin)).reshape(-1)[0])
        t2 = time.perf_counter()
        # a window is timed from its dispatch; one that continues another from this collect() on, since its
        # dispatch came before its predecessor's result (and is the host's time of that window's turn)
        start = t_collect if w.continues else w.t0
        return WindowResult(decode_next, decode_finite, part_next, part_finite, t1 - start, t2 - t1)


@dataclass(eq=False)
class Window:
    """A dispatched window, not yet read back (WindowRunner.dispatch -> collect)."""
    plan: WindowPlan
    t0: float                            # when it was dispatched (perf_counter)
    active: np.ndarray | None = None     # [S] int32
    rows: np.ndarray | None = None       # [3, S] its rows on the host; a continuing window's, once its
                                         # predecessor is collected
    out: object = None                   # device int32 [2, S]: next tokens, finite (compiled decode rows)
    rows_next: object = None             # device int32 [3, S]: the rows of a window continuing this one; None once
                                         # a continuing window took them
    successor: "Window | None" = None    # the window that continues this one
    continues: bool = False              # dispatched to continue another (dispatch(plan, after=...))
    decode_read: tuple | None = None     # (next [S], finite [S]) already on the host (layer-by-layer decode)
    fetched: tuple | None = None         # window fetch: (the slot table it got [Lp, E] (host), device routing counts
                                         # [Lp, E], device experts copied [Lp]) until collect() records them
    part_out: tuple | None = None        # device (next, finite) of the prompt part


def _check_continues(prev: Window, plan: WindowPlan, chains: bool) -> None:
    """plan may continue prev (its decode rows are the ones prev computes on the device): the same active rows, each
    one position and one step on, no prompt part, prev decode-only and not continued yet."""
    if not chains:
        raise ValueError("this runner cannot continue a window before reading it (its decode is layer by layer: "
                         "experts not all resident and no window fetch; or an eager backend)")
    if prev.plan.part is not None or plan.part is not None or prev.out is None or prev.rows_next is None:
        raise ValueError("only a decode-only window can be continued, by a decode-only plan, once")
    on, want = prev.plan.decode_active, prev.plan.continued()
    if not np.array_equal(on, plan.decode_active):
        raise ValueError("a continuing plan must decode the same rows as the window it continues")
    if not (np.array_equal(plan.decode_pos[on], want.decode_pos[on])
            and np.array_equal(plan.steps[on], want.steps[on])):
        raise ValueError("a continuing plan's rows must be one position and one step past the window it continues")


ROWS = 5      # a window's rows array: tokens, positions, steps (in); next tokens, finite (out)


def _with_result_rows(rows):
    """Host rows [3, S] as a window takes them, [ROWS, S]: the result rows zero (a window reads only the first 3;
    DeviceArgs compares these, so a device buffer holding a window's results in them stands for them)."""
    return np.concatenate([rows, np.zeros((ROWS - 3, rows.shape[1]), np.int32)]).astype(np.int32)


def _result_rows(rows):
    """[ROWS, S] -> the window's result, int32 [2, S] (next tokens, finite): a copy, so the rows can be donated."""
    return rows[3:] + 0


def _decode_rows(ops, cfg, layout, params, experts, states, rows, active, temperature, top_k, top_p, min_p, seeds,
                 greedy: bool = False):
    """rows int32 [ROWS, S]: (tokens, positions, steps) of S rows of one token each (rows 3, 4 ignored) -> (states,
    rows [ROWS, S]: the successor's rows, then this window's next tokens and finite flags; an eager backend's: the
    result [2, S] alone). greedy (static): every active row is greedy (ops.sample's all_greedy)."""
    logits, states = forward_rows(ops, cfg, layout, params, experts, states, rows[0], rows[1], active)   # [S, V]
    out = _sampled(ops, logits, temperature, top_k, top_p, min_p, seeds, rows[2], greedy)
    return states, _rows_out(ops, rows, out, active)


def _rows_out(ops, rows, out, active):
    """The successor's rows and this window's result [2, S] in one [ROWS, S] array (the donated rows' buffer); an
    eager backend's window is not continued on the device: its result [2, S] alone."""
    if ops.eager:
        return out
    xp = ops.xp
    return xp.concatenate([_rows_after(xp, rows, out[0], active), out]).astype(xp.int32)


def _decode_rows_fetching(ops, cfg, layout, starts, params, experts, states, rows, active, temperature, top_k,
                          top_p, min_p, seeds, greedy: bool = False):
    """_decode_rows over a partial cache, in one compiled function (strata/model/stepped.py, rows_fetching)
    -> (states, routing counts [Lp, E], experts copied [Lp], rows [ROWS, S] as _decode_rows returns them)."""
    logits, states, counts, copied = rows_fetching(ops, cfg, layout, starts, params, experts, states, rows[0],
                                                   rows[1], active)
    out = _sampled(ops, logits, temperature, top_k, top_p, min_p, seeds, rows[2], greedy)
    return states, counts, copied, _rows_out(ops, rows, out, active)


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


def _prompt_part(ops, cfg, layout, params, experts, states, slot, tokens, start, n_valid, temperature, top_k, top_p,
                 min_p, seed, step):
    """One prompt part on one slot's state -> (token sampled after its last row, finite, states)."""
    xp = ops.xp
    state = [{k: v[slot] for k, v in layer.items()} for layer in states]
    logits, state, _ = forward(ops, cfg, layout, params, experts, state, tokens, start, n_valid,
                               all_logits=False)                                            # [1, V]
    states = [{k: ops.set_row(states[i][k], slot, v) for k, v in layer.items()} for i, layer in enumerate(state)]
    nxt = ops.sample(logits, temperature, top_k, top_p, min_p, ops.prng_keys(seed[None], step[None]))
    return nxt[0], xp.all(xp.isfinite(logits)), states
