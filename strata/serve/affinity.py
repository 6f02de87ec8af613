"""Conversation affinity, without Ray: per replica, the hashed token blocks of the prompts sent there, and the choice
of a replica for a prompt. serve/ray_router.py adapts it to Ray Serve's RequestRouter.

A prompt is cut into blocks of `block` tokens; block i's key hashes block i's tokens with block i-1's key, so a key
stands for the whole prefix up to it and a replica's set of keys is a prefix tree of its prompts. choose() sends a
prompt to the replica with the longest match ("hit"), unless the match is under min_tokens ("miss": the least
loaded replica) or that replica has more than `margin` requests in flight above the least loaded ("fallback").
Ties between equally loaded replicas go to the one least recently sent a prompt (add() records it), so independent
requests spread, and choosing again for a request not yet sent (Serve retries a choice) gives the same order.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

KINDS = ("hit", "miss", "fallback", "round_robin")


@dataclass(frozen=True)
class Choice:
    order: list          # the replicas, most preferred first
    kind: str            # one of KINDS
    matched: int         # tokens of the prompt the first replica already saw


def block_keys(ids: Sequence[int], block: int) -> list[int]:
    """The chained keys of the prompt's whole blocks."""
    keys, key = [], 0
    for i in range(0, len(ids) - block + 1, block):
        key = hash((key, tuple(ids[i:i + block])))
        keys.append(key)
    return keys


class AffinityIndex:
    def __init__(self, block: int, min_tokens: int, margin: int, capacity: int):
        self.block, self.min_tokens, self.margin, self.capacity = block, min_tokens, margin, capacity
        self.trees: dict[Hashable, OrderedDict] = {}
        self.last_sent: dict[Hashable, int] = {}        # replica -> the number of the prompt last sent there
        self.sent = 0

    def matched(self, replica: Hashable, keys: list[int]) -> int:
        """Tokens of the prompt (whole blocks) that replica saw as the start of an earlier prompt."""
        tree = self.trees.get(replica)
        n = 0
        if tree:
            for key in keys:
                if key not in tree:
                    break
                n += 1
        return n * self.block

    def add(self, replica: Hashable, keys: list[int]) -> None:
        """A prompt of these keys was sent to replica."""
        self.sent += 1
        self.last_sent[replica] = self.sent
        tree = self.trees.setdefault(replica, OrderedDict())
        for key in keys:
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self.capacity:
            tree.popitem(last=False)

    def drop(self, replica: Hashable) -> None:
        self.trees.pop(replica, None)
        self.last_sent.pop(replica, None)

    def keep(self, replicas) -> None:
        """Forget every replica but these (the others are gone)."""
        for r in [r for r in self.trees if r not in set(replicas)]:
            self.drop(r)

    def choose(self, replicas: Sequence[Hashable], keys: list[int], loads: dict, routing: str = "affinity") -> Choice:
        """The replicas in order of preference for a prompt of these keys; loads: requests in flight per replica;
        routing: affinity, or round_robin (in turn, whatever the prompt)."""
        ring = sorted(replicas, key=lambda r: (self.last_sent.get(r, 0), str(r)))     # least recently sent first
        if not ring:
            return Choice([], "miss", 0)
        if routing == "round_robin":
            return Choice(ring, "round_robin", self.matched(ring[0], keys))
        by_load = sorted(ring, key=lambda r: loads.get(r, 0))        # stable: ties keep the least recently sent first
        best = max(ring, key=lambda r: self.matched(r, keys))
        got = self.matched(best, keys)
        if got == 0 or got < self.min_tokens:
            return Choice(by_load, "miss", self.matched(by_load[0], keys))
        if loads.get(best, 0) - loads.get(by_load[0], 0) > self.margin:
            return Choice(by_load, "fallback", self.matched(by_load[0], keys))
        return Choice([best] + [r for r in by_load if r != best], "hit", got)
