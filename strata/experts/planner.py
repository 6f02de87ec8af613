"""The memory planner: from one device's own free-memory figure, how many expert slots fit beside the sequence state
and the working buffers, and how many experts the host mirror holds; and max_context auto (`auto_context`).

Each device is sized from its own query, taken before the plan allocates anything on it (never from a process-wide
figure that includes another device's allocations: ../shared/seeds/002_*.txt, part 2). The plan is printed, and
the engine allocates exactly what it printed; when even the minimum does not fit, it refuses and names what to
change.
"""
from __future__ import annotations

from dataclasses import dataclass

from strata.errors import ConfigError

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    free_bytes: int | None       # the device's own figure at planning time (None: the device does not say)
    reserve_bytes: int           # --vram-reserve-mib: left untouched
    state_bytes: int             # sequence state (KV + recurrent) of every sequence
    work_bytes: int              # activations of the largest prompt part (estimate)
    slot_bytes: int              # one expert
    slots: int                   # device slots in the cache
    staging: int                 # of which reserved for prompt parts (borrowing off)
    total_experts: int
    mirrored: int                # experts held in host RAM
    mirror_bytes: int
    device: str = "the device"   # which device, as its backend names it

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def planned_bytes(self) -> int:
        """Everything the plan puts on the device beyond what was already there."""
        return self.cache_bytes + self.state_bytes + self.work_bytes

    def lines(self) -> list[str]:
        free = "unknown (the device does not report it)" if self.free_bytes is None else \
            f"{self.free_bytes / GIB:.2f} GiB free"
        cached = self.slots - self.staging
        out = [f"strata plan: {self.device}: {free}; reserve {self.reserve_bytes / MIB:.0f} MiB, sequence state "
               f"{self.state_bytes / MIB:.1f} MiB, working buffers {self.work_bytes / MIB:.1f} MiB",
               f"strata plan: expert cache {cached} slots of {self.slot_bytes / MIB:.2f} MiB = "
               f"{cached * self.slot_bytes / GIB:.2f} GiB, {cached} of {self.total_experts} experts "
               f"({100 * cached / max(self.total_experts, 1):.0f}%)"
               + (f", plus {self.staging} staging slots for prompt parts" if self.staging else "")]
        if self.mirrored < self.total_experts:
            out.append(f"strata plan: host mirror {self.mirrored} experts = {self.mirror_bytes / GIB:.2f} GiB of RAM; "
                       f"the other {self.total_experts - self.mirrored} are read from the pack on demand")
        else:
            out.append(f"strata plan: host mirror holds all {self.total_experts} experts "
                       f"({self.mirror_bytes / GIB:.2f} GiB of RAM)")
        return out


def auto_context(positions: int, free_bytes: int | None, *, cap: int, reserve_mib: int, work_bytes: int,
                 fixed_state_bytes: int, token_state_bytes: int, pad: int, sequences: int) -> tuple[int, str]:
    """max_context auto -> (tokens, the plan line saying why): the model's positions, at most `cap` where the device
    does not report its free memory, else at most what lets the sequence state of `sequences` sequences (their fixed
    bytes plus their bytes per token times max_context + pad rows) take half of the room beside the reserve and the
    working buffers: the other half stays for expert slots."""
    head = f"strata plan: max_context {{}} (auto): the model supports {positions} positions"
    if free_bytes is None:
        n = min(positions, cap)
        why = f", capped at {cap} (the device does not report its free memory)" if n < positions else ""
        return n, head.format(n) + why
    room = free_bytes - reserve_mib * MIB - work_bytes
    budget = room // 2
    fit = (budget - fixed_state_bytes) // max(token_state_bytes, 1) - pad
    if fit >= positions:
        return positions, head.format(positions)
    # a round number below what fits, never under 16 (a plan that cannot hold even that refuses on its own)
    n = max(16, fit - fit % 1024 if fit >= 2048 else fit)
    used = fixed_state_bytes + (n + pad) * token_state_bytes
    return n, head.format(n) + (f"; {sequences} sequence states of {n} tokens take {used / GIB:.2f} "
                                f"GiB, at most half of the {max(room, 0) / GIB:.2f} GiB left beside the reserve and "
                                f"working buffers (set max_context to trade expert slots for context)")


def plan_memory(free_bytes: int | None, *, slot_bytes: int, total_experts: int, state_bytes: int, work_bytes: int,
                expert_cache: int | str = "auto", vram_reserve_mib: int = 0, staging: int = 0,
                min_slots: int = 1, host_budget_bytes: int | None = None, stream: bool = False,
                device: str = "the device") -> MemoryPlan:
    reserve = vram_reserve_mib * MIB
    need_min = min_slots + staging
    if free_bytes is None:
        room = None
    else:
        room = free_bytes - reserve - state_bytes - work_bytes
    if expert_cache == "auto":
        fit = total_experts + staging if room is None else int(room // slot_bytes)
        slots = min(total_experts + staging, fit)
    else:
        if not isinstance(expert_cache, int) or isinstance(expert_cache, bool) or expert_cache < 1:
            raise ConfigError(f"expert_cache must be 'auto' or a positive number of slots, found {expert_cache!r}")
        slots = min(expert_cache, total_experts) + staging
        if room is not None and slots * slot_bytes > room:
            raise ConfigError(
                f"expert_cache {expert_cache} needs {slots * slot_bytes / GIB:.2f} GiB on {device}, but only "
                f"{max(room, 0) / GIB:.2f} GiB is left there ({free_bytes / GIB:.2f} GiB free - {reserve / MIB:.0f} "
                f"MiB reserve - {state_bytes / MIB:.1f} MiB sequence state - {work_bytes / MIB:.1f} MiB working "
                f"buffers); lower expert_cache, max_context, parallel or vram_reserve_mib")
    if slots < need_min and expert_cache != "auto" and (room is None or need_min * slot_bytes <= room):
        raise ConfigError(
            f"expert_cache {expert_cache} (--expert-cache) is below the minimum of {need_min} slots ({min_slots} for "
            f"one token's experts" + (f" + {staging} staging" if staging else "") + f"); set it to at least "
            f"{need_min}, or to auto")
    if slots < need_min:
        have = "unknown" if room is None else f"{max(room, 0) / MIB:.1f} MiB"
        raise ConfigError(
            f"{device} cannot hold the minimum expert cache: {need_min} slots of {slot_bytes / MIB:.2f} MiB "
            f"({min_slots} for one token's experts" + (f" + {staging} staging" if staging else "") +
            f") beside {state_bytes / MIB:.1f} MiB of sequence state and {work_bytes / MIB:.1f} MiB of working "
            f"buffers, with {reserve / MIB:.0f} MiB reserved; room left: {have}. Lower max_context, parallel, "
            f"prefill or vram_reserve_mib, or use a smaller expert format")
    if stream:
        mirrored = 0
    elif host_budget_bytes is None:
        mirrored = total_experts
    else:
        mirrored = min(total_experts, max(0, int(host_budget_bytes // slot_bytes)))
    return MemoryPlan(free_bytes=free_bytes, reserve_bytes=reserve, state_bytes=state_bytes, work_bytes=work_bytes,
                      slot_bytes=slot_bytes, slots=slots, staging=staging if slots > staging else 0,
                      total_experts=total_experts, mirrored=mirrored, mirror_bytes=mirrored * slot_bytes,
                      device=device)


def available_ram_bytes() -> int | None:
    """The kernel's MemAvailable (None where it reports none)."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def place_ple_table(nbytes: int, setting: str, device_free: int | None, ram_free: int | None,
                    from_file: bool) -> tuple[str, str]:
    """Where the PLE tables (nbytes in their format) live -> (place, why): the setting when not auto; auto: the
    device when they take at most a quarter of its free memory (or it does not report it), else host RAM when they
    take at most half the available RAM, else the checkpoint's files (disk). A place that cannot hold them: a
    ConfigError naming the figures and the setting."""
    if setting != "auto":
        place, why = setting, "ple_table"
    elif device_free is None or nbytes <= device_free // 4:
        place, why = "device", "auto: " + ("the device does not report its free memory" if device_free is None else
                                           f"at most a quarter of the device's {device_free / GIB:.1f} GiB free")
    elif ram_free is None or nbytes <= ram_free // 2 or not from_file:
        place, why = "host", (f"auto: more than a quarter of the device's {device_free / GIB:.1f} GiB free" +
                              ("" if ram_free is None else f", {ram_free / GIB:.1f} GiB of RAM available"))
    else:
        place, why = "disk", (f"auto: more than a quarter of the device's {device_free / GIB:.1f} GiB free and half "
                              f"the {ram_free / GIB:.1f} GiB of RAM available")
    if place == "disk" and not from_file:
        raise ConfigError("ple_table = disk maps the checkpoint's files, and this model's weights are drawn at load: "
                          "set ple_table to host or device")
    if place == "host" and ram_free is not None and nbytes > ram_free:
        raise ConfigError(f"the PLE tables take {nbytes / GIB:.2f} GiB, more than the {ram_free / GIB:.2f} GiB of RAM "
                          f"available: set ple_table = disk (read through the page cache) or ple_format = float8")
    if place == "device" and device_free is not None and nbytes > device_free:
        raise ConfigError(f"the PLE tables take {nbytes / GIB:.2f} GiB, more than the {device_free / GIB:.2f} GiB free "
                          f"on the device: set ple_table = host or disk, or ple_format = float8")
    return place, why
