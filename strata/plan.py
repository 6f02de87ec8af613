"""What the scheduler and the engine share: the plan of one window, its result (plain numpy data), and the Executor
protocol that runs plans. The scheduler plans and is given an Executor; the engine implements it. Neither imports the
other.

A window has one decode row per slot (S = the number of slots; rows of slots that are not generating are inactive)
and at most one prompt part. Every slot's sampling parameters ride along in [S] arrays; the part uses its slot's.
The optional arrays (penalties, logit bias, grammar masks, logprobs, control vector scales) are None in a window whose
rows use none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class PromptPart:
    slot: int
    tokens: np.ndarray           # [n] int32, 1 <= n <= the part size
    start: int                   # position of tokens[0]; 0 starts a new sequence (its recurrent state is cleared)
    last: bool                   # the prompt's final part: its last row's sample is the first generated token
    copies: tuple[int, ...] = () # last part only: slots that take a copy of this slot's state after it and sample
                                 # their own first token from its logits (the other choices of an n > 1 request)
    reused: np.ndarray | None = None   # the first part after a prompt-cache hit of a row with a repetition penalty:
                                       # the tokens before start, which join its prompt set with the part's
    rows: "PromptRows | None" = None   # a prompt with images, or text after them: the part's rotary positions and
                                       # image rows (PromptRows of its n tokens); None: text at its cache positions


@dataclass(frozen=True)
class PromptRows:
    """What a prompt with images reads besides its tokens (Executor.prompt_rows), per token: its (t, h, w) rotary
    position and, at an image token, the vision tower's row."""
    rope: np.ndarray                   # [T, 3] int32
    images: np.ndarray | None          # [T, H] float32: the tower's rows at the image tokens (zeros elsewhere); None:
                                       # no image among these tokens
    is_image: np.ndarray               # [T] bool
    following: int                     # the rotary position of the token after them

    def part(self, start: int, n: int, size: int | None = None) -> "PromptRows":
        """Tokens start .. start + n - 1, padded to `size` rows (text positions on from the last); tokens past the
        prompt (a retry's generated tokens) are text, on from `following`."""
        size = size or n
        last = len(self.rope) - 1
        at = np.arange(start, start + size)
        inside = (at <= last) & (at < start + n)
        src = np.minimum(at, last)
        beyond = self.following + at - len(self.rope)                  # text past the prompt
        rope = np.where(inside[:, None], self.rope[src], beyond[:, None]).astype(np.int32)
        if n < size:                                                   # padding: on from the last real row
            rope[n:] = rope[n - 1] + 1 + np.arange(size - n)[:, None]
        is_image = inside & self.is_image[src]
        images = None
        if self.images is not None and is_image.any():
            images = np.where(is_image[:, None], self.images[src], 0).astype(np.float32)
        return PromptRows(rope, images, is_image, self.following)

    def offset(self, n: int) -> int:
        """A text token's rotary position minus its position after n tokens (the prompt's n: decoding's)."""
        return self.following - n


@dataclass(frozen=True)
class WindowPlan:
    decode_active: np.ndarray    # [S] bool
    decode_tokens: np.ndarray    # [S] int32: the token each active row feeds (-1 in a plan that continues a window
                                 # dispatched before it was read: the token that window samples, on the device;
                                 # >= 0 there: a row that joins, its token given by the host)
    decode_pos: np.ndarray       # [S] int32: its position
    temperature: np.ndarray      # [S] float32
    top_k: np.ndarray            # [S] int32
    top_p: np.ndarray            # [S] float32
    min_p: np.ndarray            # [S] float32
    seeds: np.ndarray            # [S, 2] uint32
    steps: np.ndarray            # [S] int32: the sampling step of each slot's request (key = f(seed, step))
    part: PromptPart | None = None
    penalties: np.ndarray | None = None    # [S, 3] float32: presence, frequency, repetition (off: 0, 0, 1)
    bias_ids: np.ndarray | None = None     # [S, B] int32 and
    bias_values: np.ndarray | None = None  # [S, B] float32: logit bias entries per row (padding: id -1)
    mask: np.ndarray | None = None         # [S, W] int32: a grammar's allowed next tokens, bit t % 32 of word t // 32
                                           # (rows without a grammar: all bits set); in a continuing plan only on
                                           # rows that join (a mask follows the token before it)
    logprobs: np.ndarray | None = None     # [S] int32: alternatives wanted per row, 0..TOP_LOGPROBS (-1: none)
    draft_len: np.ndarray | None = None    # [S] int32: a verify window (speculative decoding): the most drafts each
                                           # row verifies, of those the window before left on the device (0: none,
                                           # it drafts for the next); None: a window that neither verifies nor drafts
    numerics: tuple[str, ...] | None = None  # [S]: the numerics path of each slot's rows and part, DEFAULT or one
                                             # of the executor's `numerics` (a guard's retry); never in a continued
                                             # plan
    control_scale: np.ndarray | None = None  # [S] float32: each slot's scale of the executor's control vector, for
                                             # its rows and part (1: as loaded, 0: off); None: every slot's is 1
    mask_late: np.ndarray | None = None      # [S] bool: continuing rows (token -1) whose grammar mask follows the
                                             # token before it, given by Executor.give_masks after dispatch (an
                                             # executor whose capacity has late_masks)
    rope_offset: np.ndarray | None = None    # [S] int32: each row's rotary position minus its position (a prompt
                                             # with images took fewer rotary positions than tokens); None: all 0

    @property
    def sampling(self) -> tuple:
        """The rows' sampling settings [S] each, in the samplers' order: temperature, top_k, top_p, min_p."""
        return self.temperature, self.top_k, self.top_p, self.min_p

    @property
    def shaped(self) -> bool:
        """Whether any row uses penalties, a logit bias, a grammar mask or logprobs: the window then samples from
        logits it gets back from the forward pass (strata/engine/sampling.py) instead of inside it."""
        return any(x is not None for x in (self.penalties, self.bias_ids, self.mask, self.logprobs, self.mask_late))

    @property
    def n_decode(self) -> int:
        return int(self.decode_active.sum())

    @property
    def tokens(self) -> int:
        return self.n_decode + (len(self.part.tokens) if self.part else 0)

    def continued(self) -> "WindowPlan":
        """The plan of the window that continues every active row of this one, dispatched before this one is read:
        each row one position and one step on, its token -1 (the one this window samples, kept on the device); no
        prompt part, no masks. (WindowRunner.dispatch(plan, after=...) checks a continuing plan against it: it may
        also drop rows of this one and join rows inactive in it, their tokens given by the host.)"""
        on = self.decode_active
        return replace(self, decode_tokens=np.where(on, -1, 0).astype(np.int32),
                       decode_pos=np.where(on, self.decode_pos + 1, self.decode_pos).astype(np.int32),
                       steps=np.where(on, self.steps + 1, self.steps).astype(np.int32), part=None, mask=None,
                       mask_late=None)


DEFAULT = "default"              # the executor's own numerics path (WindowPlan.numerics)
TOP_LOGPROBS = 20               # the most alternatives a row's logprobs report


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of the model's distribution (log-softmax of the raw logits, before penalties, bias, masks
    and temperature) for B rows."""
    sampled: np.ndarray          # [B] float32: of the sampled token
    top_ids: np.ndarray          # [B, K] int32: the K most likely tokens, most likely first
    top: np.ndarray              # [B, K] float32: their log-probabilities


@dataclass(frozen=True)
class WindowResult:
    decode_next: np.ndarray      # [S] int32 (meaningful where decode_active)
    decode_finite: np.ndarray    # [S] bool: the row's logits were finite
    part_next: int | None        # the token sampled after the part's last row
    part_finite: bool | None     # the part's last logits and its residual at the part's end were finite
    decode_s: float              # device time of the decode rows
    part_s: float                # device time of the prompt part
    copies_next: np.ndarray | None = None      # [len(part.copies)] int32: the copies' first tokens
    decode_logprobs: Logprobs | None = None    # B = S (a plan with logprobs)
    part_logprobs: Logprobs | None = None      # B = 1 + len(part.copies): the part's slot, then its copies
    # a verify window's rows: decode_next follows the drafts each accepted; a row emits accepted[:n] + [next]
    decode_accepted: np.ndarray | None = None  # [S, K] int32: the accepted drafts, the first decode_n_accepted
    decode_n_accepted: np.ndarray | None = None    # [S] int32
    decode_n_drafts: np.ndarray | None = None      # [S] int32: drafts verified (offered)


def idle_plan(n_slots: int) -> WindowPlan:
    """A window in which no slot generates (the scheduler fills in what it needs)."""
    z = lambda dt: np.zeros(n_slots, dt)  # noqa: E731
    return WindowPlan(decode_active=z(bool), decode_tokens=z(np.int32), decode_pos=z(np.int32),
                      temperature=z(np.float32), top_k=z(np.int32), top_p=np.ones(n_slots, np.float32),
                      min_p=z(np.float32), seeds=np.zeros((n_slots, 2), np.uint32), steps=z(np.int32))


@dataclass(frozen=True)
class Repair:
    """What Executor.repair did: expert slots checked against the pack's checksums, the ones that failed (rewritten
    from the host tier), and whether the whole expert device state was rebuilt."""
    verified: int = 0
    bad: tuple[tuple[int, int, int], ...] = ()   # (device slot, MoE layer position, expert)
    rebuilt: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class Capacity:
    """What an Executor can hold: the scheduler plans within it."""
    slots: int                   # S: decode rows of a window (the parallel slots)
    part_size: int               # the largest prompt part a window carries
    max_context: int             # tokens of one sequence: prompt + generated
    part_sizes: tuple[int, ...] = ()     # the compiled part sizes, ascending: a part is padded up to the smallest
                                         # that holds it (empty: every size up to part_size, nothing padded)
    draft: int = 0                       # K: the most drafts a row verifies in one window (0: no speculative
                                         # decoding; WindowPlan.draft_len)
    kv_resident: int = 0                 # rows of each slot's attention KV window on the device (0: every
                                         # position there; else older ones are in host RAM: host_positions)
    stages: int = 1                      # a layer split's stages (devices): with more than one, decode windows
                                         # alternate between two groups of slots, so that the next window does not
                                         # wait for this one and the first stage runs it while the last runs this
    row_buckets: tuple[int, ...] = ()    # decode windows are compiled for these fewer rows too (row_buckets)
    late_masks: bool = False             # a continuing plan's grammar rows may take their masks after dispatch
                                         # (WindowPlan.mask_late, Executor.give_masks): they decode every window

    def padded(self, n: int) -> int:
        """The tokens a part of n tokens costs: the smallest compiled part size that holds it."""
        return next((s for s in self.part_sizes if s >= n), n)


@dataclass(frozen=True, eq=False)
class Saved:
    """A copy an Executor keeps of part of one slot's sequence state for the prompt cache: the recurrent state of
    the linear layers (a checkpoint: Executor.snapshot) or the attention KV of positions 0..tokens-1 (a parked
    conversation: Executor.save_kv). Opaque to the scheduler but for its size and where it lives."""
    data: Any                    # the executor's own
    nbytes: int
    on_host: bool                # in host RAM (else on the device)
    tokens: int = 0              # save_kv: the positions it holds


class Executor(Protocol):
    """Runs WindowPlans. dispatch() starts a window and returns a handle; collect(handle) waits for it and reads its
    WindowResult. Windows are collected in the order they were dispatched. When `chains` is true, a decode-only plan
    that continues the last dispatched window may be dispatched before that window is collected: dispatch(plan,
    after=handle). Its rows with token -1 continue rows of that window (plan.continued()); it may leave out rows of
    that window and add rows inactive in it, with their tokens (and masks) given. With capacity.late_masks its
    grammar rows may continue too (mask_late): the window samples them once give_masks(handle, mask) gives their
    masks, which the scheduler computes from the tokens of the window before while this one runs.

    The prompt cache's copies act on a slot as every window dispatched so far leaves it: snapshot(slot) copies its
    recurrent state (conv + delta rule; the KV stays in the slot), restore(slot, saved) puts one back (a part that
    starts at the checkpoint's position then continues it, the KV beyond it overwritten before it is visible),
    to_host moves a snapshot to host RAM, save_kv/load_kv copy the KV of a sequence's first n positions to host RAM
    and back into a slot (parking a conversation; after load_kv the slot's recurrent state is a restore's to set;
    with a host tier save_kv may keep the slot's host KV in place instead, nbytes 0: drop_kv frees what it holds);
    copy_kv(slot, n, src) sets a slot's first n KV positions to another slot's or a parked KV's (which stays parked).
    None of them is called on a slot that a non-finite row poisoned until repair() has cleared it."""
    capacity: Capacity
    chains: bool
    numerics: tuple[str, ...]    # the numerics paths it can run besides DEFAULT, each a different computation (the
                                 # guard's retry ladder, in order)

    def warm_up(self) -> float: ...                                     # compile every shape; -> seconds
    def dispatch(self, plan: WindowPlan, after: Any = None) -> Any: ...
    def collect(self, handle: Any) -> WindowResult: ...
    def give_masks(self, handle: Any, mask: np.ndarray | None) -> None: ...  # [S, W] for its mask_late rows
                                                        # (None: all allowed), before it is collected or continued
    def metrics(self) -> dict: ...                                      # counters for /metrics (flat, numeric)
    def snapshot(self, slot: int) -> Saved: ...                         # on the device
    def restore(self, slot: int, saved: Saved) -> None: ...
    def to_host(self, saved: Saved) -> Saved: ...
    def save_kv(self, slot: int, n: int) -> Saved: ...                  # on the host
    def load_kv(self, slot: int, saved: Saved) -> None: ...
    def drop_kv(self, saved: Saved) -> None: ...                        # a save_kv's the cache no longer holds
    def copy_kv(self, slot: int, n: int, src: int | Saved) -> None: ...  # a branch's prefix from a slot or parked KV
    def host_positions(self, slot: int) -> int: ...                     # its KV positions in host RAM (0: one tier)
    # a prompt's rotary positions and image rows, its images (the Request's) encoded; None: plain text at its cache
    # positions (no images, no image tokens)
    def prompt_rows(self, ids: tuple[int, ...], images: tuple) -> PromptRows | None: ...
    # between windows (none in flight): verify the expert slots and rewrite bad ones from the host tier, clear the
    # sequence states of `slots` (non-finite rows': NaN must not linger in their KV) but, per slot, the KV of the
    # first keep[i] positions (finite windows wrote them: a retry resumes there from a checkpoint; None: keep none);
    # rebuild: also rewrite every expert slot and drop cached device arguments
    def repair(self, slots: tuple[int, ...], rebuild: bool = False, keep: tuple[int, ...] | None = None) -> Repair: ...
