"""ExpertPath: how a model's routed experts are computed, chosen once at load from the settings, the cache the memory
plan allowed and the backend's declared capabilities. It hands the one layer loop (strata/model/forward.py) its
experts(p, h, w, idx) function and tells the runner which window strategy to use; nothing re-derives it later.

  RESIDENT      every routed expert in a device slot (or none to route): windows are one compiled function
  WINDOW_FETCH  decode windows are one compiled function that copies its misses from pinned host memory (HostFetch);
                prompt parts run layer by layer
  STEPPED       layer by layer: routes come to the host, misses are copied into slots between layers
  CPU_MISSES    layer by layer: misses are computed on the CPU, through a CPU backend's expert op
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from strata.experts.stream import PartStream


class PathKind(enum.Enum):
    RESIDENT = "resident"
    WINDOW_FETCH = "window fetch"
    STEPPED = "stepped"
    CPU_MISSES = "cpu misses"


def fetch_possible(ops, options) -> bool:
    """Whether a partial cache's decode windows would fetch their misses themselves (so the plan makes room for
    their staging rows and the host mirror goes to pinned memory): the backend has HostFetch, window fetch is on,
    misses are fetched, and the experts are mirrored in RAM (not streamed from the pack)."""
    return (ops.host_fetch is not None and options.window_fetch and options.miss_policy == "fetch"
            and not options.stream_experts)


@dataclass(frozen=True)
class ExpertPath:
    kind: PathKind
    ops: object
    n_experts: int
    k: int                                 # routes per token
    experts: object = None                 # the ExpertSet (strata/experts/setup.py); None: no routed experts
    empty: object = None                   # a one-byte pool for a model without routed experts
    helped: bool = False                   # a peer device computes a share of prompt parts' experts (so parts run
                                           # layer by layer: a compiled part cannot reach another device)
    streams_parts: bool = False            # prompt parts copy whole layers of experts (strata/experts/stream.py)

    @staticmethod
    def choose(ops, experts, k: int, options, helped: bool = False, streams: bool = False) -> "ExpertPath":
        """The path for `experts` (an ExpertSet) under `options` (the expert settings); helped: prefill_help's
        peer computes a share of prompt parts' experts; streams: the memory plan made room for parts to stream
        whole layers (stream_parts)."""
        if experts.cache.all_resident():
            kind = PathKind.RESIDENT
        elif options.miss_policy == "cpu":
            kind = PathKind.CPU_MISSES
        elif fetch_possible(ops, options) and experts.window_chunks is not None:
            kind = PathKind.WINDOW_FETCH
        else:
            kind = PathKind.STEPPED
        streams = streams and kind is not PathKind.RESIDENT and experts.window_chunks is not None and not helped
        return ExpertPath(kind, ops, experts.cache.n_experts, k, experts, helped=helped, streams_parts=streams)

    @staticmethod
    def no_experts(ops) -> "ExpertPath":
        return ExpertPath(PathKind.RESIDENT, ops, 0, 0, None, ops.pool_alloc(1, 1))

    @property
    def compiled_rows(self) -> bool:
        """Decode windows are one compiled function (nothing decided on the host between layers)."""
        return self.kind in (PathKind.RESIDENT, PathKind.WINDOW_FETCH)

    @property
    def compiled_parts(self) -> bool:
        """Prompt parts are one compiled function."""
        return self.kind is PathKind.RESIDENT and not self.helped

    # --- compiled windows
    def args(self) -> dict:
        """A resident window's device arguments: the pool and the slot table, by value. (A window-fetch window
        takes ExpertSet.fetch_args(): the host chunks too, and the table it got, for the counts.)"""
        if self.experts is None:
            return {"pool": self.empty, "table": np.zeros((0, 1), np.int32)}
        return self.experts.args()

    def traced(self, layout, args: dict, valid, counts: list | None = None, copied: list | None = None):
        """experts(p, h, w, idx) inside a compiled window. valid: n_valid (a part) or the active rows [S]. Fetching,
        each layer's routing counts [E] and experts copied go to `counts` and `copied`; resident, counts are
        recorded when `counts` is given (strata profile)."""
        ops, n = self.ops, self.n_experts
        if self.kind is PathKind.WINDOW_FETCH:
            host_fetch, starts, on = ops.host_fetch, self.experts.window_starts, valid > 0

            def fetching(p, h, w, idx):
                y, m = host_fetch.experts_fetch(h, idx, w, on, args["pool"], args["table"][p], args["chunks"][p],
                                                starts[p], layout)
                counts.append(ops.route_counts(idx, on, n))
                copied.append(m)
                return y
            return fetching

        def resident(p, h, w, idx):
            with ops.scope("routed_experts"):
                slots = ops.expert_slots(args["table"][p], idx, valid)                 # [T, k]; padding: -1
                w = w if w.dtype == h.dtype else w.astype(h.dtype)  # (an eager backend copies on a no-op astype)
                y = ops.experts_pool(h, slots, w, args["pool"], layout, n)
            if counts is not None:
                counts.append(ops.route_counts(idx, ops.valid_mask(h.shape[0], valid), n))
            return y
        return resident

    # --- layer by layer
    def on_host(self, valid: np.ndarray, part: bool, owner: str = "part"):
        """experts(p, h, w, idx) between host-driven layers (strata/experts/moe.py): valid [T] bool on the host. A
        part whose routes outnumber a layer's experts streams whole layers when the path does (stream.py)."""
        moe = self.experts.moe
        if part and self.streams_parts and int(valid.sum()) * self.k >= self.n_experts:
            return PartStream(moe, [chunks for chunks, _ in self.experts.window_chunks], valid)

        def resolved(p, h, w, idx):
            return moe.compute(p, h, w, idx, valid, part=part, owner=owner)
        return resolved

    def on_cpu(self, valid: np.ndarray):
        """experts(p, h, w, idx) with every route computed on the CPU from the host tier (the numerics guard's
        cpu_experts path): valid [T] bool on the host."""
        moe = self.experts.moe

        def on_cpu(p, h, w, idx):
            return moe.compute_cpu(p, h, w, idx, valid)
        return on_cpu

    def count_resident_routes(self, tokens: int) -> None:
        """A compiled resident window's routes were all hits (they are not read back)."""
        if self.kind is PathKind.RESIDENT and self.experts is not None:
            c = self.experts.cache
            c.stats.hits += tokens * self.k * c.n_layers

    def describe(self) -> str:
        return {PathKind.RESIDENT: "none (every expert resident)",
                PathKind.WINDOW_FETCH: "decode windows copy them from pinned host memory themselves",
                PathKind.STEPPED: "copied in layer by layer",
                PathKind.CPU_MISSES: "run on the CPU"}[self.kind]
