"""The scheduler: admits requests into slots and plans windows over all of them, continuously; an Executor runs them.

It is given the Executor (strata/plan.py) and the model's values, and builds neither. Each window holds one decode
row per generating slot (a verify row: sched/drafts.py) and at most one prompt part of the earliest-admitted slot
still reading (beside decode rows, the rest of the window's token budget; alone, the part size). Executor calls run
in a worker thread; the next window is dispatched before the previous window's text is sent, and in steady decoding
(lookahead) before its tokens are read (a row that ended is computed once more, dropped; a grammar row's mask given
while its window runs). Slots go FREE -> READING -> GENERATING -> FREE; n choices hold n slots. Each choice ends
with one Finished, or its request with one Failed; a non-finite row goes to the guard (sched/guard.py). The prompt
cache (sched/prompt_cache.py) picks a slot and its checkpoint; one is taken only of exact, finite, default-path state.
"""
from __future__ import annotations

import enum
import logging
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field, replace

import anyio
import numpy as np

from strata.errors import StrataError
from strata.plan import (DEFAULT, Capacity, Executor, Logprobs, PromptPart, PromptRows, Repair, WindowPlan,
                         WindowResult)
from strata.sched.drafts import DraftPolicy
from strata.sched.guard import Attempt, GiveUp, Guard, Retry
from strata.sched.output import TextOutput
from strata.sched.prompt_cache import PromptCache, common_prefix
from strata.sched.request import Delta, Failed, Finished, QueueFull, Request, TokenLogprob

log = logging.getLogger("strata.sched")


class SlotState(enum.Enum):
    FREE = "free"
    READING = "reading"
    GENERATING = "generating"


@dataclass(eq=False)
class Group:
    """A request's event stream (send side), shared by the slots of its choices; closed once none is live."""
    send: object
    live: int


@dataclass
class Slot:
    id: int
    state: SlotState = SlotState.FREE
    req: Request | None = None
    group: Group | None = None
    choice: int = 0                      # which of its request's choices this slot generates
    lead: int | None = None              # READING without reading: the slot that reads the prompt for this choice
    matcher: object = None               # the choice's grammar state (TokenMatcher), when the request has one
    logprobs: list = field(default_factory=list)   # TokenLogprobs not yet sent
    output: TextOutput | None = None
    stops: frozenset = frozenset()
    seed: tuple[int, int] = (0, 0)
    read: int = 0                        # prompt tokens read (or reused)
    reused: int = 0                      # prompt tokens reused from the prompt cache
    pos: int = 0                         # tokens in the slot's sequence state
    generated: int = 0
    last_token: int = 0
    admitted: int = 0                    # admission order: the earliest reading slot gets the next part
    parts: int = 0
    decode_ms_between_parts: float = 0.0
    t_read_start: float = 0.0
    t_read_end: float = 0.0
    t_first_token: float = 0.0
    t_token: float = 0.0                 # when the last token was applied
    drafts: int = 0                      # drafts verified (speculative decoding)
    accepted: int = 0                    # of which accepted
    fed_past: int = 0                    # tokens a verify window fed past the one applied last (ended before them)
    events: list = field(default_factory=list)   # produced by the last window, sent after the next is dispatched
    sent: list = field(default_factory=list)     # the tokens generated so far (a retry reads them after the prompt)
    numerics: str = DEFAULT              # the numerics path of this attempt (the guard's rung on a retry)
    attempts: tuple = ()                 # the guard's Attempts that failed
    rows: PromptRows | None = None       # a prompt with images: its rotary positions and image rows
    rope_offset: int = 0                 # a generated token's rotary position minus its position (after images)

    @property
    def prompt(self) -> tuple[int, ...]:
        """What the slot reads: the prompt, and on a retry the tokens already sent (they are not sent again)."""
        return self.req.prompt_ids + tuple(self.sent)

    @property
    def keyed(self) -> tuple[int, ...]:
        """prompt as the prompt cache matches it (Request.cache_ids)."""
        return (self.req.cache_ids or self.req.prompt_ids) + tuple(self.sent)

    def reset(self) -> None:
        """Back to FREE with nothing of the last request (the device state is cleared when a sequence starts)."""
        self.__dict__.update(Slot(self.id).__dict__)


class Scheduler:
    def __init__(self, executor: Executor, *, tokenizer, eos_token_ids, queue_limit: int, lookahead: bool = True,
                 max_context: int | None = None, window_tokens: int | None = None, prompt_share: float = 1.0,
                 checkpoint_every: int = 512, checkpoint_ram_gib: float = 0.0, guard: Guard | None = None,
                 drafts: DraftPolicy | None = None, warm_up: bool = True):
        """tokenizer: decode_stream and token_to_id (strata/tokenizer.py); eos_token_ids: a request's stop tokens
        unless it names its own; max_context: tokens of one sequence, at most (and by default) the executor's;
        window_tokens: the token budget of a window with decode rows (None: none, a part of the part size beside
        them); prompt_share: the share of the device time of windows with decode rows that prompt parts may take
        (1: a part beside every window's rows); checkpoint_every, checkpoint_ram_gib: the prompt cache's (its
        checkpoints' spacing in tokens, and the host RAM for checkpoints and parked conversations); guard: the
        numerics guard's policy (default: the executor's numerics paths as its ladder); drafts: how much slots draft
        when the executor verifies drafts (capacity.draft > 0; default DraftPolicy, adaptive); warm_up: compile every
        window shape before serving (False: each compiles when first used)."""
        cap = executor.capacity
        max_context = cap.max_context if max_context is None else max_context
        if max_context > cap.max_context:
            raise ValueError(f"max_context {max_context} exceeds the executor's {cap.max_context}")
        self.executor, self.max_context, self.queue_limit = executor, max_context, queue_limit
        self.warm_up = warm_up
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self.prefill = cap.part_size
        if window_tokens is not None and window_tokens < 1:
            raise ValueError(f"window_tokens must be at least 1, found {window_tokens}")
        self.window_tokens = cap.part_size + cap.slots if window_tokens is None else window_tokens
        self.window_part = window_part(cap, self.window_tokens)
        if not 0 < prompt_share <= 1:
            raise ValueError(f"prompt_share must be in (0, 1], found {prompt_share}")
        self.prompt_share = prompt_share
        # device seconds the streams are owed (negative) since the last part beside them: a part is planned beside
        # decode rows only at 0 (_pace); parts are charged the median of the last few, so one part slowed by
        # something else (the host descheduled) does not hold the prompt back for many windows
        self.part_credit = 0.0
        self._part_times: deque[float] = deque(maxlen=5)
        # steady decoding dispatches the next window before reading this one (_continuation)
        self.lookahead = lookahead and executor.chains
        # a layer split pipelines: decode windows alternate between two groups of slots (_pipeline), each window's
        # successor independent of it, so the first stage runs window n+1 while the last stage runs window n
        self.pipelined = self.lookahead and cap.stages > 1
        self._turn = 0                            # which group of generating slots the last planned window took
        self.drafts = (drafts or DraftPolicy(cap.draft)) if cap.draft else None
        self.slots_ = [Slot(i) for i in range(cap.slots)]
        self.cache = PromptCache(executor, cap.slots, checkpoint_every, int(checkpoint_ram_gib * (1 << 30)))
        self._ahead_rows: np.ndarray | None = None   # the decode rows of a window dispatched after the one applied
        self.guard = guard if guard is not None else Guard(executor.numerics)
        unknown = [r for r in self.guard.ladder if r not in executor.numerics]
        if unknown:
            raise ValueError(f"the guard's ladder names {unknown}, which the executor does not run; it runs "
                             f"{list(executor.numerics)}")
        # slots whose device state a non-finite row poisoned, until the executor's repair cleared it: nothing may
        # snapshot or reuse their state (a prompt cache's checkpoints included); slot -> rebuild everything
        self.poisoned: dict[int, bool] = {}
        self.queue: deque[tuple[Request, object]] = deque()
        self.cancelled: set[str] = set()
        self.aborted: set[str] = set()           # cancelled with a Finished("abort") rather than a Failed (drain)
        self._wake = anyio.Event()
        self._admissions = 0
        # window_seconds_sum: wall time of windows (plan, dispatch, send, apply); device_seconds_sum: the device
        # calls inside them. Their difference is the scheduler's own overhead, of which plan, apply (bookkeeping and
        # text) and handoff (to the worker thread and back) are measured apart; the rest is the event loop's other
        # work (HTTP) running before the scheduler resumes.
        self.stats = {"requests_finished": 0, "requests_failed": 0, "prompt_tokens": 0, "generated_tokens": 0,
                      "windows": 0, "windows_ahead": 0, "windows_pipelined": 0, "windows_late_masks": 0,
                      "window_seconds_sum": 0.0, "device_seconds_sum": 0.0,
                      "plan_seconds_sum": 0.0, "apply_seconds_sum": 0.0, "handoff_seconds_sum": 0.0,
                      # gaps between a stream's tokens, in windows without and with a prompt part
                      "inter_token_seconds_sum": 0.0, "inter_tokens": 0,
                      "inter_token_seconds_beside_parts_sum": 0.0, "inter_tokens_beside_parts": 0,
                      # the numerics guard: rows that went non-finite, retries, the tokens they resumed from
                      # checkpoints, requests it ended, expert slots found corrupt (and rewritten), full rebuilds
                      "nonfinite_rows": 0, "guard_retries": 0, "guard_tokens_resumed": 0, "guard_failed": 0,
                      "expert_slots_repaired": 0,
                      "guard_rebuilds": 0, "drafts_verified": 0, "drafts_accepted": 0, "windows_verifying": 0}
        self._recent: deque[tuple[int, float]] = deque(maxlen=64)   # (tokens generated, seconds) per window
        self._pending: list[tuple[object, list]] = []                 # ended requests' streams and last events

    # --- the HTTP side (called on the event loop)
    def submit(self, req: Request):
        n = len(req.prompt_ids)
        if n < 1 or req.max_tokens < 1 or n + req.max_tokens > self.max_context:
            raise ValueError(f"request {req.id}: a prompt of {n} tokens (at least 1) plus max_tokens {req.max_tokens} "
                             f"(at least 1) must fit max_context {self.max_context}")
        if not 1 <= req.n <= len(self.slots_):
            raise ValueError(f"request {req.id}: n = {req.n} choices; this server has {len(self.slots_)} slots")
        sp = req.sampling
        if not (0 <= sp.top_k < 2 ** 31 and math.isfinite(sp.temperature) and sp.temperature >= 0
                and 0 < sp.top_p <= 1 and 0 <= sp.min_p <= 1 and (sp.seed is None or 0 <= sp.seed < 2 ** 63)):
            raise ValueError(f"request {req.id}: sampling values out of range: {sp}")
        if not math.isfinite(req.control_scale):
            raise ValueError(f"request {req.id}: control_scale must be a finite number, got {req.control_scale}")
        if len(self.queue) >= self.queue_limit:
            raise QueueFull(len(self.queue))
        send, receive = anyio.create_memory_object_stream(max_buffer_size=math.inf)
        self.queue.append((req, send))
        self._wake.set()
        return receive

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)
        self._wake.set()

    def drain(self, message: str) -> int:
        """Graceful shutdown, first step: every queued request ends now with Failed(message, 503); the caller stops
        submitting. -> how many there were."""
        n = len(self.queue)
        for req, send in self.queue:
            _send(send, Failed(message, 503))
            send.close()
        self.queue.clear()
        return n

    def abort(self) -> int:
        """Graceful shutdown, last step: every running request ends by the next window with Finished(reason="abort")
        (its text so far already sent). -> how many."""
        ids = [s.req.id for s in self.slots_ if s.req is not None]
        self.aborted.update(ids)
        self.cancelled.update(ids)
        self._wake.set()
        return len(ids)

    def busy(self) -> int:
        """Requests queued or in a slot."""
        return len(self.queue) + sum(s.req is not None for s in self.slots_)

    def slots(self) -> list[dict]:
        out = []
        for s in self.slots_:
            conv = self.cache.live[s.id]
            out.append({"id": s.id, "state": s.state.value, "request": s.req.id if s.req else None,
                        "prompt_tokens": len(s.req.prompt_ids) if s.req else 0, "reused": s.reused,
                        "read": s.read - s.reused, "generated": s.generated,
                        "numerics": s.numerics, "attempts": len(s.attempts), "poisoned": s.id in self.poisoned,
                        "conversation_tokens": len(conv.tokens) if conv is not None else 0,
                        "checkpoints": self.cache.checkpoints(s.id)})
            if self.drafts is not None:         # only with spec on: the shape is unchanged otherwise
                out[-1].update(drafts=s.drafts, drafts_accepted=s.accepted)
            if self.executor.capacity.kv_resident:    # only with a host tier for the KV (kv_resident)
                length = s.pos if s.req is not None else out[-1]["conversation_tokens"]
                host = min(self.executor.host_positions(s.id), length)
                out[-1].update(kv_device_tokens=length - host, kv_host_tokens=host)
        return out

    def metrics(self) -> dict:
        toks = sum(n for n, _ in self._recent)
        secs = sum(t for _, t in self._recent)
        out = dict(self.stats, queue_depth=len(self.queue), tokens_per_s=toks / secs if secs > 0 else 0.0)
        out.update(self.cache.stats, checkpoint_ram_bytes=self.cache.ram_bytes(),
                   conversations_parked_now=len(self.cache.parked))
        out.update(self.executor.metrics())
        return out

    # --- the engine task
    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED):
        seconds = await anyio.to_thread.run_sync(self.executor.warm_up) if self.warm_up else None
        paced = f", parts at most {self.prompt_share:.0%} of their time" if self.prompt_share < 1 else ""
        beside = "" if self.window_part == self.prefill and not paced else \
            f" ({self.window_part} beside decode rows: windows of {self.window_tokens} tokens{paced})"
        rows = self.executor.capacity.row_buckets
        rows = f", decode windows of {', '.join(map(str, rows))} or {len(self.slots_)} rows" if rows else ""
        log.info(f"strata batch: {len(self.slots_)} slots, prompt parts of up to {self.prefill} tokens{beside}{rows}, "
                 + (f"compiled at warm-up in {seconds * 1000:.0f} ms" if seconds is not None else
                    "no warm-up (warm_up off): each window shape compiles when first used"))
        task_status.started()
        try:
            await self._loop()
        finally:
            for s in self.slots_:
                if s.req is not None:
                    self._end(s, Failed("the server is shutting down", 503))
            self._send_pending()
            for req, send in self.queue:
                _send(send, Failed("the server is shutting down", 503))
                send.close()                      # its stream ends after its one final event, as every other's

    async def _loop(self):
        ahead = None                              # (plan, window) dispatched ahead and not yet read
        while True:
            t0 = time.perf_counter()
            if ahead is None:
                if self.poisoned:                 # no window in flight: the executor repairs what they read
                    await self._repair()
                self._drop_cancelled()
                self._admit()
                plan, window = self._plan(), None
                if plan is None:
                    self._send_pending()
                    await self._wake.wait()
                    self._wake = anyio.Event()
                    continue
            else:
                plan, window = ahead
            following = self._continuation(plan)
            box: dict = {}
            t1 = time.perf_counter()
            masks = self._late_masks(plan) if plan.mask_late is not None else None     # (only a plan ahead has it)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._run_window, plan, window, following, box, masks)
                self._send_pending()              # the previous window's text, while this one runs
            t2 = time.perf_counter()
            self._ahead_rows = following.decode_active if box.get("following") is not None else None
            self._apply(plan, box)
            ahead = (following, box["following"]) if box.get("following") is not None else None
            t3 = time.perf_counter()
            self.stats["window_seconds_sum"] += t3 - t0
            self.stats["plan_seconds_sum"] += t1 - t0
            self.stats["apply_seconds_sum"] += t3 - t2

    async def _run_window(self, plan: WindowPlan, window, following: WindowPlan | None, box: dict,
                          masks: np.ndarray | None = None):
        """Run plan (already dispatched when window is given; its mask_late rows' masks given first) and, when
        following is given, dispatch it before reading plan's result: box["following"] is its window, which the next
        turn of the loop reads."""
        t = time.perf_counter()

        def work():
            if plan.mask_late is not None:
                self.executor.give_masks(window, masks)
                self.stats["windows_late_masks"] += 1
            w = window if window is not None else self.executor.dispatch(plan)
            if following is not None:
                # pipelined, a successor with every token known waits for nothing of w's (not even its rows)
                chained = not self.pipelined or (following.decode_tokens[following.decode_active] < 0).any()
                try:
                    box["following"] = self.executor.dispatch(following, after=w if chained else None)
                    self.stats["windows_ahead"] += 1
                    self.stats["windows_pipelined"] += not chained
                except Exception as exc:           # noqa: BLE001 - planned afresh next turn instead
                    log.warning(f"strata batch: a window could not be dispatched ahead ({type(exc).__name__}: "
                                f"{exc}); the next one is planned after this one's tokens")
            return self.executor.collect(w)
        try:
            box["result"] = await anyio.to_thread.run_sync(work)
        except Exception as exc:                  # noqa: BLE001 - a failed window fails its requests, not the server
            box["error"] = exc
            box.pop("following", None)            # it continued the failed window: its rows are the failed ones'
        box["seconds"] = time.perf_counter() - t

    def _continuation(self, plan: WindowPlan) -> WindowPlan | None:
        """The window after plan when nothing can change between them but the tokens, which stay on the device:
        no prompt part or prompt to read, no request waiting or cancelled, and every generating slot without a
        grammar in plan and not ending by length after plan's token. Those rows continue on the device. A grammar's
        next mask needs the token before it: with late masks its row continues and gets its mask after plan is read
        (mask_late, _late_masks); else a slot with one drops out when in plan and joins (its token, mask and position
        given) when not: it decodes every other window; pipelined (a layer split) with several slots
        generating, every slot does, so the window after plan is the other group's. None when no row would be left.
        A row that ends on plan's token (a stop token or string) is computed once more and its result dropped (its
        slot is free by then; a new sequence clears the state), so a slot's state may run one token past its
        request's end: whatever snapshots a slot's state (prompt-cache checkpoints) must take it from a window
        applied to a live request (_exact). None also before a window after which a continuing row takes a
        checkpoint."""
        if (not self.lookahead or plan.part is not None or not plan.n_decode or self.queue or self.cancelled
                or plan.draft_len is not None           # a verify window's positions are known once it is read
                or plan.numerics is not None or self.poisoned):     # rows on a numerics path are read at once
            return None
        on = plan.decode_active
        keep, joined = np.zeros_like(on), []
        # pipelined with several slots generating, every slot alternates as a grammar's does (_pipeline)
        groups = self.pipelined and sum(s.state is SlotState.GENERATING for s in self.slots_) > 1
        late = self.executor.capacity.late_masks and not groups
        for s in self.slots_:
            if s.state is SlotState.READING or (on[s.id] and s.state is not SlotState.GENERATING):
                return None                       # a prompt to read, or a row whose request ended
            if s.state is not SlotState.GENERATING:
                continue
            if (s.matcher is not None and not late) or groups:  # in plan: its token is not known yet; else applied
                if not on[s.id]:
                    joined.append(s)
            elif (not on[s.id] or s.generated + 1 >= s.req.max_tokens or s.pos + 2 >= self.max_context
                  or self._checkpoint_at(s, s.pos + 1)):   # (a checkpoint is taken of plan's state)
                return None
            else:
                keep[s.id] = True
        if not keep.any() and not joined:
            return None
        if self.drafts is not None and self.drafts.on(int(keep.sum()) + len(joined)):
            return None                           # the next window verifies drafts: planned once this one is read
        if groups:
            self._turn ^= 1
        nxt = plan.continued()
        active, tokens = keep.copy(), np.where(keep, -1, 0).astype(np.int32)
        pos, steps = nxt.decode_pos.copy(), nxt.steps.copy()
        for s in joined:
            active[s.id], tokens[s.id], pos[s.id], steps[s.id] = True, s.last_token, s.pos, s.generated
        # a grammar row that continues takes its mask once plan's token is read (_late_masks), while this one runs
        mask_late = keep & np.array([s.matcher is not None for s in self.slots_])
        return replace(nxt, decode_active=active, decode_tokens=tokens, decode_pos=pos, steps=steps,
                       mask=self._masks(joined), mask_late=mask_late if mask_late.any() else None,
                       rope_offset=self._rope_offsets())

    # --- admission and cancellation
    def _admit(self):
        """Queue order into FREE slots; a request of n choices waits at the head until n slots are free, and one
        whose prompt another slot is reading further than the cache holds waits for that slot's checkpoints."""
        behind = []
        try:
            while self.queue:
                req, send = self.queue[0]
                if self._behind_a_reader(req):
                    behind.append(self.queue.popleft())
                    continue
                free = [s for s in self.slots_ if s.state is SlotState.FREE][:req.n]
                if len(free) < req.n:
                    return
                self.queue.popleft()
                try:
                    rows = self.executor.prompt_rows(req.prompt_ids, req.images)
                except (StrataError, ValueError) as e:      # its images do not fit its prompt, or the model's
                    _send(send, Failed(str(e), 400, "invalid_image"))
                    send.close()
                    continue
                self._admit_one(req, send, rows)
        finally:
            self.queue.extendleft(reversed(behind))

    def _behind_a_reader(self, req: Request) -> bool:
        """Whether a slot reads a prompt that shares at least checkpoint_every more of req's prompt than the cache
        holds: agents sent together with one system prompt read it once, the others restart from its checkpoints."""
        if not req.cache_prompt:
            return False
        prompt = np.asarray(req.cache_ids or req.prompt_ids)
        held = self.cache.reusable(prompt, req.cache_key)
        return any(s.state is SlotState.READING and s.req.checkpoints and s.numerics == DEFAULT
                   and s.req.cache_key == req.cache_key
                   and min(common_prefix(s.keyed, prompt), len(prompt) - 1) - held >= self.cache.every
                   for s in self.slots_)

    def _admit_one(self, req: Request, send, rows: PromptRows | None = None) -> None:
        """Give a request its slots (n choices: n), prepared by the prompt cache."""
        self._admissions += 1
        base = secrets.randbits(63) if req.sampling.seed is None else req.sampling.seed
        stops = req.stop_token_ids if req.stop_token_ids is not None else self.eos_token_ids
        group = Group(send, req.n)
        ids = [s.id for s in self.slots_ if s.state is SlotState.FREE]
        shared = tuple(s.id for s in self.slots_ if s.state is not SlotState.FREE and s.id not in self.poisoned)
        lead, reused = self.cache.start(req.cache_ids or req.prompt_ids, ids, req.cache_prompt, req.cache_key, shared)
        ids.remove(lead)
        free = [self.slots_[lead]]
        for _ in range(req.n - 1):
            free.append(self.slots_[self.cache.claim(ids, req.cache_key)])
            ids.remove(free[-1].id)
        for i, slot in enumerate(free):
            seed = choice_seed(base, i)
            slot.reset()
            slot.state, slot.req, slot.group, slot.admitted = SlotState.READING, req, group, self._admissions
            slot.choice, slot.lead = i, (None if i == 0 else free[0].id)
            slot.seed = (seed & 0xFFFFFFFF, (seed >> 32) & 0x7FFFFFFF)
            slot.stops = frozenset(stops)
            slot.output = TextOutput(self.tokenizer, req.prompt_ids, req.stop, req.reasoning, req.chat)
            slot.matcher = req.constraint.matcher() if req.constraint is not None else None
            slot.rows = rows
            slot.rope_offset = 0 if rows is None else rows.offset(len(req.prompt_ids))
            if self.drafts is not None:
                self.drafts.reset(slot.id)
        free[0].read = free[0].pos = free[0].reused = reused

    def _drop_cancelled(self):
        if not self.cancelled:
            return
        for slot in self.slots_:
            if slot.req is not None and slot.req.id in self.aborted:
                if slot.state is SlotState.READING:
                    slot.t_read_start = slot.t_read_start or time.perf_counter()
                    slot.t_read_end = slot.t_first_token = time.perf_counter()
                self._finish(slot, "abort")
            elif slot.req is not None and slot.req.id in self.cancelled:
                log.info(f"strata serve: request {slot.req.id} cancelled by its client; slot {slot.id} is free")
                self._end(slot, Failed("cancelled by the client", 499))
        waiting = deque()
        for req, send in self.queue:
            if req.id in self.cancelled:
                _send(send, Failed("cancelled by the client", 499))
                send.close()
            else:
                waiting.append((req, send))
        self.queue = waiting
        self.cancelled.clear()
        self.aborted.clear()

    # --- planning
    def _plan(self) -> WindowPlan | None:
        gen = [s for s in self.slots_ if s.state is SlotState.GENERATING]
        reading = sorted((s for s in self.slots_ if s.state is SlotState.READING and s.lead is None),
                         key=lambda s: s.admitted)
        if not gen and not reading:
            return None
        n = len(self.slots_)
        active = np.zeros(n, bool)
        tokens, pos = np.zeros(n, np.int32), np.zeros(n, np.int32)
        temp, top_k = np.zeros(n, np.float32), np.zeros(n, np.int32)
        top_p, min_p = np.ones(n, np.float32), np.zeros(n, np.float32)
        seeds, steps = np.zeros((n, 2), np.uint32), np.zeros(n, np.int32)
        for s in self.slots_:
            if s.req is None:
                continue
            sp = s.req.sampling
            temp[s.id], top_k[s.id], top_p[s.id], min_p[s.id] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
            seeds[s.id], steps[s.id] = s.seed, s.generated
        if not reading:                           # (a part's window is read at once: its rows are not halved)
            gen = self._pipeline(gen)
        for s in gen:
            active[s.id], tokens[s.id], pos[s.id] = True, s.last_token, s.pos
        part = None
        if reading and (not gen or self.part_credit >= 0):
            s = reading[0]
            prompt = s.prompt
            size = min(self._part_tokens(len(gen)), self._next_checkpoint(s) - s.read)
            chunk = np.asarray(prompt[s.read:s.read + size], np.int32)
            last = s.read + len(chunk) == len(prompt)
            copies = tuple(o.id for o in self.slots_ if o.lead == s.id) if last else ()
            reused = (np.asarray(prompt[:s.read], np.int32) if s.parts == 0 and s.read > 0
                      and s.req.sampling.repetition_penalty != 1 else None)
            part = PromptPart(slot=s.id, tokens=chunk, start=s.read, last=last, copies=copies, reused=reused,
                              rows=None if s.rows is None else s.rows.part(s.read, len(chunk)))
        sampled = gen + ([self.slots_[i] for i in (part.slot, *part.copies)] if part is not None and part.last else [])
        numerics = tuple(s.numerics for s in self.slots_)
        plan = WindowPlan(decode_active=active, decode_tokens=tokens, decode_pos=pos, temperature=temp, top_k=top_k,
                          top_p=top_p, min_p=min_p, seeds=seeds, steps=steps, part=part,
                          numerics=numerics if any(n != DEFAULT for n in numerics) else None,
                          rope_offset=self._rope_offsets(),
                          **self._shaping([s for s in self.slots_ if s.req is not None], sampled))
        return self._drafting(plan, gen)

    def _rope_offsets(self) -> np.ndarray | None:
        """Every slot's rope_offset [S] int32, or None when all are 0."""
        offsets = np.array([s.rope_offset for s in self.slots_], np.int32)
        return offsets if offsets.any() else None

    def _pipeline(self, gen: list[Slot]) -> list[Slot]:
        """Pipelined (a layer split): the generating slots a window takes, every other one in turn, so that the
        next window (the other group, its tokens known) is dispatched without waiting for this one's."""
        if not self.pipelined or len(gen) < 2:
            return gen
        self._turn ^= 1
        return gen[self._turn::2]

    def _drafting(self, plan: WindowPlan, gen: list[Slot]) -> WindowPlan:
        """A verify window when the executor verifies drafts, the policy wants them at this batch and no row is
        shaped (penalties, bias, grammar, logprobs): each row offers what its slot drafts, within its request's
        max_tokens and max_context (it feeds positions pos..pos+k). A slot on a guard's numerics path offers none."""
        if (self.drafts is None or not gen or plan.shaped or not self.drafts.on(len(gen))
                or any(s.rows is not None for s in gen)):    # (verify windows rotate at the cache's positions)
            return plan
        k = np.zeros(len(self.slots_), np.int32)
        for s in (s for s in gen if s.numerics == DEFAULT and s.id not in self.poisoned):
            room = min(s.req.max_tokens - s.generated - 1, self.max_context - s.pos - 2)
            k[s.id] = max(0, min(self.drafts.length(s.id), room))
        return replace(plan, draft_len=k)

    def _shaping(self, live: list[Slot], sampled: list[Slot]) -> dict:
        """The plan's optional arrays, each only when some slot needs it: every live slot's penalties, logit bias,
        control vector scale and logprobs; the grammar masks of the slots this window samples for."""
        n, out = len(self.slots_), {}
        if any(s.req.sampling.penalized for s in live):
            pen = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (n, 1))
            for s in live:
                sp = s.req.sampling
                pen[s.id] = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
            out["penalties"] = pen
        if any(s.req.sampling.logit_bias for s in live):
            width = max(len(s.req.sampling.logit_bias) for s in live)
            ids, values = np.full((n, width), -1, np.int32), np.zeros((n, width), np.float32)
            for s in live:
                for j, (token, bias) in enumerate(s.req.sampling.logit_bias):
                    ids[s.id, j], values[s.id, j] = token, bias
            out["bias_ids"], out["bias_values"] = ids, values
        if any(s.req.control_scale != 1 for s in live):
            scale = np.ones(n, np.float32)
            for s in live:
                scale[s.id] = s.req.control_scale
            out["control_scale"] = scale
        if any(s.req.logprobs is not None for s in live):
            lp = np.full(n, -1, np.int32)
            for s in live:
                if s.req.logprobs is not None:
                    lp[s.id] = s.req.logprobs
            out["logprobs"] = lp
        mask = self._masks(sampled)
        if mask is not None:
            out["mask"] = mask
        return out

    def _checkpoint_at(self, s: Slot, pos: int) -> bool:
        """Whether the slot's request takes a checkpoint after its first pos tokens: every checkpoint_every tokens
        and where its prompt's last assistant header starts; never on a guard retry's numerics path (a cache hit
        must give a default-path read's tokens)."""
        return (s.req.checkpoints and s.numerics == DEFAULT and pos > 0
                and (pos % self.cache.every == 0 or pos == s.req.turn_at))

    def _next_checkpoint(self, s: Slot) -> int:
        """Where the part that reads from s.read ends at the latest: the next checkpoint position (or the prompt's
        end)."""
        n, at = len(s.prompt), s.read
        if not s.req.checkpoints or s.numerics != DEFAULT:
            return n
        nxt = (at // self.cache.every + 1) * self.cache.every
        if s.req.turn_at is not None and at < s.req.turn_at:
            nxt = min(nxt, s.req.turn_at)
        return min(nxt, n)

    def _exact(self, s: Slot) -> bool:
        """Whether the slot's device state is the one the windows applied to its request left: no window that
        computes its row was dispatched after the one applied last (lookahead)."""
        return not s.fed_past and (self._ahead_rows is None or not self._ahead_rows[s.id])

    def _late_masks(self, plan: WindowPlan) -> np.ndarray | None:
        """The masks of a dispatched plan's mask_late rows, now that the window before it is applied (their grammars
        took its tokens); a row whose request ended since is computed and dropped: None if every one has."""
        return self._masks([s for s in self.slots_ if plan.mask_late[s.id] and s.state is SlotState.GENERATING])

    def _masks(self, sampled: list[Slot]) -> np.ndarray | None:
        """The grammar masks [S, W] of the slots a window samples for (others: every token allowed); None when none
        of them has a grammar."""
        rows = {s.id: s.matcher.mask() for s in sampled if s.matcher is not None}
        if not rows:
            return None
        mask = np.full((len(self.slots_), len(next(iter(rows.values())))), -1, np.int32)
        for i, row in rows.items():
            mask[i] = row
        return mask

    def _part_tokens(self, n_decode: int) -> int:
        """The most prompt tokens a window with n_decode decode rows carries. Alone, the part size: reading with
        nothing decoding goes at full speed. Beside decode rows, what is left of the budget after them, at most the
        window's part size; but at least a quarter of that, so a prompt is read however many slots decode."""
        if not n_decode:
            return self.prefill
        return max(min(self.window_part, self.window_tokens - n_decode), max(1, self.window_part // 4))

    def _pace(self, plan: WindowPlan, res: WindowResult) -> None:
        """Charge a window with decode rows: its part's device time is owed to the streams, and each window pays
        back the prompt's share of its time, so parts take at most prompt_share of the time while slots decode.
        Nothing is banked: a prompt that arrives after a long decoding spell waits as little as one that does not."""
        part_s = 0.0
        if plan.part is not None:
            self._part_times.append(res.part_s)
            part_s = float(np.median(self._part_times))
        share = self.prompt_share
        self.part_credit = min(0.0, self.part_credit + share * (res.decode_s + part_s) - part_s)

    # --- applying a window's result
    def _apply(self, plan: WindowPlan, box: dict):
        seconds = box["seconds"]
        self.stats["windows"] += 1
        in_window = [s for s in self.slots_ if plan.decode_active[s.id]]
        if plan.part is not None:
            in_window.append(self.slots_[plan.part.slot])
        if "error" in box:
            log.error(f"strata batch: a window failed ({type(box['error']).__name__}: {box['error']}); "
                      f"ending its {len(in_window)} requests")
            for s in in_window:
                if s.req is not None:
                    self._end(s, Failed(f"the engine failed in a window: {type(box['error']).__name__}: "
                                        f"{box['error']}", 500))
            return
        res: WindowResult = box["result"]
        if plan.n_decode:
            self._pace(plan, res)
            self._measure(plan, res)
        if plan.draft_len is not None:
            self.stats["windows_verifying"] += 1
        self.stats["device_seconds_sum"] += res.decode_s + res.part_s
        self.stats["handoff_seconds_sum"] += seconds - res.decode_s - res.part_s
        now = time.perf_counter()
        started = now - seconds
        generated = 0
        for s in self.slots_:
            if s.state is SlotState.READING and s.parts > 0 and plan.n_decode:
                s.decode_ms_between_parts += res.decode_s * 1000
        for s in in_window:
            if s.req is None:                      # cancelled while its window ran
                continue
            if plan.part is not None and s.id == plan.part.slot:
                generated += self._apply_part(s, plan.part, res, started, now)
            elif s.state is SlotState.GENERATING:  # (not a slot the guard sent back to read, computed ahead)
                generated += self._apply_decode(s, res, now, plan.part is not None)
        self._recent.append((generated, seconds))

    def _apply_part(self, s: Slot, part: PromptPart, res: WindowResult, started: float, now: float) -> int:
        if s.parts == 0:
            s.t_read_start = started
        s.parts += 1
        s.read += len(part.tokens)
        s.pos = s.read
        self.stats["prompt_tokens"] += len(part.tokens)
        if not res.part_finite:
            self._nonfinite(s, part.start, s.pos - 1)
            return 0
        if self._checkpoint_at(s, s.pos):
            self.cache.take(s.id, s.pos, s.keyed)
        if not part.last:
            return 0
        s.t_read_end = s.t_first_token = s.t_token = now
        if s.parts > 1:
            log.info(f"strata batch: the prompt was read in {s.parts} parts, the slots decoding "
                     f"{s.decode_ms_between_parts:.0f} ms between them")
        copies = [self.slots_[c] for c in part.copies]
        for o in copies:                          # the other choices continue from the state the part left
            o.state, o.lead, o.read, o.pos, o.parts = SlotState.GENERATING, None, s.read, s.pos, s.parts
            o.reused = s.reused
            o.t_read_start, o.t_read_end, o.t_first_token, o.t_token = s.t_read_start, now, now, now
        s.state = SlotState.GENERATING
        self._take_token(s, res.part_next, res.part_logprobs, 0)
        for j, o in enumerate(copies):
            if o.req is not None:                 # (not ended with a failed sibling)
                self._take_token(o, int(res.copies_next[j]), res.part_logprobs, j + 1)
        return 1 + len(copies)

    def _measure(self, plan: WindowPlan, res: WindowResult) -> None:
        """The draft policy's view of a window of decode rows alone, all on the default numerics path: tokens
        emitted, device time; a verify window only when it verified drafts (one after a window that did not has
        none to verify)."""
        if self.drafts is None or plan.part is not None or plan.numerics is not None:
            return
        on = plan.decode_active
        if plan.draft_len is None:
            self.drafts.window(plan.n_decode, False, plan.n_decode, res.decode_s)
        elif res.decode_n_drafts[on].sum():
            self.drafts.window(plan.n_decode, True, int(plan.n_decode + res.decode_n_accepted[on].sum()), res.decode_s)

    def _apply_decode(self, s: Slot, res: WindowResult, now: float, beside_part: bool) -> int:
        if not res.decode_finite[s.id]:
            offered = int(res.decode_n_drafts[s.id]) if res.decode_n_drafts is not None else 0
            self._nonfinite(s, s.pos, s.pos + offered, verify=offered > 0)
            return 0
        which = "_beside_parts" if beside_part else ""
        self.stats[f"inter_token_seconds{which}_sum"] += now - s.t_token
        self.stats[f"inter_tokens{which}"] += 1
        s.t_token = now
        tokens = [int(res.decode_next[s.id])]
        if res.decode_n_accepted is not None:         # a verify window: the accepted drafts come first
            a, offered = int(res.decode_n_accepted[s.id]), int(res.decode_n_drafts[s.id])
            tokens = res.decode_accepted[s.id, :a].tolist() + tokens
            s.drafts += offered
            s.accepted += a
            self.stats["drafts_verified"] += offered
            self.stats["drafts_accepted"] += a
            self.drafts.record(s.id, offered, a)
        for i, token in enumerate(tokens):
            s.pos += 1
            s.fed_past = len(tokens) - 1 - i      # accepted tokens the device fed past this one
            self._take_token(s, token, res.decode_logprobs, s.id)
            if s.state is not SlotState.GENERATING:      # ended: the tokens after its end are dropped
                return i + 1
        if s.req is not None and self._checkpoint_at(s, s.pos) and self._exact(s):
            self.cache.take(s.id, s.pos, self._fed(s))
        return len(tokens)

    @staticmethod
    def _fed(s: Slot) -> list:
        """The tokens of the slot's sequence as the prompt cache matches them: its prompt (Request.cache_ids) and the
        tokens generated (the last one not fed yet)."""
        return list(s.keyed)

    # --- the numerics guard
    def _nonfinite(self, s: Slot, first: int, last: int, verify: bool = False) -> None:
        """Slot s's row (positions first..last: a decode row's one, a prompt part's, or a verify row's, its drafts'
        included) went non-finite: nothing of it is emitted, the slot is poisoned until repaired, and the guard
        decides between a retry on another numerics path and an explicit error."""
        self.stats["nonfinite_rows"] += 1
        attempts = s.attempts + (Attempt(s.numerics, first, last),)
        d = self.guard.failed(s.req.id, attempts, time.monotonic())
        self.poisoned[s.id] = self.poisoned.get(s.id, False) or d.rebuild
        # a retry resumes from the last checkpoint at or before the failure (taken of finite windows, so clean;
        # the repair keeps the KV below it), but after a storm nothing of the device state is trusted
        at = self.cache.rewind(s.id, first, s.keyed) if isinstance(d, Retry) and not self.poisoned[s.id] else 0
        if not at:
            self.cache.drop(s.id)                 # its conversation and the checkpoints of this attempt
        where = (f"position {last}" if first == last else f"the verify row {first}..{last}" if verify
                 else f"the prompt part {first}..{last} (logits at {last})")
        head = (f"strata guard: non-finite at {where}, request {s.req.id} on slot {s.id}, attempt {len(attempts)} "
                f"on {s.numerics} numerics: nothing of it is sent")
        if d.rebuild:
            self.stats["guard_rebuilds"] += 1
            log.warning(f"strata guard: {self.guard.storm} different requests went non-finite within "
                        f"{self.guard.window_s:.0f} s: every expert slot is verified and the expert device state "
                        f"rebuilt before the next window")
        if isinstance(d, GiveUp):
            self.stats["guard_failed"] += 1
            log.warning(f"{head}; {d.message()}: the request ends with error non_finite")
            self._end(s, Failed(d.message(), 500, "non_finite", d.detail()))
            return
        self.stats["guard_retries"] += 1
        whence = f"its checkpoint at token {at}" if at else "the start"
        log.warning(f"{head}; the expert slots are verified, then it reads its prompt again from {whence} "
                    f"({len(s.prompt) - at} of its {len(s.prompt)} tokens, the {len(s.sent)} already sent among "
                    f"them) on {d.numerics} numerics")
        s.state, s.read, s.pos, s.parts, s.reused = SlotState.READING, at, at, 0, at
        s.numerics, s.attempts = d.numerics, attempts

    async def _repair(self) -> None:
        """Between windows: the executor verifies the expert slots (rewriting bad ones from the host tier), clears
        the poisoned slots' state and, after a storm of failures, rebuilds the expert device state."""
        slots, rebuild = tuple(sorted(self.poisoned)), any(self.poisoned.values())
        self.poisoned = {}
        if rebuild:                               # after a storm no device state is trusted: retries read from 0
            for i in slots:
                self.cache.drop(i)
                s = self.slots_[i]
                s.read = s.pos = s.reused = 0
        keep = tuple(self.cache.kept(i) for i in slots)         # the KV below a retry's checkpoint
        # a retry that resumes from a checkpoint (rewind) gets it back once its slot is cleared
        resume = [i for i in slots if self.slots_[i].req is not None and self.slots_[i].read > 0]

        def repair():
            rep = self.executor.repair(slots, rebuild, keep)
            for i in resume:
                self.stats["guard_tokens_resumed"] += self.cache.resume(i)
            return rep
        try:
            rep: Repair = await anyio.to_thread.run_sync(repair)
        except Exception as exc:                  # noqa: BLE001 - the slots' requests fail, not the server
            log.error(f"strata guard: repairing after a non-finite row failed ({type(exc).__name__}: {exc}); "
                      f"ending the requests of slots {list(slots)}")
            for i in slots:
                s = self.slots_[i]
                if s.req is not None:
                    self._end(s, Failed(f"the engine failed repairing after a non-finite row: {exc}", 500))
            return
        self.stats["expert_slots_repaired"] += len(rep.bad)
        found = "all matched" if not rep.bad else (
            f"{len(rep.bad)} did not and were rewritten from the host tier: "
            + ", ".join(f"slot {i} (layer {p}, expert {e})" for i, p, e in rep.bad)
            + "; device memory that changes under the engine points at the device (check it for memory errors)")
        (log.warning if rep.bad else log.info)(
            f"strata guard: verified {rep.verified} expert slots against the pack's checksums in "
            f"{rep.seconds * 1000:.0f} ms{', rebuilt the expert device state' if rep.rebuilt else ''}: {found}; "
            f"cleared the state of slot{'s' if len(slots) > 1 else ''} {', '.join(map(str, slots))}")

    def _take_token(self, s: Slot, token: int, logprobs: Logprobs | None = None, row: int = 0):
        """A sampled token: stream its text (and logprob), advance its grammar, or end the choice (end-of-sequence,
        stop string, the grammar complete, length)."""
        s.generated += 1
        s.last_token = token
        s.sent.append(token)
        self.stats["generated_tokens"] += 1
        if token in s.stops:
            self._finish(s, "stop")
            return
        if logprobs is not None and s.req.logprobs is not None:
            k = s.req.logprobs
            top = tuple(zip(logprobs.top_ids[row, :k].tolist(), logprobs.top[row, :k].tolist()))
            s.logprobs.append(TokenLogprob(token, float(logprobs.sampled[row]), top))
        if s.matcher is not None and not s.matcher.accept(token):
            # the model's vocabulary cannot write what the grammar asks for here: the request's grammar (a schema,
            # a forced tool call) is what this model cannot follow, so the client hears it as a 4xx, never a 500
            self._end(s, Failed(f"token {token} broke the request's grammar at generated token {s.generated}: "
                                f"{s.matcher.error()}; this model cannot write a reply that follows the grammar",
                                422, "grammar_unfollowable"))
            return
        d = s.output.push(token)
        if d.content or d.reasoning:
            s.events.append(replace(d, index=s.choice, logprobs=self._logprobs_out(s)))
        if s.output.stopped or (s.matcher is not None and s.matcher.done()):
            self._finish(s, "stop")
        elif s.generated >= s.req.max_tokens or s.pos + 1 >= self.max_context:
            self._finish(s, "length")

    @staticmethod
    def _logprobs_out(s: Slot) -> tuple:
        out = tuple(s.logprobs)
        s.logprobs.clear()
        return out

    def _finish(self, s: Slot, reason: str):
        d = s.output.finish()
        lps = self._logprobs_out(s)
        if d.content or d.reasoning or lps:
            s.events.append(Delta(d.content, d.reasoning, s.choice, lps))
        now = time.perf_counter()
        read_ms = (s.t_read_end - s.t_read_start) * 1000
        gen_ms = (now - s.t_first_token) * 1000
        n = len(s.req.prompt_ids)
        # the end of the reply: a checkpoint of the state after the last token fed, when exact
        if (s.req.checkpoints and s.numerics == DEFAULT and self._exact(s) and s.pos > 0
                and s.pos == n + s.generated - 1):
            self.cache.take(s.id, s.pos, self._fed(s))
        reused = min(s.reused, n)                 # (a retry may resume past the prompt, among the tokens sent)
        read = n - reused
        drafts = f", drafts accepted {s.accepted} of {s.drafts}" if self.drafts is not None else ""
        log.info(f"strata serve: prompt {n} tokens = {reused} reused + {read} read in {read_ms:.0f} ms "
                 f"({read / max(read_ms / 1000, 1e-9):.1f} tok/s), {s.generated} generated in {gen_ms:.0f} ms "
                 f"({max(s.generated - 1, 0) / max(gen_ms / 1000, 1e-9):.1f} tok/s){drafts}, "
                 f"{len(self.cache.checkpoints(s.id))} checkpoints, finish {reason} ({s.req.id})"
                 + (f", attempt {len(s.attempts) + 1} on {s.numerics} numerics" if s.attempts else ""))
        timings = {"read_ms": read_ms, "generate_ms": gen_ms, "parts": s.parts, "reused": s.reused}
        if self.drafts is not None:
            timings.update(drafts=s.drafts, drafts_accepted=s.accepted)
        self._end(s, Finished(reason, n, s.generated, timings, index=s.choice, cached_tokens=reused))

    def _end(self, s: Slot, final):
        """Queue the choice's last event and free the slot (its state is garbage until a new sequence starts). A
        Failed ends the whole request: its other choices' slots are freed with it, without events of their own."""
        g = s.group
        s.events.append(final)
        self._pending.append((g, s.events))
        s.events = []
        self._keep(s, final)
        s.reset()
        g.live -= 1
        if isinstance(final, Failed):
            for o in self.slots_:
                if o.group is g:
                    self._keep(o, final)
                    o.reset()
                    g.live -= 1
        if g.live == 0:
            self.stats["requests_finished" if isinstance(final, Finished) else "requests_failed"] += 1
            self._pending.append((g, None))       # the stream closes after its last events

    def _keep(self, s: Slot, final) -> None:
        """What the prompt cache keeps of a slot whose choice ends: its conversation up to the tokens its state
        holds; nothing after an error other than a client's cancel (its state may be poisoned or unknown)."""
        if isinstance(final, Failed) and final.status != 499 or s.lead is not None or self.cache.live[s.id] is None:
            self.cache.drop(s.id)
            return
        fed = self._fed(s)[:s.pos]
        self.cache.end(s.id, fed, len(fed))

    def _send_pending(self):
        """Send every event produced so far: ended choices' last events (closing a request's stream after its last
        choice), then the live slots' new text."""
        for g, events in self._pending:
            if events is None:
                g.send.close()
                continue
            for ev in events:
                _send(g.send, ev)
        self._pending.clear()
        for s in self.slots_:
            if s.req is not None and s.events:
                for ev in s.events:
                    if not _send(s.group.send, ev):
                        self.cancelled.add(s.req.id)
                        break
                s.events = []


def window_part(cap: Capacity, window_tokens: int) -> int:
    """The largest prompt part beside decode rows: the most tokens, at most the part size, whose compiled (padded)
    part size fits window_tokens."""
    limit = min(window_tokens, cap.part_size)
    if cap.padded(limit) <= window_tokens:
        return limit
    return max((s for s in cap.part_sizes if s <= limit), default=1)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice: the request's own for the first, a distinct one for each other."""
    return seed if choice == 0 else (seed + choice * 0x9E3779B97F4A7C15) % (1 << 63)


def _send(send, event) -> bool:
    """Deliver an event; False when the client's side is gone (its request will be cancelled)."""
    try:
        send.send_nowait(event)
        return True
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        return False
