"""How much each slot drafts (speculative decoding), decided from what the windows measured.

Per slot: the share of drafts reached that were accepted, a moving average; a slot drafts while the chance that
every draft before the next one was accepted stays at least KEEP, so a slot whose drafts are rejected drafts less
(at least one, which keeps measuring). Per batch (the number of decode rows): tokens a second of windows that
verify against windows that do not, from their reported device times; spec stays on while it is the faster, and the
slower kind is tried again every EXPLORE windows (costs change with the context and the batch).
"""
from __future__ import annotations

from collections import deque

KEEP = 0.3          # draft once more while the drafts before it are all accepted at least this often
WEIGHT = 0.2        # of a window's acceptance in a slot's average
EXPLORE = 32        # windows between tries of the kind measured slower
RECENT = 8          # windows per (batch, kind) the rates average over


class DraftPolicy:
    def __init__(self, k_max: int, adaptive: bool = True):
        """k_max: the executor's K; adaptive False: every slot offers k_max drafts in every window (tests)."""
        self.k_max, self.adaptive = k_max, adaptive
        self.rate: dict[int, float] = {}
        self.costs: dict[tuple[int, bool], deque] = {}
        self.windows = 0

    def reset(self, slot: int) -> None:
        """A new request in slot: it starts drafting k_max."""
        self.rate[slot] = 1.0

    def length(self, slot: int) -> int:
        if not self.adaptive:
            return self.k_max
        alpha, k = self.rate.get(slot, 1.0), 1
        while k < self.k_max and alpha ** k >= KEEP:
            k += 1
        return k

    def record(self, slot: int, offered: int, accepted: int) -> None:
        """A window verified `offered` drafts of slot and accepted the first `accepted` (a rejection ends the rest)."""
        if offered:
            reached = min(offered, accepted + 1)
            self.rate[slot] = (1 - WEIGHT) * self.rate.get(slot, 1.0) + WEIGHT * accepted / reached

    def on(self, n_rows: int) -> bool:
        """Whether a window of n_rows decode rows verifies drafts."""
        if not self.adaptive:
            return True
        spec, plain = self._rate(n_rows, True), self._rate(n_rows, False)
        if spec is None or plain is None:
            return plain is not None                    # measure each kind once
        faster = spec >= plain
        return (not faster) if self.windows % EXPLORE == 0 else faster

    def window(self, n_rows: int, spec: bool, tokens: int, seconds: float) -> None:
        """A window of n_rows decode rows (no prompt part) emitted `tokens` in `seconds` of device time."""
        self.windows += 1
        if seconds > 0:
            self.costs.setdefault((n_rows, spec), deque(maxlen=RECENT)).append((tokens, seconds))

    def _rate(self, n_rows: int, spec: bool) -> float | None:
        got = self.costs.get((n_rows, spec))
        if not got:
            return None
        return sum(t for t, _ in got) / sum(s for _, s in got)
