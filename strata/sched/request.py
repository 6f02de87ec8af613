"""Requests and the events a request's stream carries: plain data shared by the HTTP layer and the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    seed: int | None = None      # a seeded request is reproducible whatever else runs beside it
    presence_penalty: float = 0.0        # minus this from a generated token's logit once it was generated
    frequency_penalty: float = 0.0       # minus this times the number of times it was generated
    repetition_penalty: float = 1.0      # a prompt or generated token's logit divided by it (negative: multiplied)
    logit_bias: tuple[tuple[int, float], ...] = ()      # (token id, added to its logit), ids distinct

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)


class TokenMatcher(Protocol):
    """One choice's grammar state, advanced by each token it generates (strata/serve/grammar.py)."""

    def mask(self) -> np.ndarray: ...            # int32 [W]: the allowed next tokens (bit t % 32 of word t // 32)
    def accept(self, token: int) -> bool: ...    # advance by a sampled token; False: the grammar rejects it
    def done(self) -> bool: ...                  # complete: nothing may follow but the end of the reply
    def error(self) -> str: ...                  # why it failed, once accept returned False


class TokenConstraint(Protocol):
    """A request's grammar: each choice gets a fresh matcher."""

    def matcher(self) -> TokenMatcher: ...


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
    n: int = 1                                   # choices: the prompt is read once, each choice samples its own
    logprobs: int | None = None                  # report each token's logprob and this many alternatives (<= 20)
    constraint: TokenConstraint | None = None    # a grammar every choice's tokens must follow
    cache_prompt: bool = True                    # reuse a stored conversation's prefix (prompt cache)
    checkpoints: bool = True                     # store this request's conversation with checkpoints
    turn_at: int | None = None                   # where the last assistant header starts (a checkpoint there)
    chat: bool = False                           # a chat reply: reasoning blocks' layout whitespace is trimmed
    cache_key: tuple = ()                        # what besides the tokens a stored state depends on: the prompt
                                                 # cache shares state only between requests of equal keys
    control_scale: float = 1.0                   # the executor's control vector times this for every row of this
                                                 # request (1: as loaded; 0: off; part of cache_key)
    images: tuple = ()                           # the images of the prompt's image tokens, in order (the executor's
                                                 # form: Executor.prompt_rows reads them)
    cache_ids: tuple[int, ...] | None = None     # the prompt as the prompt cache matches it: image tokens stand for
                                                 # their image (ids from its hash, never a real token's); None:
                                                 # prompt_ids


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float                               # of the model's distribution (log-softmax of the raw logits)
    top: tuple[tuple[int, float], ...] = ()      # the most likely tokens and their logprobs, most likely first


@dataclass(frozen=True)
class Delta:
    """Text a request's choice produced since its last event (either part may be empty), and the logprobs of the
    tokens sampled since then (when the request asked for them)."""
    content: str = ""
    reasoning: str = ""
    index: int = 0                               # the choice
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """A choice's end (a request of n choices ends after n of them)."""
    reason: str                  # "stop" (end-of-sequence token, stop string, grammar complete) | "length"
                                 # | "abort" (the server shut down before the end: Scheduler.abort)
    prompt_tokens: int
    completion_tokens: int
    timings: dict = field(default_factory=dict)   # read_ms, generate_ms, parts, ...
    index: int = 0
    cached_tokens: int = 0       # prompt tokens the prompt cache gave (not read): usage.prompt_tokens_details


@dataclass(frozen=True)
class Failed:
    """The request's end, whatever its choices had done."""
    message: str                 # a person can act on it
    status: int = 500
    code: str | None = None      # the error object's code, when a client can act on it by code ("non_finite")
    detail: tuple[tuple[str, object], ...] = ()   # more fields of the error object (JSON values), in order


Event = Delta | Finished | Failed


class QueueFull(Exception):
    """The admission queue is at its bound: the HTTP layer answers 503 with Retry-After."""

    def __init__(self, depth: int, retry_after_s: int = 1):
        super().__init__(f"the server is busy: {depth} requests are waiting; retry in {retry_after_s} s")
        self.depth, self.retry_after_s = depth, retry_after_s
