"""The numerics guard's policy: what follows a row whose logits (or a prompt part's residual) came back non-finite.

Plain data in, decisions out: no clock, executor or slot of its own (the caller passes `now`). A request's failed
attempt is retried on the next rung of the ladder (the numerics paths the executor offers besides its default), so
no retry repeats a computation (the caller resumes it from a clean checkpoint of its prompt, else from the start); a
failure that overlaps the positions of an earlier attempt's, or one with no rung left, ends the request with an
explicit error. Failures of `storm` different requests
within `window_s` seconds ask for every expert slot to be verified and the device state rebuilt (once per storm).
The caller verifies and repairs the expert slots and clears the slot's state after every failure.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from strata.plan import DEFAULT


@dataclass(frozen=True)
class Attempt:
    numerics: str                # the path it ran on: DEFAULT or a rung
    first: int                   # the positions whose row went non-finite: a decode row's (first == last) or the
    last: int                    # prompt part's (its last row is where the logits were)

    def overlaps(self, other: "Attempt") -> bool:
        return self.first <= other.last and other.first <= self.last

    def as_json(self) -> dict:
        return {"numerics": self.numerics, "position": self.last}


@dataclass(frozen=True)
class Retry:
    numerics: str                # the rung the next attempt runs on
    rebuild: bool                # a storm: verify every slot and rebuild the device state first


@dataclass(frozen=True)
class GiveUp:
    attempts: tuple[Attempt, ...]
    rebuild: bool
    why: str                     # "again at the same position" | "no numerics path left to try"

    @property
    def position(self) -> int:
        return self.attempts[-1].last

    def message(self) -> str:
        tried = ", ".join(a.numerics for a in self.attempts)
        return (f"non-finite logits at position {self.position} {self.why} after {len(self.attempts)} attempts "
                f"({tried}); resending the same request is likely to fail the same way")

    def detail(self) -> tuple:
        return (("position", self.position), ("attempts", [a.as_json() for a in self.attempts]))


class Guard:
    def __init__(self, ladder=(), storm: int = 3, window_s: float = 600.0):
        """ladder: the rungs retries run on, in order (each a numerics path the executor offers); storm: failures of
        this many different requests within window_s seconds trigger a rebuild (0: never)."""
        if len(set(ladder)) != len(ladder) or DEFAULT in ladder:
            raise ValueError(f"a guard ladder names distinct paths other than {DEFAULT!r}, found {list(ladder)}")
        if storm < 0 or window_s <= 0:
            raise ValueError(f"storm must be >= 0 and window_s > 0, found {storm}, {window_s}")
        self.ladder, self.storm, self.window_s = tuple(ladder), storm, window_s
        self._recent: deque[tuple[float, str]] = deque()        # (when, request id) of recent failures

    def failed(self, request_id: str, attempts: tuple[Attempt, ...], now: float) -> Retry | GiveUp:
        """attempts: the request's attempts so far, the one that just failed last."""
        rebuild = self._storm(request_id, now)
        last = attempts[-1]
        if any(a.overlaps(last) for a in attempts[:-1]):
            return GiveUp(attempts, rebuild, "again at the same position")
        if len(attempts) > len(self.ladder):
            return GiveUp(attempts, rebuild, "with no numerics path left to try")
        return Retry(self.ladder[len(attempts) - 1], rebuild)

    def _storm(self, request_id: str, now: float) -> bool:
        self._recent.append((now, request_id))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if self.storm and len({r for _, r in self._recent}) >= self.storm:
            self._recent.clear()                               # one rebuild per storm
            return True
        return False

    def recent(self, now: float) -> int:
        """Different requests that failed within the window before now."""
        return len({r for t, r in self._recent if t >= now - self.window_s})
