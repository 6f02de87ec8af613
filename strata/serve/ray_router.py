"""Ray Serve's RequestRouter with conversation affinity (serve/affinity.py holds the logic and its state).

It runs inside the ingress's deployment handle. A request to the engine deployment's `generate` carries its
Request first; the router hashes the prompt's blocks, ranks the replicas (one replica a rank, so Serve only moves
past the preferred one when that one's queue is full), records the blocks on the replica the request went to, and
writes its decision into the request's `route` keyword: the replica echoes it back, and the ingress counts it. The
ingress names the policy in the `routing` keyword (affinity | round_robin), so changing it restarts no replica.
A survey call (a `replicas` keyword) is told the replicas' names and goes to the one its `replica` keyword names;
other calls (no prompt) go to the least loaded. A replica that dies or leaves is dropped from the tree.
"""
from __future__ import annotations

from collections import defaultdict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from strata.sched.request import Request
from strata.serve.affinity import AffinityIndex, block_keys


class AffinityRouter(RequestRouter):
    def initialize_state(self, block: int = 64, min_tokens: int = 256, margin: int = 4, capacity: int = 1 << 20):
        self.index = AffinityIndex(block, min_tokens, margin, capacity)
        self.in_flight: dict = defaultdict(int)
        self.keys: dict[str, list[int]] = {}        # internal request id -> its prompt's block keys
        # internal request id -> the replica counted for it when chosen: requests that arrive together see the
        # ones chosen before them as load, before any is routed
        self.chosen: dict[str, ReplicaID] = {}

    def _load(self, rid: ReplicaID) -> int:
        # this router's own count (the ingress is one replica): Serve's queue-length cache keeps a replica's reported
        # count until it times out, after the replica finished, and a stale 1 sent every new conversation elsewhere
        return self.in_flight.get(rid, 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self._load(rid) for rid in by_id}
        if pending_request is not None and "replicas" in pending_request.kwargs:
            # the ingress's survey (/metrics, /slots): it learns the replicas Serve runs now, and a call naming one
            # goes to that one alone (one that is gone: to another, which answers with its own name)
            pending_request.kwargs["replicas"] = sorted(rid.unique_id for rid in by_id)
            target = pending_request.kwargs.get("replica")
            for rid, r in by_id.items():
                if rid.unique_id == target:
                    return [[r]]
        prompt = _prompt(pending_request)
        if prompt is None:
            return [sorted(candidate_replicas, key=lambda r: loads[r.replica_id])]
        rid_key = pending_request.metadata.internal_request_id
        keys = self.keys.get(rid_key)
        if keys is None:
            keys = self.keys[rid_key] = block_keys(prompt, self.index.block)
        choice = self.index.choose(list(by_id), keys, loads, pending_request.kwargs.get("routing", "affinity"))
        pending_request.kwargs["route"] = {"kind": choice.kind, "first": choice.order[0].unique_id,
                                           "matched": choice.matched}
        self._uncount(rid_key)
        self.chosen[rid_key] = choice.order[0]
        self.in_flight[choice.order[0]] += 1
        return [[by_id[rid]] for rid in choice.order]

    def _uncount(self, rid_key: str) -> None:
        before = self.chosen.pop(rid_key, None)
        if before is not None and self.in_flight.get(before, 0) > 0:
            self.in_flight[before] -= 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._uncount(pending_request.metadata.internal_request_id)
        self.in_flight[replica_id] += 1
        self.index.add(replica_id, self.keys.pop(pending_request.metadata.internal_request_id, None) or [])

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.index.drop(replica_id)
        self.in_flight.pop(replica_id, None)
        self.chosen = {k: r for k, r in self.chosen.items() if r != replica_id}

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        alive = {r.replica_id for r in replicas}
        self.index.keep(alive)
        for rid in [r for r in self.in_flight if r not in alive]:
            del self.in_flight[rid]


def _prompt(pending_request: PendingRequest | None):
    """The prompt's token ids of a `generate` call, else None."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first.prompt_ids if isinstance(first, Request) else None
