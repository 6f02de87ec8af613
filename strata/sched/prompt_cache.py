"""The prompt cache's policy: which stored conversation a new prompt continues and from which checkpoint, what stays
in host RAM, and which conversation is parked when its slot is needed. Plain bookkeeping over the Executor's state
copies (snapshot, restore, to_host, save_kv, load_kv: strata/plan.py); the scheduler calls take() only where a slot's
state is exact (after a window applied to its live request, nothing dispatched after it for that slot).

A conversation is the tokens whose KV a slot holds (or, parked, a host copy holds) and its checkpoints: snapshots of
the recurrent state after its first `pos` tokens. A prompt continues the largest checkpoint at or before both the end
of the prefix it shares with a conversation and its own last token (a prompt reads at least one token, for its
logits); the KV beyond that point is overwritten as the prompt is read. Each slot's newest checkpoint stays on the
device; older ones and parked conversations live in host RAM within a byte budget, least recently used first out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from strata.plan import Executor, Saved

log = logging.getLogger("strata.sched")
MIB = 1 << 20


@dataclass(eq=False)
class Checkpoint:
    pos: int                     # the recurrent state after the conversation's first pos tokens
    saved: Saved
    used: int = 0                # LRU clock


@dataclass(eq=False)
class Conversation:
    tokens: list = field(default_factory=list)       # the tokens whose KV it holds, in order
    checkpoints: list = field(default_factory=list)  # Checkpoint, ascending pos, each pos <= len(tokens)
    kv: Saved | None = None      # parked: its KV in host RAM (else in its slot)
    used: int = 0

    def best(self, prompt: np.ndarray) -> Checkpoint | None:
        """The checkpoint a prompt can continue: the last at or before the shared prefix's end and the prompt's last
        token."""
        limit = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        usable = [c for c in self.checkpoints if 0 < c.pos <= limit]
        return usable[-1] if usable else None


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if len(diff) else n


class PromptCache:
    def __init__(self, executor: Executor, slots: int, every: int, ram_bytes: int):
        if every < 1:
            raise ValueError(f"checkpoint_every must be at least 1, found {every}")
        self.ex, self.every, self.ram = executor, every, ram_bytes
        self.live: list[Conversation | None] = [None] * slots
        self.parked: list[Conversation] = []
        self._resuming: Conversation | None = None   # counted in RAM, not evicted
        self.clock = 0
        self.stats = {"prompt_cache_hits": 0, "prompt_cache_tokens_reused": 0, "checkpoints_taken": 0,
                      "checkpoints_evicted": 0, "conversations_parked": 0, "conversations_resumed": 0,
                      "conversations_dropped": 0}

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- what the scheduler asks
    def start(self, prompt, free: list[int], reuse: bool) -> tuple[int, int]:
        """A new prompt: pick its slot among the free ones and prepare it -> (slot, tokens reused: the first part
        reads from there). reuse False: read from 0, in a slot that holds no conversation or the least recently
        used one (parked first)."""
        prompt = np.asarray(prompt)
        pick = (0, None, None, None)                 # (pos, slot, conversation, checkpoint)
        if reuse:
            for conv, slot in [(self.live[i], i) for i in free] + [(c, None) for c in self.parked]:
                ck = conv.best(prompt) if conv is not None else None
                if ck is not None and ck.pos > pick[0]:
                    pick = (ck.pos, slot, conv, ck)
        pos, slot, conv, ck = pick
        if slot is None:
            slot = self._victim(free)
            if conv is not None:                     # a parked conversation comes back (not evicted meanwhile)
                self.parked.remove(conv)
                self._resuming = conv
            self.vacate(slot)
            self._resuming = None
            if conv is not None:
                self.ex.load_kv(slot, conv.kv)
                conv.kv = None
                self.stats["conversations_resumed"] += 1
                log.info(f"strata serve: resumed conversation of {len(conv.tokens)} tokens into slot {slot} "
                         f"({len(conv.checkpoints)} checkpoints; {len(self.parked)} parked)")
        if conv is None:
            conv = Conversation()
        else:
            self.ex.restore(slot, ck.saved)
            ck.used = self._tick()
            conv.tokens = conv.tokens[:pos]
            conv.checkpoints = [c for c in conv.checkpoints if c.pos <= pos]
            self.stats["prompt_cache_hits"] += 1
            self.stats["prompt_cache_tokens_reused"] += pos
        conv.used = self._tick()
        self.live[slot] = conv
        return slot, pos

    def claim(self, free: list[int]) -> int:
        """A free slot whose state a request overwrites whole (an n-choice request's other choices): its
        conversation is parked first. -> the slot."""
        slot = self._victim(free)
        self.vacate(slot)
        self.live[slot] = Conversation(used=self._tick())
        return slot

    def take(self, slot: int, pos: int, tokens) -> None:
        """A checkpoint of the slot's state now, after the first pos of `tokens` (exact: the scheduler's word). The
        slot's previous newest checkpoint moves to host RAM (or goes, when the budget cannot hold it)."""
        conv = self.live[slot]
        conv.tokens = list(tokens[:pos])
        conv.checkpoints = [c for c in conv.checkpoints if c.pos < pos]
        for c in [c for c in conv.checkpoints if not c.saved.on_host]:
            if c.saved.nbytes <= self.ram and self._room(c.saved.nbytes):
                c.saved = self.ex.to_host(c.saved)
            else:
                conv.checkpoints.remove(c)
                self.stats["checkpoints_evicted"] += 1
        conv.checkpoints.append(Checkpoint(pos, self.ex.snapshot(slot), self._tick()))
        conv.used = self.clock
        self.stats["checkpoints_taken"] += 1

    def end(self, slot: int, tokens, pos: int) -> None:
        """The slot's request ended with its state after the first pos of `tokens` (its KV holds them)."""
        conv = self.live[slot]
        conv.tokens = list(tokens[:pos])
        conv.checkpoints = [c for c in conv.checkpoints if c.pos <= pos]
        conv.used = self._tick()

    def rewind(self, slot: int, pos: int, tokens) -> int:
        """A non-finite row at pos (of `tokens`) poisoned the slot: its conversation keeps its checkpoints at or
        before pos on those tokens (taken of finite windows, so clean) and the tokens up to the last of them, whose
        KV the slot's repair keeps (kept()); the rest goes, or all of it when none is left. -> the position a retry
        resumes from (resume(), after the repair); 0: from the start."""
        conv = self.live[slot]
        limit = min(pos, common_prefix(conv.tokens, tokens)) if conv is not None else 0
        usable = [c for c in conv.checkpoints if 0 < c.pos <= limit] if conv is not None else []
        if not usable:
            self.drop(slot)
            return 0
        conv.checkpoints = usable
        conv.tokens = list(tokens[:usable[-1].pos])
        conv.used = self._tick()
        return usable[-1].pos

    def kept(self, slot: int) -> int:
        """The positions of the slot's KV that its conversation holds (what a repair of the slot keeps)."""
        conv = self.live[slot]
        return len(conv.tokens) if conv is not None else 0

    def resume(self, slot: int) -> int:
        """The slot's newest checkpoint restored into it (after rewind() and the repair) -> its position."""
        ck = self.live[slot].checkpoints[-1]
        self.ex.restore(slot, ck.saved)
        ck.used = self._tick()
        return ck.pos

    def drop(self, slot: int) -> None:
        """The slot's state is not to be trusted (a failed window, a non-finite row): its conversation goes."""
        if self.live[slot] is not None:
            self.stats["conversations_dropped"] += 1
        self.live[slot] = None

    def clear(self) -> None:
        """Forget every stored conversation (the next prompts read from token 0)."""
        for conv in self.parked:
            self.ex.drop_kv(conv.kv)
        self.live = [None] * len(self.live)
        self.parked = []

    def checkpoints(self, slot: int) -> int:
        conv = self.live[slot]
        return len(conv.checkpoints) if conv is not None else 0

    def ram_bytes(self) -> int:
        """Host RAM held: checkpoints moved there and parked conversations' KV."""
        convs = [c for c in self.live if c is not None] + self.parked + [c for c in [self._resuming] if c]
        return sum(ck.saved.nbytes for c in convs for ck in c.checkpoints if ck.saved.on_host) + \
            sum(c.kv.nbytes for c in convs if c.kv is not None)

    # --- parking and the budget
    def vacate(self, slot: int) -> None:
        """Free a slot's KV for another request: its conversation is parked (KV and checkpoints to host RAM) when
        it has a checkpoint and the budget holds it, else dropped."""
        conv, self.live[slot] = self.live[slot], None
        if conv is None or not conv.checkpoints:
            return
        need = sum(c.saved.nbytes for c in conv.checkpoints)        # (no longer counted among the live ones)
        kv = self.ex.save_kv(slot, len(conv.tokens)) if need < self.ram else None
        if kv is None or not self._room(need + kv.nbytes):
            if kv is not None:
                self.ex.drop_kv(kv)
            self.stats["conversations_dropped"] += 1
            log.info(f"strata serve: dropped conversation of {len(conv.tokens)} tokens from slot {slot}: "
                     f"{(need + (kv.nbytes if kv else 0)) / MIB:.1f} MiB do not fit checkpoint_ram_gib ({self.ram / MIB:.0f} MiB)")
            return
        conv.checkpoints = [Checkpoint(c.pos, self.ex.to_host(c.saved), c.used) for c in conv.checkpoints]
        conv.kv = kv
        self.parked.append(conv)
        self.stats["conversations_parked"] += 1
        where = f"{(need + kv.nbytes) / MIB:.1f} MiB" if kv.nbytes else f"{need / MIB:.1f} MiB, its KV kept in place"
        log.info(f"strata serve: parked conversation of {len(conv.tokens)} tokens from slot {slot} "
                 f"({len(conv.checkpoints)} checkpoints, {where}); {len(self.parked)} "
                 f"parked, {self.ram_bytes() / MIB:.1f} of {self.ram / MIB:.0f} MiB of RAM used")

    def _victim(self, free: list[int]) -> int:
        """The free slot to give a new request: one holding no conversation, else the least recently used one."""
        empty = [i for i in free if self.live[i] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda i: self.live[i].used)

    def _room(self, nbytes: int) -> bool:
        """Make room for nbytes more in host RAM, evicting least recently used first: a host checkpoint of a slot's
        conversation, or a whole parked conversation. -> whether it fits."""
        if nbytes > self.ram:
            return False
        while self.ram_bytes() + nbytes > self.ram:
            items = [(c.used, conv, c) for conv in self.live if conv is not None
                     for c in conv.checkpoints if c.saved.on_host]
            items += [(conv.used, conv, None) for conv in self.parked]
            if not items:
                return False
            _, conv, ck = min(items, key=lambda x: x[0])
            if ck is None:
                self.parked.remove(conv)
                self.ex.drop_kv(conv.kv)
                self.stats["conversations_dropped"] += 1
            else:
                conv.checkpoints.remove(ck)
                self.stats["checkpoints_evicted"] += 1
        return True
