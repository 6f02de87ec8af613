"""The affinity router's choice without Ray (serve/affinity.py): the longest prefix match wins; a short match is a
miss that goes to the least-loaded replica, ties in turn; an overloaded match falls back; dropped replicas are
forgotten; round-robin ignores the prompt."""
from __future__ import annotations

from strata.serve.affinity import AffinityIndex, block_keys


def test_a_prompt_goes_back_to_the_replica_that_saw_its_prefix():
    idx = AffinityIndex(block=4, min_tokens=8, margin=2, capacity=100)
    a, b = list(range(40)), list(range(100, 140))
    idx.add("r0", block_keys(a, 4))
    idx.add("r1", block_keys(b, 4))
    c = idx.choose(["r0", "r1"], block_keys(a + [7, 7, 7, 7, 7], 4), {})
    assert (c.order[0], c.kind, c.matched) == ("r0", "hit", 40)
    c = idx.choose(["r0", "r1"], block_keys(b[:10] + a, 4), {})
    assert (c.order[0], c.kind, c.matched) == ("r1", "hit", 8)
    # a match under min_tokens: the least loaded
    c = idx.choose(["r0", "r1"], block_keys(a[:6] + b, 4), {"r0": 0, "r1": 1})
    assert (c.order[0], c.kind) == ("r0", "miss")
    # the matched replica more than `margin` ahead of the least loaded: a fallback
    c = idx.choose(["r0", "r1"], block_keys(a, 4), {"r0": 3, "r1": 0})
    assert (c.order[0], c.kind) == ("r1", "fallback")
    c = idx.choose(["r0", "r1"], block_keys(a, 4), {"r0": 2, "r1": 0})
    assert (c.order[0], c.kind) == ("r0", "hit")
    idx.drop("r0")
    assert idx.choose(["r0", "r1"], block_keys(a, 4), {}).kind == "miss"


def test_misses_and_round_robin_take_turns():
    idx = AffinityIndex(block=4, min_tokens=8, margin=2, capacity=100)

    def send(keys, routing="affinity"):
        c = idx.choose(["r0", "r1"], keys, {}, routing)
        idx.add(c.order[0], keys)
        return c
    firsts = [send(block_keys([i] * 3, 4)).order[0] for i in range(6)]
    assert firsts == ["r0", "r1"] * 3
    idx.add("r0", block_keys(list(range(40)), 4))
    rr = [send(block_keys(list(range(40)), 4), "round_robin") for _ in range(4)]
    assert [c.order[0] for c in rr] == ["r1", "r0"] * 2 and {c.kind for c in rr} == {"round_robin"}


def test_choosing_again_before_a_prompt_is_sent_gives_the_same_replica():
    # Ray Serve calls the router again for a request whose first choice it could not place yet (a full queue, a
    # late queue-length probe): the tie-break must not move on, or first turns all land on one replica
    idx = AffinityIndex(block=4, min_tokens=8, margin=2, capacity=100)
    firsts = []
    for i in range(4):
        keys = block_keys([i] * 8, 4)
        tries = [idx.choose(["r0", "r1"], keys, {}).order[0] for _ in range(3)]
        assert len(set(tries)) == 1, tries
        idx.add(tries[0], keys)
        firsts.append(tries[0])
    assert firsts == ["r0", "r1", "r0", "r1"]


def test_the_tree_keeps_the_most_recent_blocks():
    idx = AffinityIndex(block=2, min_tokens=2, margin=2, capacity=5)
    idx.add("r0", block_keys(list(range(20)), 2))
    assert len(idx.trees["r0"]) == 5
    assert idx.matched("r0", block_keys(list(range(20)), 2)) == 0     # its first blocks went first
