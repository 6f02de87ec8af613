"""Requests and the events a request's stream carries: plain data shared by the HTTP layer and the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    seed: int | None = None      # a seeded request is reproducible whatever else runs beside it


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int                              # prompt + max_tokens <= max_context (the HTTP layer checks)
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()                   # stop strings, matched on the content text
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's end-of-sequence tokens
    reasoning: bool = False                      # the prompt ends inside a reasoning block (generation prompt
                                                 # opened <think>): text is reasoning until </think>


@dataclass(frozen=True)
class Delta:
    """Text a request produced since its last event (either part may be empty)."""
    content: str = ""
    reasoning: str = ""


@dataclass(frozen=True)
class Finished:
    reason: str                  # "stop" (end-of-sequence token or stop string) | "length" (max_tokens / context)
                                 # | "abort" (the server shut down before the end: Scheduler.abort)
    prompt_tokens: int
    completion_tokens: int
    timings: dict = field(default_factory=dict)   # read_ms, generate_ms, parts, ...


@dataclass(frozen=True)
class Failed:
    message: str                 # a person can act on it
    status: int = 500


Event = Delta | Finished | Failed


class QueueFull(Exception):
    """The admission queue is at its bound: the HTTP layer answers 503 with Retry-After."""

    def __init__(self, depth: int, retry_after_s: int = 1):
        super().__init__(f"the server is busy: {depth} requests are waiting; retry in {retry_after_s} s")
        self.depth, self.retry_after_s = depth, retry_after_s
