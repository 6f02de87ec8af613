"""ExpertCache: the device slots that hold experts, as a state machine, and the slot table windows compute with.

A slot is FREE, FILLING, RESIDENT(layer, expert, version) or LOANED(owner); an illegal transition raises
SlotStateError (a bug, not a condition to handle). Only RESIDENT slots are in the table (int32 [Lp, E]: slot of (MoE
layer position p, expert e), -1 when not resident), and a window receives the table by value (`table()` returns a
read-only copy), so nothing done to the cache later can change what a running window reads. A loan takes the slot
out of the table *before* the borrower writes into it; a returned slot is FREE until it is refilled (and verified
against the pack). On JAX every pool write produces a new pool value, so a computation dispatched earlier never sees
a later write (../shared/seeds/000_*.txt: a decode window read a slot on loan to a prompt part). Policy state lives
here too: decayed routing counts per (layer, expert) decide victims, refills and swaps between windows.
"""
from __future__ import annotations

import enum
import time
import zlib
from dataclasses import dataclass

import numpy as np


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    RESIDENT = "resident"
    LOANED = "loaned"


@dataclass(frozen=True)
class Slot:
    state: SlotState = SlotState.FREE
    layer: int = -1              # MoE layer position p (RESIDENT, FILLING)
    expert: int = -1
    version: int = 0             # the fill that wrote this content (RESIDENT)
    owner: str | None = None     # LOANED


_CODES = (SlotState.FREE, SlotState.FILLING, SlotState.RESIDENT, SlotState.LOANED)


# A swap costs one copy now and pays off when the newcomer is routed more than the expert it evicts over the counts'
# horizon. Decayed counts are noisy (about Poisson), and the best of thousands of absent experts always looks better
# than the worst residents by a few routes, so a swap needs the difference to exceed SWAP_MARGIN routes plus SWAP_Z
# times the noise of the two counts (sqrt of their sum). The values were chosen in simulation (bench/cache_policy.py):
# docs/performance.md.
SWAP_MARGIN = 1.0
VERIFY_BATCH_BYTES = 256 << 20          # bytes of slots read back at once to be checked
SWAP_Z = 1.0


class SlotStateError(RuntimeError):
    """An illegal slot transition: a bug in the caller."""


@dataclass
class CacheStats:
    hits: int = 0                 # routes whose expert was resident when its layer ran
    misses: int = 0               # routes whose expert was not
    fills: int = 0                # experts written into slots (misses fetched, refills, swaps)
    window_copies: int = 0        # misses a decode window copied from pinned host memory by itself (not kept)
    streamed_layers: int = 0      # MoE layers a prompt part copied whole (stream_parts)
    loans: int = 0                # slots lent to prompt parts
    bytes_copied: int = 0         # host -> device
    copy_seconds: float = 0.0
    cpu_routes: int = 0           # routes computed on the CPU
    cpu_seconds: float = 0.0
    peer_routes: int = 0          # prompt parts' routes computed on a peer device (prefill_help)
    peer_seconds: float = 0.0
    swaps: int = 0                # adaptive swaps between windows
    verified: int = 0             # slots checked against the pack

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["hit_rate"] = self.hits / max(self.hits + self.misses, 1)
        return d


class ExpertCache:
    """n_slots device slots over `source` (an ExpertSource: blob(p, e) bytes, checksum(p, e)).

    ops: the backend (pool_alloc / pool_write / pool_read). The pool is uint8 [n_slots, nbytes]."""

    def __init__(self, ops, source, n_slots: int, n_layers: int, n_experts: int, decay: float = 0.99):
        if n_slots < 1:
            raise ValueError(f"an expert cache needs at least 1 slot, found {n_slots}")
        self.ops, self.source = ops, source
        self.n_slots, self.n_layers, self.n_experts = n_slots, n_layers, n_experts
        self.nbytes = source.layout.nbytes
        self.pool = ops.pool_alloc(n_slots, self.nbytes)
        self._slots = [Slot() for _ in range(n_slots)]
        # the same facts as arrays, for the policy's vectorised choices over thousands of slots
        self._code = np.zeros(n_slots, np.int8)                        # index into _CODES
        self._pe = np.zeros((n_slots, 2), np.int64)                    # (layer, expert) of a RESIDENT slot
        self._ver = np.zeros(n_slots, np.int64)
        self._table = np.full((n_layers, n_experts), -1, np.int32)
        self._version = 0
        self.table_version = 0       # changes whenever the table does (device copies of it are keyed by it)
        self.decay = decay
        self.score = np.zeros((n_layers, n_experts), np.float64)     # decayed routing counts
        self.routed = np.zeros((n_layers, n_experts), np.int64)      # all routing counts since load (profiles)
        self.stats = CacheStats()

    # --- what windows see
    def table(self) -> np.ndarray:
        """The slot table by value: a read-only copy, RESIDENT slots only."""
        t = self._table.copy()
        t.setflags(write=False)
        return t

    def table_row(self, p: int) -> np.ndarray:
        """One MoE layer's row of the table, by value."""
        return self._table[p].copy()

    def slot(self, i: int) -> Slot:
        return self._slots[i]

    def slot_of(self, p: int, e: int) -> int:
        return int(self._table[p, e])

    @property
    def n_resident(self) -> int:
        return int((self._table >= 0).sum())

    def all_resident(self) -> bool:
        return self.n_resident == self.n_layers * self.n_experts

    def free_slots(self) -> list[int]:
        return np.flatnonzero(self._code == _CODES.index(SlotState.FREE)).tolist()

    def _resident(self) -> np.ndarray:
        return np.flatnonzero(self._code == _CODES.index(SlotState.RESIDENT))

    # --- transitions
    def _move(self, i: int, want_from: tuple[SlotState, ...], to: Slot) -> None:
        s = self._slots[i]
        if s.state not in want_from:
            raise SlotStateError(f"slot {i} is {s.state.value}, expected {'/'.join(w.value for w in want_from)} "
                                 f"before becoming {to.state.value}")
        if s.state is SlotState.RESIDENT:
            self._table[s.layer, s.expert] = -1
            self.table_version += 1
        self._slots[i] = to
        self._code[i] = _CODES.index(to.state)
        self._pe[i] = (to.layer, to.expert)
        self._ver[i] = to.version
        if to.state is SlotState.RESIDENT:
            if self._table[to.layer, to.expert] >= 0:
                raise SlotStateError(f"expert ({to.layer}, {to.expert}) is already resident in slot "
                                     f"{self._table[to.layer, to.expert]}; slot {i} cannot hold it too")
            self._table[to.layer, to.expert] = i
            self.table_version += 1

    def evict(self, i: int) -> None:
        """RESIDENT -> FREE (out of the table)."""
        self._move(i, (SlotState.RESIDENT,), Slot())

    def fill(self, slots, pairs, verify: bool = False) -> None:
        """FREE -> FILLING -> RESIDENT(p, e, version): write the experts `pairs` [(p, e)] into `slots`."""
        slots = [int(i) for i in slots]
        if len(slots) != len(pairs):
            raise ValueError(f"{len(slots)} slots for {len(pairs)} experts")
        if not slots:
            return
        for i, (p, e) in zip(slots, pairs):
            self._move(i, (SlotState.FREE,), Slot(SlotState.FILLING, p, e))
        self.pool = self._write(slots, pairs)
        for i, (p, e) in zip(slots, pairs):
            self._version += 1
            self._move(i, (SlotState.FILLING,), Slot(SlotState.RESIDENT, p, e, self._version))
        self.stats.fills += len(slots)
        if verify:
            self.verify(slots)

    def loan(self, n: int, owner: str, keep=()) -> list[int]:
        """Lend n slots to `owner` (a prompt part): FREE ones first, then the least valuable RESIDENT ones not in
        `keep`; each leaves the table before the borrower can write to it. Fewer than n if not enough are free."""
        chosen = self.victims(n, keep)
        for i in chosen:
            if self._slots[i].state is SlotState.RESIDENT:
                self.evict(i)
            self._move(i, (SlotState.FREE,), Slot(SlotState.LOANED, owner=owner))
        self.stats.loans += len(chosen)
        return chosen

    def write_loaned(self, slots, pairs, owner: str) -> None:
        """The borrower writes experts into slots it holds on loan (they stay LOANED and out of the table)."""
        for i in slots:
            s = self._slots[i]
            if s.state is not SlotState.LOANED or s.owner != owner:
                raise SlotStateError(f"slot {i} is {s.state.value} (owner {s.owner}); {owner} cannot write to it")
        self.pool = self._write([int(i) for i in slots], pairs)

    def give_back(self, slots, owner: str) -> None:
        """LOANED(owner) -> FREE: the content is not trusted until refilled."""
        for i in slots:
            s = self._slots[i]
            if s.state is not SlotState.LOANED or s.owner != owner:
                raise SlotStateError(f"slot {i} is {s.state.value} (owner {s.owner}); {owner} cannot return it")
            self._move(i, (SlotState.LOANED,), Slot())

    def reserve(self, n: int, owner: str) -> list[int]:
        """Slots set aside for good (staging buffers when prompt parts do not borrow): LOANED to `owner`."""
        return self.loan(n, owner)

    # --- policy
    def victims(self, n: int, keep=()) -> list[int]:
        """Up to n slots to reuse: FREE first, then RESIDENT by lowest score, never one in `keep`."""
        keep = np.fromiter((int(i) for i in keep), np.int64)
        free = np.flatnonzero(self._code == _CODES.index(SlotState.FREE))
        free = free[~np.isin(free, keep)]
        if len(free) >= n:
            return free[:n].tolist()
        res = self._resident()
        res = res[~np.isin(res, keep)]
        score = self.score[self._pe[res, 0], self._pe[res, 1]]
        order = np.lexsort((self._ver[res], score))[:n - len(free)]     # lowest score, then oldest fill
        return free.tolist() + res[order].tolist()

    def observe(self, p: int, counts: np.ndarray) -> None:
        """Routing counts [E] of MoE layer p from one window."""
        self.score[p] += counts
        self.routed[p] += counts.astype(np.int64)

    def observe_all(self, counts: np.ndarray) -> None:
        """Routing counts [Lp, E] of one window (all layers)."""
        self.score += counts
        self.routed += np.asarray(counts).astype(np.int64)

    def end_window(self) -> None:
        self.score *= self.decay

    def refill(self, limit: int | None = None, verify: bool = False) -> int:
        """Fill FREE slots with the best-scoring experts not resident (between windows). -> slots filled."""
        free = self.free_slots()
        if limit is not None:
            free = free[:limit]
        if not free:
            return 0
        pairs = self._best_absent(len(free))
        self.fill(free[:len(pairs)], pairs, verify=verify)
        return len(pairs)

    def adapt(self, max_swaps: int, verify: bool = False, margin: float = SWAP_MARGIN, z: float = SWAP_Z) -> int:
        """Swap up to max_swaps low-scoring residents for higher-scoring absent experts (between windows): a swap
        needs the newcomer's decayed count above the evicted one's by more than margin + z * sqrt(sum of both)
        routes (see SWAP_MARGIN)."""
        if max_swaps <= 0:
            return 0
        candidates = self._best_absent(max_swaps)
        res = self._resident()
        res_score = self.score[self._pe[res, 0], self._pe[res, 1]]
        resident = res[np.argsort(res_score, kind="stable")][:len(candidates)].tolist()
        slots, pairs = [], []
        for (p, e), i in zip(candidates, resident):
            s = self._slots[i]
            s_in, s_out = self.score[p, e], self.score[s.layer, s.expert]
            if s_in - s_out <= margin + z * np.sqrt(s_in + s_out):
                break
            self.evict(i)
            slots.append(i)
            pairs.append((p, e))
        self.fill(slots, pairs, verify=verify)
        self.stats.swaps += len(slots)
        return len(slots)

    def place(self, priority: np.ndarray | None = None, verify: bool = False) -> int:
        """Initial placement: fill every FREE slot, best `priority` [Lp, E] first (a profile's counts; None: in
        order, which for a cache that holds everything is all of them)."""
        if priority is not None:
            self.score = np.asarray(priority, np.float64).copy()
        return self.refill(verify=verify)

    def _best_absent(self, n: int) -> list[tuple[int, int]]:
        absent = np.flatnonzero(self._table.reshape(-1) < 0)
        if len(absent) == 0 or n <= 0:
            return []
        # highest score first; ties in (layer, expert) order, so a placement is deterministic
        order = absent[np.lexsort((absent, -self.score.reshape(-1)[absent]))][:n]
        return [(int(k) // self.n_experts, int(k) % self.n_experts) for k in order]

    # --- bytes
    def _write(self, slots: list[int], pairs) -> object:
        t = time.perf_counter()
        pool = self.source.write_pool(self.ops, self.pool, slots, pairs)
        self.stats.bytes_copied += len(pairs) * self.nbytes
        self.stats.copy_seconds += time.perf_counter() - t
        return pool

    def verify(self, slots=None) -> list[int]:
        """Check RESIDENT slots' bytes against the pack's checksums (read back in batches of at most
        VERIFY_BATCH_BYTES); -> the slots that failed (and were evicted, so a bad slot is never read again; the
        caller refills)."""
        slots = [i for i in (range(self.n_slots) if slots is None else slots)
                 if self._slots[i].state is SlotState.RESIDENT]
        per = max(1, VERIFY_BATCH_BYTES // self.nbytes)
        bad = []
        for a in range(0, len(slots), per):
            batch = slots[a:a + per]
            data = self.ops.pool_read(self.pool, np.asarray(batch, np.int32))    # [m, nbytes]
            for row, i in zip(data, batch):
                s = self._slots[i]
                if zlib.crc32(row) != self.source.checksum(s.layer, s.expert):
                    bad.append(i)
                    self.evict(i)
        self.stats.verified += len(slots)
        return bad

    def repair(self, rewrite_all: bool = False) -> tuple[int, list[tuple[int, int, int]]]:
        """Verify every RESIDENT slot and rewrite the bad ones with the same experts from the host tier (verified
        again); rewrite_all: rewrite every RESIDENT slot first (the device copy rebuilt from the host tier).
        -> (slots verified, [(slot, layer, expert)] that were bad). A slot still bad after its rewrite raises."""
        resident = self._resident().tolist()
        pairs = {i: (self._slots[i].layer, self._slots[i].expert) for i in resident}
        if rewrite_all:
            self.pool = self._write(resident, [pairs[i] for i in resident])
        bad = self.verify(resident)
        self.fill(bad, [pairs[i] for i in bad])
        still = self.verify(bad)
        if still:
            raise RuntimeError(f"slot {still[0]} does not match the pack after it was rewritten from the host tier: "
                               f"the copy to the device, or the device memory, is broken (checksum mismatch)")
        return len(resident), [(i, *pairs[i]) for i in bad]

    def corrupt(self, i: int) -> Slot:
        """Test-only fault injection: overwrite RESIDENT slot i's bytes on the device with 0xFF (NaN in every float
        format), its state and the host tier untouched. -> the slot."""
        s = self._slots[i]
        if s.state is not SlotState.RESIDENT:
            raise SlotStateError(f"slot {i} is {s.state.value}; only a resident slot can be corrupted")
        self.pool = self.ops.pool_write(self.pool, np.asarray([i], np.int32), [np.full(self.nbytes, 0xFF, np.uint8)])
        return s

    def content_matches(self, pool, slots, pairs) -> bool:
        """Does `pool` (the value a computation read) hold exactly the experts `pairs` in `slots`? For tests and
        debug checks of what a window computed with."""
        uses = sorted(set((int(s), int(p), int(e)) for s, (p, e) in zip(slots, pairs)))   # one check per claim
        if not uses:
            return True
        data = self.ops.pool_read(pool, np.asarray([u[0] for u in uses], np.int32))
        return all(zlib.crc32(row) == self.source.checksum(p, e) for row, (_, p, e) in zip(data, uses))
