"""The prompt cache's policy: a tree of checkpoints (snapshots of the recurrent state after a prefix's first `pos`
tokens; conversations that share a prefix share its nodes), the conversations whose KV a slot or host RAM holds, which
of them a new prompt continues or branches from, and what is parked when a slot is needed. Plain bookkeeping over the
Executor's state copies (strata/plan.py); the scheduler calls take() only where a slot's state is exact.

A prompt restarts from the deepest node on its path before its last token. It continues the conversation holding
that prefix when it holds that conversation's last prompt whole (the reply may differ: the chat template renders it
anew), else the prefix's KV is copied from a holder (a slot, or a parked KV, which stays parked): no other history is
taken. A node lives while a conversation covers it; each slot's newest node stays on the device, the others and
parked KVs in host RAM within a byte budget, least recently used out first, node by node.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from strata.plan import Executor, Saved

log = logging.getLogger("strata.sched")
MIB = 1 << 20


@dataclass(eq=False)
class Node:
    """A checkpoint: the recurrent state after the first pos tokens of the path from the root (edge: the tokens
    from the parent's pos to this one's). The root (pos 0, no state) stands for reading from the start."""
    pos: int
    edge: np.ndarray
    parent: Node | None
    saved: Saved | None
    children: list = field(default_factory=list)
    holders: int = 0             # conversations whose deepest node this is
    used: int = 0                # LRU clock

    def path(self) -> list:
        """The nodes from the root's first child down to this one."""
        out, n = [], self
        while n.parent is not None:
            out.append(n)
            n = n.parent
        return out[::-1]


@dataclass(eq=False)
class Conversation:
    key: tuple                   # the requests' cache_key: state is shared only under equal keys
    node: Node                   # its deepest checkpoint (the root: none), on the path of its tokens
    tokens: list = field(default_factory=list)       # the tokens whose KV it holds, in order (node.pos <= len)
    kv: Saved | None = None      # parked: its KV in host RAM (else in its slot)
    used: int = 0
    prompt: int = 0              # the length of the last prompt read into it (what follows was generated)

    @property
    def checkpoints(self) -> list[Node]:
        return self.node.path()


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
        self.roots: dict[tuple, Node] = {}
        self.device: list[Node | None] = [None] * slots   # the node each slot snapshotted last, on the device
        self._moving: list[Conversation] = []             # neither live nor parked just now: counted, not evicted
        self._held: list = []                             # nodes and conversations a step in progress needs
        self.clock = 0
        self.stats = {"prompt_cache_hits": 0, "prompt_cache_tokens_reused": 0, "prompt_cache_branches": 0,
                      "checkpoints_taken": 0, "checkpoints_shared": 0, "checkpoints_evicted": 0,
                      "conversations_parked": 0, "conversations_resumed": 0, "conversations_dropped": 0}

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- the tree
    def _root(self, key: tuple) -> Node:
        if key not in self.roots:
            self.roots[key] = Node(0, np.zeros(0, np.int32), None, None)
        return self.roots[key]

    def _deepest(self, key: tuple, tokens, limit: int) -> Node:
        """The deepest node whose path `tokens` start with, at position <= limit (the root when none)."""
        tokens = np.asarray(tokens)
        node = self._root(key)
        while True:
            nxt = next((c for c in node.children if c.pos <= limit
                        and np.array_equal(tokens[node.pos:c.pos], c.edge)), None)
            if nxt is None:
                return node
            node = nxt

    def _point(self, conv: Conversation, node: Node) -> None:
        """The conversation's deepest node becomes `node` (nodes nobody covers any more go)."""
        old, conv.node = conv.node, node
        node.holders += 1
        old.holders -= 1
        self._prune(old)

    def _prune(self, node: Node) -> None:
        """Remove node and its ancestors while no conversation covers them (no holder, no children)."""
        while node.parent is not None and node.holders == 0 and not node.children:
            node.parent.children.remove(node)
            self._forget(node)
            node = node.parent

    def _forget(self, node: Node) -> None:
        for i, d in enumerate(self.device):
            if d is node:
                self.device[i] = None

    def _splice(self, node: Node) -> None:
        """Evict one node: its children hang from its parent, its holders move up to it."""
        parent = node.parent
        parent.children.remove(node)
        for c in node.children:
            c.edge, c.parent = np.concatenate([node.edge, c.edge]), parent
            parent.children.append(c)
        for conv in self._conversations():
            if conv.node is node:
                conv.node = parent
                parent.holders += 1
        self._forget(node)
        self.stats["checkpoints_evicted"] += 1
        self._prune(parent)

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children)
            if n.parent is not None:
                yield n

    def _conversations(self) -> list[Conversation]:
        return [c for c in self.live if c is not None] + self.parked + self._moving

    # --- what the scheduler asks
    def start(self, prompt, free: list[int], reuse: bool, key: tuple = (), shared: tuple = ()) -> tuple[int, int]:
        """A new prompt: pick its slot among the free ones and prepare it -> (slot, tokens reused: the first part
        reads from there). reuse False: read from 0, in a slot that holds no conversation or the least recently
        used one (parked first). shared: busy slots whose KV may be copied from (none poisoned)."""
        prompt = np.asarray(prompt)
        node = self._deepest(key, prompt, len(prompt) - 1) if reuse else self._root(key)
        pos, slot, conv = node.pos, None, None
        node.holders += 1                            # held from here: nothing prunes or evicts it meanwhile
        self._held = [node]
        if pos:
            candidates = [(c, i) for i, c in enumerate(self.live) if c is not None and (i in free or i in shared)]
            candidates += [(c, None) for c in self.parked]
            shares = {id(c): common_prefix(c.tokens, prompt) for c, _ in candidates if c.key == key}
            holders = [(c, i) for c, i in candidates if shares.get(id(c), 0) >= pos]
            # it continues a conversation whose last prompt it holds whole (the reply may differ: the chat template
            # renders it anew), in its slot or resumed; else it branches
            own = sorted([(c, i) for c, i in holders if (i is None or i in free)
                          and shares[id(c)] >= min(c.prompt, len(c.tokens))],
                         key=lambda h: (len(h[0].tokens) - shares[id(h[0])], h[1] is None))
            own = own[0] if own else None
            if own is not None:
                conv, slot = own
                if slot is None:
                    slot = self._resume(conv, free)
            else:                                    # a branch: the prefix's KV copied into a slot of its own
                src, at = min(holders, key=lambda h: h[1] is None)   # a slot's KV before a parked one's
                self._held.append(src)
                slot = self._victim(free, avoid=at)
                self.vacate(slot)
                if at != slot:
                    self.ex.copy_kv(slot, pos, at if at is not None else src.kv)
                elif src.kv is not None:             # the source was this slot's conversation, parked just now
                    self.ex.copy_kv(slot, pos, src.kv)
                self.stats["prompt_cache_branches"] += 1
                log.info(f"strata serve: a new conversation branches at token {pos} of a conversation of "
                         f"{len(src.tokens)} tokens ({'parked' if at is None else f'slot {at}'}) into slot {slot}")
        if slot is None:
            slot = self._victim(free)
            self.vacate(slot)
        self._held = []
        if conv is None:
            conv = Conversation(key, self._root(key))
            conv.node.holders += 1
        if pos:
            self.ex.restore(slot, node.saved)
            node.used = self._tick()
            self.stats["prompt_cache_hits"] += 1
            self.stats["prompt_cache_tokens_reused"] += pos
        self._point(conv, node)
        node.holders -= 1
        conv.tokens, conv.prompt = list(prompt[:pos]), len(prompt)
        conv.used = self._tick()
        self.live[slot] = conv
        return slot, pos

    def reusable(self, prompt, key: tuple = ()) -> int:
        """The tokens of a prompt that start() would reuse now (the deepest node before its last token)."""
        root = self.roots.get(key)
        return self._deepest(key, prompt, len(prompt) - 1).pos if root is not None else 0

    def _resume(self, conv: Conversation, free: list[int]) -> int:
        """A parked conversation back into a free slot (its KV loaded) -> the slot."""
        slot = self._victim(free)
        self.parked.remove(conv)
        self._moving.append(conv)
        self.vacate(slot)
        self._moving.remove(conv)
        self.ex.load_kv(slot, conv.kv)
        conv.kv = None
        self.stats["conversations_resumed"] += 1
        log.info(f"strata serve: resumed conversation of {len(conv.tokens)} tokens into slot {slot} "
                 f"({len(conv.checkpoints)} checkpoints; {len(self.parked)} parked)")
        return slot

    def claim(self, free: list[int], key: tuple = ()) -> int:
        """A free slot whose state a request overwrites whole (an n-choice request's other choices): its
        conversation is parked first. -> the slot."""
        slot = self._victim(free)
        self.vacate(slot)
        root = self._root(key)
        root.holders += 1
        self.live[slot] = Conversation(key, root, used=self._tick())
        return slot

    def take(self, slot: int, pos: int, tokens) -> None:
        """A checkpoint of the slot's state now, after the first pos of `tokens` (exact: the scheduler's word): the
        tree's node there when another conversation took it, else a new one. The slot's previous newest node moves
        to host RAM (or goes, when the budget cannot hold it)."""
        conv = self.live[slot]
        conv.tokens = list(tokens[:pos])
        tokens = np.asarray(conv.tokens)
        parent = self._deepest(conv.key, tokens, pos)
        before, self.device[slot] = self.device[slot], None
        if parent.pos == pos:
            node = parent
            self.stats["checkpoints_shared"] += 1
        else:
            node = Node(pos, tokens[parent.pos:pos].copy(), parent, self.ex.snapshot(slot))
            for c in [c for c in parent.children if len(c.edge) > len(node.edge)
                      and np.array_equal(c.edge[:len(node.edge)], node.edge)]:   # they continue through it
                parent.children.remove(c)
                c.edge, c.parent = c.edge[len(node.edge):], node
                node.children.append(c)
            parent.children.append(node)
            self.device[slot] = node
            self.stats["checkpoints_taken"] += 1
        node.used = self._tick()
        self._point(conv, node)
        conv.used = self.clock
        if before is not None and before is not node:
            self._held = [node]
            self._node_to_host(before)
            self._held = []

    def _to_host(self, slot: int) -> None:
        """The slot's device node to host RAM, or evicted when the budget cannot hold it."""
        node, self.device[slot] = self.device[slot], None
        if node is not None:
            self._node_to_host(node)

    def _node_to_host(self, node: Node) -> None:
        if node.saved.on_host:
            return
        if node.saved.nbytes <= self.ram and self._room(node.saved.nbytes):
            node.saved = self.ex.to_host(node.saved)
        else:
            self._splice(node)

    def end(self, slot: int, tokens, pos: int) -> None:
        """The slot's request ended with its state after the first pos of `tokens` (its KV holds them)."""
        conv = self.live[slot]
        conv.tokens = list(tokens[:pos])
        if conv.node.pos > pos:
            self._point(conv, next((n for n in reversed(conv.node.path()) if n.pos <= pos), self._root(conv.key)))
        conv.used = self._tick()

    def rewind(self, slot: int, pos: int, tokens) -> int:
        """A non-finite row at pos (of `tokens`) poisoned the slot: its conversation keeps its checkpoints at or
        before pos on those tokens (taken of finite windows, so clean) and the tokens up to the last of them, whose
        KV the slot's repair keeps (kept()); the rest goes, or all of it when none is left. -> the position a retry
        resumes from (resume(), after the repair); 0: from the start."""
        conv = self.live[slot]
        limit = min(pos, common_prefix(conv.tokens, tokens)) if conv is not None else 0
        usable = [n for n in conv.node.path() if n.pos <= limit] if conv is not None else []
        if not usable:
            self.drop(slot)
            return 0
        self._point(conv, usable[-1])
        conv.tokens = list(tokens[:usable[-1].pos])
        conv.used = self._tick()
        return usable[-1].pos

    def kept(self, slot: int) -> int:
        """The positions of the slot's KV that its conversation holds (what a repair of the slot keeps)."""
        conv = self.live[slot]
        return len(conv.tokens) if conv is not None else 0

    def resume(self, slot: int) -> int:
        """The slot's deepest checkpoint restored into it (after rewind() and the repair) -> its position."""
        node = self.live[slot].node
        self.ex.restore(slot, node.saved)
        node.used = self._tick()
        return node.pos

    def drop(self, slot: int) -> None:
        """The slot's state is not to be trusted (a failed window, a non-finite row): its conversation goes (its
        checkpoints, taken of finite windows, stay while another conversation covers them)."""
        conv = self.live[slot]
        if conv is None:
            return
        self.stats["conversations_dropped"] += 1
        self.live[slot] = None
        self._to_host(slot)
        self._release(conv)

    def _release(self, conv: Conversation) -> None:
        conv.node.holders -= 1
        self._prune(conv.node)

    def clear(self) -> None:
        """Forget every stored conversation (the next prompts read from token 0)."""
        for conv in self.parked:
            self.ex.drop_kv(conv.kv)
        self.live = [None] * len(self.live)
        self.device = [None] * len(self.device)
        self.parked, self.roots = [], {}

    def checkpoints(self, slot: int) -> list[int]:
        """The positions of the slot's conversation's checkpoints."""
        conv = self.live[slot]
        return [n.pos for n in conv.checkpoints] if conv is not None else []

    def ram_bytes(self) -> int:
        """Host RAM held: nodes moved there and parked conversations' KV."""
        return sum(n.saved.nbytes for n in self._nodes() if n.saved.on_host) + \
            sum(c.kv.nbytes for c in self._conversations() if c.kv is not None)

    # --- parking and the budget
    def vacate(self, slot: int) -> None:
        """Free a slot's KV for another request: its conversation is parked (KV to host RAM, its device node too)
        when it has a checkpoint and the budget holds it, else dropped."""
        conv = self.live[slot]
        if conv is None:
            return
        self._to_host(slot)
        conv, self.live[slot] = self.live[slot], None
        if conv.node.parent is None or not self.ram:
            self._release(conv)
            return
        kv = self.ex.save_kv(slot, len(conv.tokens))
        self._moving.append(conv)
        fits = self._room(kv.nbytes)
        self._moving.remove(conv)
        if not fits:
            self.ex.drop_kv(kv)
            self._release(conv)
            self.stats["conversations_dropped"] += 1
            log.info(f"strata serve: dropped conversation of {len(conv.tokens)} tokens from slot {slot}: "
                     f"{kv.nbytes / MIB:.1f} MiB do not fit checkpoint_ram_gib ({self.ram / MIB:.0f} MiB)")
            return
        conv.kv = kv
        self.parked.append(conv)
        self.stats["conversations_parked"] += 1
        where = f"{kv.nbytes / MIB:.1f} MiB" if kv.nbytes else "its KV kept in place"
        log.info(f"strata serve: parked conversation of {len(conv.tokens)} tokens from slot {slot} "
                 f"({len(conv.checkpoints)} checkpoints, {where}); {len(self.parked)} "
                 f"parked, {self.ram_bytes() / MIB:.1f} of {self.ram / MIB:.0f} MiB of RAM used")

    def _victim(self, free: list[int], avoid: int | None = None) -> int:
        """The free slot to give a new request: one holding no conversation, else the least recently used one
        (not `avoid`, the slot a branch copies from, while another is free)."""
        empty = [i for i in free if self.live[i] is None]
        if empty:
            return empty[0]
        others = [i for i in free if i != avoid] or free
        return min(others, key=lambda i: self.live[i].used)

    def _room(self, nbytes: int) -> bool:
        """Make room for nbytes more in host RAM, evicting least recently used first: a node in host RAM, or a
        whole parked conversation. -> whether it fits."""
        if nbytes > self.ram:
            return False
        while self.ram_bytes() + nbytes > self.ram:
            items = [(n.used, n, None) for n in self._nodes() if n.saved.on_host and n not in self._held]
            items += [(conv.used, None, conv) for conv in self.parked if conv not in self._held]
            if not items:
                return False
            _, node, conv = min(items, key=lambda x: x[0])
            if node is not None:
                self._splice(node)
            else:
                self.parked.remove(conv)
                self.ex.drop_kv(conv.kv)
                conv.kv = None
                self._release(conv)
                self.stats["conversations_dropped"] += 1
        return True
