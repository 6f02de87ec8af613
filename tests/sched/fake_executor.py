"""FakeExecutor: the Executor protocol (strata/plan.py) in plain numpy, with tokens a test computes by hand.

next_token(t, p) = 32 + (7 t + p) % 95 follows a row feeding token t at position p (decode rows and a part's last
token alike; the demo tokenizer decodes ids 32..126 to that character); a grammar mask is obeyed (the first allowed
token from there), a part's copies take its state and token, logprobs are fake_logprobs(token). It checks what a real
executor relies on (rows continue their slot's sequence; a continuing plan's -1 rows continue the window it names,
others join with their token; collects in order), records plans, raises or reports given rows non-finite (on every
path, on DEFAULT only, or until repair(): a corrupt expert slot) and reports given device times. A slot's state is
`kv` (the token at each position) and `rec` (what its recurrent state read; None after load_kv until a restore); a
poisoned slot (a non-finite row, until repair() clears it) refuses parts, snapshot, restore, save_kv and load_kv.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.plan import DEFAULT, TOP_LOGPROBS, Capacity, Logprobs, Repair, Saved, WindowPlan, WindowResult

FIRST, SPAN = 32, 95


def next_token(token: int, pos: int) -> int:
    """The token the fake samples after `token` at position `pos`."""
    return FIRST + (7 * int(token) + int(pos)) % SPAN


def expected_tokens(prompt, n: int) -> list[int]:
    """The first n tokens a request with this prompt generates."""
    out, last, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = next_token(last, pos)
        out.append(last)
        pos += 1
    return out


def obey(mask_row, token: int) -> int:
    """The first token at or after `token` (cyclically) that a mask row allows."""
    bits = np.unpackbits(np.asarray(mask_row, np.int32).view(np.uint8), bitorder="little").astype(bool)
    allowed = np.flatnonzero(bits)
    later = allowed[allowed >= token]
    return int(later[0] if len(later) else allowed[0])


def fake_logprobs(tokens) -> Logprobs:
    """What the fake reports for rows that sampled `tokens` [B]: logprob -token / 1000, alternatives token + i."""
    t = np.asarray(tokens, np.int32).reshape(-1)
    sampled = (-t / 1000).astype(np.float32)
    i = np.arange(TOP_LOGPROBS)
    return Logprobs(sampled, (t[:, None] + i).astype(np.int32), (sampled[:, None] - i).astype(np.float32))


def text_of(tokens) -> str:
    return "".join(chr(t) for t in tokens)


@dataclass(eq=False)
class Handle:
    index: int                   # dispatch order, from 0
    plan: WindowPlan
    result: WindowResult
    after: Handle | None = None
    continued: bool = False      # a later plan was dispatched after this one
    waiting: bool = False        # its mask_late rows wait for give_masks


@dataclass
class Dispatched:
    """One dispatched window as the fake saw it: its plan, the decode tokens it resolved (a continuing plan's -1 is
    the token the window it continues sampled) and whether it was dispatched ahead (after=)."""
    plan: WindowPlan
    tokens: np.ndarray
    ahead: bool


@dataclass
class FakeExecutor:
    slots: int = 2
    part_size: int = 4
    max_context: int = 256
    chains: bool = True
    raise_at: dict = field(default_factory=dict)      # window index (from 0) -> exception raised at its collect()
    refuse_ahead: list = field(default_factory=list)  # exceptions the next dispatches ahead (after=) raise, in turn
    nonfinite: set = field(default_factory=set)       # (slot, position): that row's logits are reported non-finite
    nonfinite_default: set = field(default_factory=set)   # (slot, position): non-finite on the DEFAULT path only
    corrupt: dict = field(default_factory=dict)       # (slot, position) -> (expert slot, layer, expert): non-finite
                                                      # until a repair() finds that expert slot bad and rewrites it
    numerics: tuple = ("reference_ops", "cpu_experts")   # the paths it runs besides DEFAULT
    observe: object = None                            # called as observe(index, plan) at each dispatch
    part_sizes: tuple = ()                            # the "compiled" part sizes it declares (Capacity.part_sizes)
    decode_s: float = 0.0                             # the device seconds it reports for a window's decode rows
    part_s_per_token: float = 0.0                     # and for each token of a part, padded (Capacity.padded)
    part_s_at: dict = field(default_factory=dict)     # window index -> the part's seconds instead
    stages: int = 1                                   # the layer split's stages it declares (Capacity.stages)
    parked_rows: int = 0                              # KVs save_kv keeps by reference (nbytes 0) before copying
    late_masks: bool = False                          # continuing grammar rows take their masks later (give_masks)

    def __post_init__(self):
        self.capacity = Capacity(self.slots, self.part_size, self.max_context, tuple(self.part_sizes),
                                 stages=self.stages, late_masks=self.late_masks)
        self.given_masks: list[int] = []              # windows whose masks give_masks gave, in order
        self.windows: list[Dispatched] = []
        self.warmed = 0
        self.collected: list[int] = []
        self.kv: list[list] = [[] for _ in range(self.slots)]
        self.rec: list[list | None] = [[] for _ in range(self.slots)]
        self.prompts: list[tuple[int, tuple]] = []
        self.calls: list[tuple] = []                  # (name, slot, tokens) of each prompt-cache call
        self.poisoned: set[int] = set()               # slots a non-finite row left unusable until repair()
        self.repairs: list[tuple[tuple, bool]] = []   # repair() calls: (slots, rebuild)
        self.kept: list[tuple] = []                   # and the KV positions each kept per slot
        self.paths: list[tuple[int, int, str]] = []   # (slot, position, numerics) of every row and part row computed
        self.free_rows = list(range(self.parked_rows))     # by-reference KVs: rows not held by a Saved
        self.ref_saves = 0

    @property
    def length(self) -> list:
        """Tokens in each slot's sequence state."""
        return [len(r) if r is not None else -1 for r in self.rec]

    def _feed(self, slot: int, tokens, start: int) -> None:
        kv = self.kv[slot]
        del kv[start:]
        kv.extend(int(t) for t in tokens)
        self.rec[slot] = list(kv)
    # --- the Executor protocol
    def warm_up(self) -> float:
        self.warmed += 1
        return 0.0

    def dispatch(self, plan: WindowPlan, after: Handle | None = None) -> Handle:
        index = len(self.windows)
        if self.observe is not None:
            self.observe(index, plan)
        tokens = np.array(plan.decode_tokens, np.int32)
        if after is not None:
            self._check_continues(after, plan)
            if self.refuse_ahead:
                raise self.refuse_ahead.pop(0)
            after.continued = True
            device = plan.decode_active & (tokens < 0)          # the others join with their token given
            tokens[device] = after.result.decode_next[device]
        elif (tokens[plan.decode_active] < 0).any():
            raise ValueError("a plan with token -1 must be dispatched after the window that samples it")
        continuing = plan.decode_active & (plan.decode_tokens < 0)
        if plan.mask_late is not None and (not self.late_masks or after is None or (plan.mask_late & ~continuing).any()):
            raise ValueError("mask_late: only with late_masks, on a continuing plan's rows that continue")
        nxt = np.zeros(self.slots, np.int32)
        fin = np.ones(self.slots, bool)
        numerics = plan.numerics or (DEFAULT,) * self.slots
        if len(numerics) != self.slots or any(n != DEFAULT and n not in self.numerics for n in numerics):
            raise ValueError(f"numerics {numerics}: one per slot, each {DEFAULT!r} or one of {self.numerics}")
        if plan.numerics is not None and after is not None:
            raise ValueError("a plan with numerics paths cannot continue a window")
        for s in np.flatnonzero(plan.decode_active):
            pos = int(plan.decode_pos[s])
            if pos != self.length[s] or pos >= self.max_context:
                raise ValueError(f"slot {s}: a decode row at position {pos} but its sequence holds {self.length[s]} "
                                 f"(of at most {self.max_context})")
            nxt[s] = next_token(tokens[s], pos)
            if plan.mask is not None:
                nxt[s] = obey(plan.mask[s], nxt[s])
            fin[s] = self._finite(s, pos, numerics[s])
            self.paths.append((int(s), pos, numerics[s]))
            self._feed(s, [tokens[s]], pos)
        part_next = part_finite = copies_next = None
        if plan.part is not None:
            p = plan.part
            if not 1 <= len(p.tokens) <= self.part_size:
                raise ValueError(f"a prompt part of {len(p.tokens)} tokens (1 to {self.part_size})")
            if plan.decode_active[p.slot]:
                raise ValueError(f"slot {p.slot} has a decode row and a prompt part in one window")
            if p.slot in self.poisoned:
                raise ValueError(f"slot {p.slot}: a prompt part on a state a non-finite row poisoned (not repaired)")
            if p.start != 0 and p.start != self.length[p.slot]:
                raise ValueError(f"slot {p.slot}: a part at {p.start} but its sequence holds {self.length[p.slot]}")
            if p.start != 0 and self.kv[p.slot][:p.start] != self.rec[p.slot]:
                raise ValueError(f"slot {p.slot}: its KV below {p.start} is not what its recurrent state read")
            end = p.start + len(p.tokens)
            if end > self.max_context:
                raise ValueError(f"slot {p.slot}: a part up to position {end - 1} beyond max_context {self.max_context}")
            first = [next_token(p.tokens[-1], end - 1) if p.last else 0] * (1 + len(p.copies))
            if plan.mask is not None and p.last:
                first = [obey(plan.mask[i], t) for i, t in zip((p.slot, *p.copies), first)]
            part_next, copies_next = first[0], (np.array(first[1:], np.int32) if p.copies else None)
            part_finite = all([self._finite(p.slot, q, numerics[p.slot]) for q in range(p.start, end)])
            self.paths += [(p.slot, q, numerics[p.slot]) for q in range(p.start, end)]
            if not part_finite:
                self.poisoned.add(p.slot)
            self._feed(p.slot, p.tokens, p.start)
            for c in p.copies:
                self.kv[c], self.rec[c] = list(self.kv[p.slot]), list(self.rec[p.slot])
            if p.last:
                self.prompts.append((p.slot, tuple(self.rec[p.slot])))
        self.poisoned.update(int(s) for s in np.flatnonzero(plan.decode_active & ~fin))
        logprobs = plan.logprobs is not None
        part_s = self.part_s_per_token * self.capacity.padded(len(plan.part.tokens)) if plan.part is not None else 0.0
        part_s = self.part_s_at.get(index, part_s)
        res = WindowResult(nxt, fin, part_next, part_finite, self.decode_s if plan.n_decode else 0.0, part_s,
                           copies_next=copies_next,
                           decode_logprobs=fake_logprobs(nxt) if logprobs else None,
                           part_logprobs=fake_logprobs(first) if logprobs and plan.part is not None else None)
        self.windows.append(Dispatched(plan, tokens, after is not None))
        return Handle(index, plan, res, after, waiting=plan.mask_late is not None)

    def give_masks(self, handle: Handle, mask) -> None:
        """The late rows sample under their masks now (they were computed unmasked at dispatch)."""
        if not handle.waiting:
            raise ValueError(f"give_masks: window {handle.index} has no rows waiting for masks")
        handle.waiting = False
        self.given_masks.append(handle.index)
        if mask is not None:
            for s in np.flatnonzero(handle.plan.mask_late):
                handle.result.decode_next[s] = obey(mask[s], handle.result.decode_next[s])

    def collect(self, handle: Handle) -> WindowResult:
        if self.collected and handle.index <= self.collected[-1]:
            raise ValueError(f"window {handle.index} collected after window {self.collected[-1]}")
        if handle.after is not None and handle.after.index not in self.collected:
            raise ValueError("a continuing window was collected before the window it continues")
        if handle.waiting:
            raise ValueError(f"window {handle.index} was collected before give_masks gave its late rows' masks")
        self.collected.append(handle.index)
        if handle.index in self.raise_at:
            raise self.raise_at[handle.index]
        return handle.result

    def metrics(self) -> dict:
        return {"fake_windows": len(self.windows)}

    # --- the prompt cache's copies
    def _clean(self, slot: int, what: str) -> None:
        if slot in self.poisoned:
            raise ValueError(f"slot {slot}: {what} of a state a non-finite row poisoned (not repaired)")

    def snapshot(self, slot: int) -> Saved:
        self._clean(slot, "a snapshot")
        if self.rec[slot] is None:
            raise ValueError(f"slot {slot}: a snapshot of a state no restore set after load_kv")
        self.calls.append(("snapshot", slot, tuple(self.rec[slot])))
        return Saved(("rec", tuple(self.rec[slot])), 100, on_host=False)

    def restore(self, slot: int, saved: Saved) -> None:
        self._clean(slot, "a restore")
        kind, tokens = saved.data
        if kind != "rec":
            raise ValueError("restore takes a snapshot")
        if tuple(self.kv[slot][:len(tokens)]) != tokens:
            raise ValueError(f"slot {slot}: restoring a checkpoint of {len(tokens)} tokens whose KV the slot does not "
                             f"hold")
        self.calls.append(("restore", slot, tokens))
        self.rec[slot] = list(tokens)

    def to_host(self, saved: Saved) -> Saved:
        return Saved(saved.data, saved.nbytes, on_host=True)

    def save_kv(self, slot: int, n: int) -> Saved:
        self._clean(slot, "saving the KV")
        if n > len(self.kv[slot]):
            raise ValueError(f"slot {slot}: saving {n} positions of a KV of {len(self.kv[slot])}")
        self.calls.append(("save_kv", slot, tuple(self.kv[slot][:n])))
        if self.free_rows:
            self.ref_saves += 1
            return Saved(("ref", tuple(self.kv[slot][:n]), self.free_rows.pop()), 0, on_host=True, tokens=n)
        return Saved(("kv", tuple(self.kv[slot][:n])), 10 * n, on_host=True, tokens=n)

    def _give_back(self, saved: Saved) -> None:
        """A by-reference KV's row freed (loaded or dropped); refuses one given back before (a leak's twin)."""
        if saved.data[0] == "ref":
            row = saved.data[2]
            if row in self.free_rows:
                raise ValueError(f"parked row {row} given back twice")
            self.free_rows.append(row)

    def drop_kv(self, saved: Saved) -> None:
        self.calls.append(("drop_kv", None, saved.data[1]))
        self._give_back(saved)

    def host_positions(self, slot: int) -> int:
        return 0

    def prompt_rows(self, ids, images: tuple):
        """A text model: no images."""
        if images:
            raise ValueError("this fake executor's model takes no images")
        return None

    def load_kv(self, slot: int, saved: Saved) -> None:
        self._clean(slot, "loading a KV")
        kind, tokens = saved.data[:2]
        if kind not in ("kv", "ref"):
            raise ValueError("load_kv takes a saved KV")
        self._give_back(saved)
        self.calls.append(("load_kv", slot, tokens))
        self.kv[slot] = list(tokens) + self.kv[slot][len(tokens):]
        self.rec[slot] = None

    def copy_kv(self, slot: int, n: int, src) -> None:
        """Slot's first n positions become slot src's or a parked KV's (which stays parked: its row is kept)."""
        self._clean(slot, "copying a KV into")
        if isinstance(src, Saved):
            kind, tokens = src.data[:2]
            if kind not in ("kv", "ref") or kind == "ref" and src.data[2] in self.free_rows:
                raise ValueError("copy_kv takes a slot or a saved KV the cache still holds")
        else:
            self._clean(src, "copying a KV from")
            tokens = tuple(self.kv[src])
        if n > len(tokens):
            raise ValueError(f"copying {n} positions of a KV of {len(tokens)}")
        self.calls.append(("copy_kv", slot, tuple(tokens[:n])))
        self.kv[slot] = list(tokens[:n]) + self.kv[slot][n:]
        self.rec[slot] = None

    def repair(self, slots: tuple, rebuild: bool = False, keep: tuple | None = None) -> Repair:
        """The corrupt expert slots are found and rewritten (their rows are finite from now on); `slots`' states are
        cleared but the KV of each one's first keep[i] positions (a part on them must start at 0, or at a restored
        checkpoint)."""
        if any(not 0 <= i < self.slots for i in slots):
            raise ValueError(f"repair of slots {slots}: this executor has {self.slots}")
        keep = tuple(keep) if keep is not None else (0,) * len(slots)
        if len(keep) != len(slots) or any(not 0 <= n <= len(self.kv[i]) for i, n in zip(slots, keep)):
            raise ValueError(f"repair of slots {slots} keeping {keep} positions of KVs of {self.length}")
        self.repairs.append((tuple(slots), rebuild))
        self.kept.append(keep)
        bad = tuple(sorted(set(self.corrupt.values())))
        self.corrupt.clear()
        for i, n in zip(slots, keep):
            self.poisoned.discard(i)
            self.kv[i], self.rec[i] = self.kv[i][:n], []
        return Repair(verified=64, bad=bad, rebuilt=rebuild)

    def _finite(self, slot: int, pos: int, numerics: str) -> bool:
        at = (int(slot), int(pos))
        return not (at in self.nonfinite or at in self.corrupt or (numerics == DEFAULT and at in self.nonfinite_default))

    # --- what a continuing plan must be (as WindowRunner checks it)
    def _check_continues(self, prev: Handle, plan: WindowPlan) -> None:
        """Rows with token -1 continue rows of prev one position and one step on; rows with a token given join and
        were inactive in prev; rows of prev may drop out; masks only on rows that join; decode-only, once."""
        if not self.chains:
            raise ValueError("this executor does not chain windows")
        if prev.waiting:
            raise ValueError("a window was continued before give_masks gave its late rows' masks")
        if prev.plan.part is not None or plan.part is not None or prev.continued or not plan.n_decode:
            raise ValueError("only a decode-only window can be continued, by a decode-only plan, once")
        want, on = prev.plan.continued(), prev.plan.decode_active
        device = plan.decode_active & (plan.decode_tokens < 0)
        joined = plan.decode_active & ~device
        if (device & ~on).any() or (joined & on).any():
            raise ValueError("a continuing plan's rows from the device must be in the window it continues, and its "
                             "rows with a token given must not")
        if not (np.array_equal(plan.decode_pos[device], want.decode_pos[device])
                and np.array_equal(plan.steps[device], want.steps[device])):
            raise ValueError("a continuing plan's rows must be one position and one step past the window it continues")
        if plan.mask is not None and (plan.mask[~joined] != -1).any():
            raise ValueError("a continuing plan has a grammar mask on a row that does not join")
